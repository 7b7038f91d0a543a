"""Trains the embedded demo model's DFlash2 block drafter by distillation from the demo target.

Owns the drafter's training recipe. The corpus is the target's own continuations: TinyStories
documents (plain and chat, as the demo model was trained on) cut into prompts, each continued by
the frozen target (greedy for two thirds of the rows, sampled at temperature 0.8 for the rest),
because the drafter is judged by how often its block matches what the target would produce.
The labels are the target's distributions at every position (its top 32 tokens, renormalised).
A training example is one block: an anchor position a of a sequence, the target's features
(`target_layer_ids`) at every position before a as context, [token a, mask * K] as the block,
and the target's distributions for tokens a + 1 .. a + K as labels. Losses: soft cross-entropy
of the full proposal's logits at each block position (weights decaying along the block, as
later positions matter only when earlier ones are accepted) plus the candidate selector's
cross-entropy over each position's top-k candidates given the true previous token.

Everything is the package's own code (`models/qwen3_6` for the target and its features,
`models/dflash` for the drafter), and a function of `--seed`. Writes the drafter in the public
DFlash checkpoint layout (config.json + model.safetensors).

    python scripts/train_dflash.py --out=ninfer_jax/assets/demo_dflash --log=/tmp/dflash.jsonl
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import train_tokenizer

from ninfer_jax.frontend import load_tokenizer
from ninfer_jax.loader import load_model
from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.dflash.model import (
    block_hidden,
    block_logits,
    context_kv,
    selector_scores,
)
from ninfer_jax.models.dflash.weights import init_params, params_to_hf
from ninfer_jax.models.qwen3_6 import CausalKV, ContiguousKV, GDNState, step

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "directory to write the drafter to (config.json, safetensors)")
flags.DEFINE_string("log", None, "JSON-lines log of losses (default: stdout only)")
flags.DEFINE_integer("seed", 0, "seed of initialisation, data order and sampled continuations")
flags.DEFINE_integer("sequences", 3072, "target continuations to train on")
flags.DEFINE_integer("valid_sequences", 128, "held-out continuations for the block accuracy")
flags.DEFINE_integer("prompt_len", 24, "prompt tokens of each continuation")
flags.DEFINE_integer("seq_len", 128, "tokens per sequence (prompt + continuation)")
flags.DEFINE_integer("steps", 2000, "optimiser steps")
flags.DEFINE_integer("batch", 16, "sequences per step")
flags.DEFINE_integer("anchors", 8, "blocks per sequence per step")
flags.DEFINE_float("lr", 2e-3, "peak learning rate")
flags.DEFINE_integer("layers", 2, "drafter layers")
flags.DEFINE_integer("block_size", 16, "block size (K = block_size - 1 drafts)")
flags.DEFINE_integer("window", 64, "sliding window of the drafter's attention")
flags.DEFINE_integer("eval_every", 250, "steps between validation logs")

TOP = 32  # label tokens kept per position
MASK_TOKEN = 0  # <unk>: never produced by the demo tokenizer
TARGET_LAYERS = (1, 2, 3)
DECAY = 7.0  # loss weight of block position j: exp(-(j - 1) / DECAY)


def drafter_config(target) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=512, num_layers=FLAGS.layers,
        num_q_heads=3, num_kv_heads=1, head_dim=64, vocab_size=target.vocab_size,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        layer_types=("sliding_attention",) * FLAGS.layers, sliding_window=FLAGS.window,
        causal=(False,) * FLAGS.layers, block_size=FLAGS.block_size, mask_token_id=MASK_TOKEN,
        target_layer_ids=TARGET_LAYERS, conv_kernel_size=2, conv_group_size=16,
        selector_rank=32, selector_top_k=8, final_logit_softcapping=30.0)


def hf_config(cfg: DFlashConfig, num_target_layers: int) -> dict:
    """The public layout's config.json for `cfg`."""
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "attention_bias": False,
        "is_causal": False, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_q_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": "silu",
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
        "use_sliding_window": True, "max_position_embeddings": 2048,
        "num_target_layers": num_target_layers, "dtype": "float32",
        "dflash_config": {
            "block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "conv_kernel_size": cfg.conv_kernel_size, "conv_group_size": cfg.conv_group_size,
            "selector_rank": cfg.selector_rank, "selector_top_k": cfg.selector_top_k,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            "output_multiplier": cfg.output_multiplier},
    }


# Data --------------------------------------------------------------------------------------
def prompts(tok, n: int, seed: int) -> np.ndarray:
    """[n, prompt_len] prompts: windows of the training documents, in a seeded order."""
    stories = train_tokenizer.train_stories()
    docs = train_tokenizer.documents(stories, 0.25, seed)
    stream = np.concatenate([tok.encode(d) for d in docs[: 4 * n]])
    rows = train_tokenizer.windows(stream, FLAGS.prompt_len)[:, :-1]
    order = np.random.default_rng(seed).permutation(len(rows))
    return rows[order[:n]]


def continuations(target, prompt_ids: np.ndarray, seed: int) -> np.ndarray:
    """[n, seq_len] prompt + the target's continuation (2/3 greedy, 1/3 sampled at 0.8)."""
    cfg, params = target.config, target.params
    n, p = prompt_ids.shape
    run = jax.jit(step, static_argnums=1)

    @jax.jit
    def pick(logits, key, sampled):
        drawn = jax.random.categorical(key, logits / 0.8)
        return jnp.where(sampled, drawn, jnp.argmax(logits, axis=-1)).astype(jnp.int32)

    out_rows, batch = [], 256
    key = jax.random.key(seed)
    for start in range(0, n, batch):
        ids = jnp.asarray(prompt_ids[start:start + batch], jnp.int32)
        b = ids.shape[0]
        sampled = jnp.asarray(np.arange(start, start + b) % 3 == 2)
        kv = ContiguousKV.zeros(cfg, b, FLAGS.seq_len)
        out = run(params, cfg, ids, jnp.zeros((b,), jnp.int32), GDNState.zeros(cfg, b), kv)
        kv = out.kv.advance(jnp.full((b,), p, jnp.int32))
        seq = [ids]
        for pos in range(p, FLAGS.seq_len):
            key, sub = jax.random.split(key)
            token = pick(out.logits[:, -1], sub, sampled)
            seq.append(token[:, None])
            if pos + 1 == FLAGS.seq_len:
                break
            out = run(params, cfg, token[:, None], jnp.full((b,), pos, jnp.int32), out.gdn, kv)
            kv = out.kv.advance(jnp.ones((b,), jnp.int32))
        out_rows.append(np.asarray(jnp.concatenate(seq, axis=1)))
    return np.concatenate(out_rows)


def target_outputs(target, sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features [n, L, F*H], top ids [n, L, TOP], top probs [n, L, TOP]) of the frozen target:
    position p's distribution is over the token at p + 1."""
    cfg, params = target.config, target.params

    @jax.jit
    def one(ids):
        b = ids.shape[0]
        out = step(params, cfg, ids, jnp.zeros((b,), jnp.int32), GDNState.zeros(cfg, b),
                   CausalKV(), feature_layers=TARGET_LAYERS)
        probs, top = jax.lax.top_k(jax.nn.softmax(out.logits, axis=-1), TOP)
        return out.features, top, probs / jnp.sum(probs, axis=-1, keepdims=True)

    parts = [one(jnp.asarray(sequences[i:i + 64])) for i in range(0, len(sequences), 64)]
    return tuple(np.concatenate([np.asarray(p[k]) for p in parts]) for k in range(3))


# Losses ------------------------------------------------------------------------------------
def blocks(params, cfg: DFlashConfig, embed, features, tokens, anchors):
    """The drafter's hidden states [B*A, K, H] and logits [B*A, K, V] for blocks at `anchors`
    [B, A] of sequences `tokens` [B, L] with target features [B, L, F*H]."""
    b, length = tokens.shape
    a = anchors.shape[1]
    t = cfg.block_size
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    k, v = context_kv(params, cfg, features, positions)  # [B, L, Ld, Hkv, D]
    rep = functools.partial(jnp.repeat, repeats=a, axis=0)
    anchor = anchors.reshape(-1)
    block_pos = anchor[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    block = jnp.full((b * a, t), cfg.mask_token_id, jnp.int32)
    block = block.at[:, 0].set(jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1))
    ctx_pos = rep(positions)
    hidden = block_hidden(params, cfg, embed[block] * cfg.input_embedding_scale, block_pos,
                          rep(k), rep(v), ctx_pos, ctx_pos < anchor[:, None])[:, 1:]
    return hidden, block_logits(cfg, hidden, embed)


def loss_fn(params, cfg: DFlashConfig, embed, features, tokens, top_ids, top_probs, anchors):
    b, length = tokens.shape
    hidden, logits = blocks(params, cfg, embed, features, tokens, anchors)
    k = cfg.block_size - 1
    label_pos = anchors.reshape(-1)[:, None] + jnp.arange(k)[None, :]  # predicts label_pos + 1
    valid = label_pos + 1 < length
    label_pos = jnp.minimum(label_pos, length - 1)
    seq = jnp.repeat(jnp.arange(b), anchors.shape[1])[:, None]
    ids, probs = top_ids[seq, label_pos], top_probs[seq, label_pos]  # [N, K, TOP]
    weight = jnp.exp(-jnp.arange(k) / DECAY)[None, :] * valid
    logp = jax.nn.log_softmax(logits, axis=-1)
    full = -jnp.sum(probs * jnp.take_along_axis(logp, ids, axis=-1), axis=-1)
    # The selector over the proposal's top-k candidates, given the true previous token.
    unary, cand = jax.lax.top_k(logits, cfg.selector_top_k)
    cand = jax.lax.stop_gradient(cand)
    previous = tokens[seq, label_pos]  # the token at label_pos: the block's previous position
    scores = jax.vmap(functools.partial(selector_scores, params, cfg), in_axes=1, out_axes=1)(
        hidden, previous, unary, cand)
    in_cand = (cand[..., :, None] == ids[..., None, :])  # [N, K, k, TOP]
    target = jnp.sum(in_cand * probs[..., None, :], axis=-1)  # label mass of each candidate
    covered = jnp.sum(target, axis=-1)
    target = target / jnp.maximum(covered, 1e-9)[..., None]
    sel = -jnp.sum(target * jax.nn.log_softmax(scores, axis=-1), axis=-1)
    sel_weight = weight * (covered > 0.1)
    total = jnp.sum(weight * full) / jnp.sum(weight) + \
        jnp.sum(sel_weight * sel) / jnp.maximum(jnp.sum(sel_weight), 1.0)
    return total


def accuracy(params, cfg: DFlashConfig, embed, features, tokens, top_ids) -> dict:
    """Greedy block accuracy on held-out continuations, anchors every 8 positions: how often
    each block position's draft (selector path and full proposal) is the target's argmax
    given the previous positions right, and the mean accepted length of a block."""
    b, length = tokens.shape
    k = cfg.block_size - 1
    anchors = jnp.broadcast_to(jnp.arange(FLAGS.prompt_len, length - k, 8), (b, (
        length - k - FLAGS.prompt_len + 7) // 8))
    hidden, logits = blocks(params, cfg, embed, features, tokens, anchors)
    label_pos = anchors.reshape(-1)[:, None] + jnp.arange(k)[None, :]
    seq = jnp.repeat(jnp.arange(b), anchors.shape[1])[:, None]
    want = top_ids[seq, label_pos, 0]  # the target's argmax for token label_pos + 1
    full = jnp.argmax(logits, axis=-1) == want
    unary, cand = jax.lax.top_k(logits, cfg.selector_top_k)
    rows = jnp.arange(hidden.shape[0])
    previous = tokens[seq[:, 0], anchors.reshape(-1)]
    path = []
    for j in range(k):
        s = selector_scores(params, cfg, hidden[:, j], previous, unary[:, j], cand[:, j])
        previous = cand[rows, j, jnp.argmax(s, axis=-1)]
        path.append(previous)
    selected = jnp.stack(path, axis=1) == want
    return {"full_pos1": jnp.mean(full[:, 0]),
            "full_accepted": jnp.mean(jnp.sum(jnp.cumprod(full, axis=1), axis=1)),
            "selector_pos1": jnp.mean(selected[:, 0]),
            "selector_accepted": jnp.mean(jnp.sum(jnp.cumprod(selected, axis=1), axis=1))}


def main(argv):
    del argv
    log = train_tokenizer.Log(FLAGS.log)
    target = load_model()
    tok = load_tokenizer(target.path)
    cfg = drafter_config(target.config)
    n, nv = FLAGS.sequences, FLAGS.valid_sequences
    seqs = continuations(target, prompts(tok, n + nv, FLAGS.seed), FLAGS.seed)
    feats, top_ids, top_probs = target_outputs(target, seqs)
    log(event="data", sequences=n, valid=nv, seq_len=FLAGS.seq_len,
        greedy_target_agreement=float(np.mean(top_ids[:, FLAGS.prompt_len - 1:-1, 0]
                                              == seqs[:, FLAGS.prompt_len:])))
    embed = target.params["embed"]
    params = init_params(cfg, jax.random.key(FLAGS.seed), std=0.02)
    num_params = sum(a.size for a in jax.tree.leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, FLAGS.lr, FLAGS.steps // 20,
                                                  FLAGS.steps, end_value=FLAGS.lr / 20)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b1=0.9, b2=0.95,
                                                                  weight_decay=0.01))
    opt_state = opt.init(params)
    log(event="start", num_params=int(num_params), config=cfg.to_dict(),
        flags={k: FLAGS[k].value for k in ("seed", "sequences", "steps", "batch", "anchors",
                                           "lr", "layers", "block_size", "window")})

    @jax.jit
    def train_step(params, opt_state, features, tokens, ids, probs, anchors):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, embed, features, tokens, ids,
                                                  probs, anchors)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate = jax.jit(lambda p, f, t, i: accuracy(p, cfg, embed, f, t, i))
    valid = (feats[n:], seqs[n:], top_ids[n:])
    rng = np.random.default_rng(FLAGS.seed + 1)
    recent = []
    for i in range(1, FLAGS.steps + 1):
        rows = rng.choice(n, FLAGS.batch, replace=False)
        anchors = rng.integers(FLAGS.prompt_len - 1, FLAGS.seq_len - 2,
                               (FLAGS.batch, FLAGS.anchors)).astype(np.int32)
        params, opt_state, loss = train_step(params, opt_state, feats[rows], seqs[rows],
                                             top_ids[rows], top_probs[rows], anchors)
        recent.append(loss)
        if i % FLAGS.eval_every == 0 or i == FLAGS.steps:
            log(event="eval", step=i, train_loss=round(float(np.mean(recent)), 4),
                **{k: round(float(v), 4) for k, v in evaluate(params, *valid).items()})
            recent = []
    if FLAGS.out:
        from safetensors.numpy import save_file

        out = pathlib.Path(FLAGS.out)
        out.mkdir(parents=True, exist_ok=True)
        config = hf_config(cfg, target.config.num_layers)
        config["ninfer_notes"] = (f"trained by scripts/train_dflash.py --seed={FLAGS.seed} "
                                  f"--steps={FLAGS.steps} on the embedded demo model")
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {k: np.ascontiguousarray(v, np.float32)
                   for k, v in params_to_hf(cfg, jax.device_get(params)).items()}
        save_file(tensors, str(out / "model.safetensors"))
        log(event="wrote", path=str(out), bytes=(out / "model.safetensors").stat().st_size)


if __name__ == "__main__":
    app.run(main)
