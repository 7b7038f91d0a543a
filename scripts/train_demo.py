"""Trains the embedded demo model (a small dense Qwen3.6 hybrid) and its MTP head on TinyStories.

Owns the demo's training recipe: the model config, packing documents into fixed windows, AdamW
with warm-up and cosine decay, validation on held-out text, MTP-head training on the frozen
model, and writing the artifact (tokenizer and chat template included). The model is the
package's own `forward`/`step`/`mtp_step`; nothing here is a second implementation. Everything
is a function of `--seed` (data order, initialisation), so a rerun reproduces the losses.

    python scripts/train_demo.py --out=ninfer_jax/assets/demo --log=/tmp/train_demo.jsonl
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import train_tokenizer

from ninfer_jax.artifact.format import write_artifact
from ninfer_jax.frontend import load_tokenizer
from ninfer_jax.models.qwen3_6 import CausalKV, ContiguousKV, ModelConfig, forward, step
from ninfer_jax.models.qwen3_6.gdn import GDNState
from ninfer_jax.models.qwen3_6.mtp import mtp_step
from ninfer_jax.models.qwen3_6.weights import init_params

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "artifact directory to write")
flags.DEFINE_string("log", None, "JSON-lines log of losses (default: stdout only)")
flags.DEFINE_integer("seed", 0, "seed of initialisation and data order")
flags.DEFINE_integer("hidden", 192, "hidden size")
flags.DEFINE_integer("groups", 1, "number of (3 GDN + 1 attention) layer groups")
flags.DEFINE_integer("steps", 1000, "main-model optimiser steps")
flags.DEFINE_integer("mtp_steps", 100, "MTP-head optimiser steps")
flags.DEFINE_integer("batch", 8, "sequences per step")
flags.DEFINE_integer("seq_len", 256, "tokens per training window")
flags.DEFINE_float("lr", 3e-3, "peak learning rate")
flags.DEFINE_float("chat_share", 0.25, "share of stories formatted as chat turns")
flags.DEFINE_integer("eval_every", 50, "steps between validation-loss logs")
flags.DEFINE_integer("eval_windows", 32, "validation windows for the periodic logs")
flags.DEFINE_integer("valid_windows", 400, "validation windows for the final loss and MTP accuracy")
flags.DEFINE_string("sample_from", None, "skip training: print greedy and sampled continuations "
                    "of --prompts from this artifact")
flags.DEFINE_list("prompts", ["Once upon a time", "One day, a little girl named Lily",
                              "Tom and his dog went to the park."], "prompts for --sample_from")
flags.DEFINE_integer("max_new_tokens", 120, "continuation length for --sample_from")
flags.DEFINE_float("temperature", 0.8, "sampling temperature for --sample_from (top-k 40)")


def demo_config(hidden: int, groups: int, vocab_size: int, eos_ids: tuple[int, ...]) -> ModelConfig:
    """A dense hybrid of `groups` x (3 GDN + 1 gated attention), head dim 64, tied embeddings."""
    head_dim = 64
    heads = hidden // head_dim
    return ModelConfig(
        variant="dense", vocab_size=vocab_size, hidden_size=hidden,
        layer_types=("linear_attention", "linear_attention", "linear_attention",
                     "full_attention") * groups,
        num_q_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=head_dim,
        rotary_dim=head_dim // 4, rope_theta=10000.0, conv_kernel=4,
        linear_num_k_heads=max(1, heads // 2), linear_num_v_heads=heads, linear_k_dim=head_dim,
        linear_v_dim=head_dim, intermediate_size=hidden * 8 // 3 // 32 * 32,
        tie_word_embeddings=True, max_position_embeddings=2048, eos_token_ids=eos_ids,
        gdn_chunk_size=16,  # 2x faster training on CPU than 64; the same function
    )


# Data ----------------------------------------------------------------------------------------
def batches(data: np.ndarray, batch: int, seed: int):
    """Endless shuffled batches [batch, seq_len + 1]; epoch e uses permutation seed (seed, e)."""
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(data))
        for i in range(0, len(order) - batch + 1, batch):
            yield data[order[i:i + batch]]
        epoch += 1


# Losses --------------------------------------------------------------------------------------
def _nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def lm_loss(params: dict, cfg: ModelConfig, window: jax.Array) -> jax.Array:
    return jnp.mean(_nll(forward(params, cfg, window[:, :-1]), window[:, 1:]))


def main_hidden(params: dict, cfg: ModelConfig, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits, final-normed hidden) of a full forward from empty state."""
    b = token_ids.shape[0]
    out = step(params, cfg, token_ids, jnp.zeros((b,), jnp.int32),
               GDNState.zeros(cfg, b, params["embed"].dtype), CausalKV())
    return out.logits, out.hidden


def mtp_logits(params: dict, cfg: ModelConfig, window: jax.Array):
    """Draft logits for tok_{t+2} at t = 0..T-2 and the main model's logits for the same tokens."""
    tokens = window[:, :-1]
    logits, hidden = main_hidden(params, cfg, tokens)
    hidden = jax.lax.stop_gradient(hidden)
    draft, _ = mtp_step(params, cfg, hidden[:, :-1], tokens[:, 1:],
                        jnp.zeros((tokens.shape[0],), jnp.int32), CausalKV())
    return draft, logits[:, 1:]


def mtp_loss(mtp: dict, frozen: dict, cfg: ModelConfig, window: jax.Array) -> jax.Array:
    draft, _ = mtp_logits({**frozen, "mtp": mtp}, cfg, window)
    return jnp.mean(_nll(draft, window[:, 2:]))


# Optimisation --------------------------------------------------------------------------------
def optimizer(lr: float, steps: int) -> optax.GradientTransformation:
    warmup = max(1, steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr / 20)

    def decay_mask(p):  # weight decay on matrices only, not on norms and biases
        return jax.tree.map(lambda a: a.ndim >= 2, p)

    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))


def make_train_step(loss_fn, opt: optax.GradientTransformation):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(trained, opt_state, **inputs):
        loss, grads = jax.value_and_grad(loss_fn)(trained, **inputs)
        updates, opt_state = opt.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state, loss
    return train_step


def evaluate(params: dict, cfg: ModelConfig, data: np.ndarray, batch: int) -> float:
    """Mean per-token NLL over the windows of `data` (whole batches only)."""
    loss = jax.jit(lm_loss, static_argnums=1)
    n = len(data) // batch * batch
    return float(np.mean([loss(params, cfg, jnp.asarray(data[i:i + batch]))
                          for i in range(0, n, batch)]))


def mtp_accuracy(params: dict, cfg: ModelConfig, data: np.ndarray, batch: int) -> dict:
    """Top-1 accuracy of the head on tok_{t+2}, and its agreement with the main model's greedy
    choice for the same token (what greedy speculative decoding accepts)."""
    @jax.jit
    def counts(params, window):
        draft, main = mtp_logits(params, cfg, window)
        guess = jnp.argmax(draft, -1)
        return (jnp.sum(guess == window[:, 2:]), jnp.sum(guess == jnp.argmax(main, -1)),
                guess.size)

    hits = agree = total = 0
    for i in range(0, len(data) // batch * batch, batch):
        h, a, t = counts(params, jnp.asarray(data[i:i + batch]))
        hits, agree, total = hits + int(h), agree + int(a), total + int(t)
    return {"mtp_top1": hits / total, "mtp_agrees_with_greedy": agree / total, "tokens": total}


# Sampling ------------------------------------------------------------------------------------
def continue_text(params: dict, cfg: ModelConfig, prompt_ids: list[int], max_new: int,
                  eos_ids: frozenset[int], key: jax.Array | None,
                  temperature: float = 0.8, top_k: int = 40) -> list[int]:
    """Greedy (key None) or top-k sampled continuation: one prefill `step`, then one `step` per
    token over a ContiguousKV cache, stopping at an EOS id."""
    run = jax.jit(step, static_argnums=1)
    gdn = GDNState.zeros(cfg, 1)
    kv = ContiguousKV.zeros(cfg, 1, len(prompt_ids) + max_new)
    out = run(params, cfg, jnp.asarray([prompt_ids], jnp.int32), jnp.zeros((1,), jnp.int32),
              gdn, kv)
    pos, new = len(prompt_ids), []
    kv = out.kv.advance(jnp.asarray([pos], jnp.int32))
    while len(new) < max_new:
        logits = out.logits[0, -1]
        if key is None:
            token = int(jnp.argmax(logits))
        else:
            key, sub = jax.random.split(key)
            top, idx = jax.lax.top_k(logits / temperature, top_k)
            token = int(idx[jax.random.categorical(sub, top)])
        if token in eos_ids:
            break
        new.append(token)
        out = run(params, cfg, jnp.asarray([[token]], jnp.int32), jnp.asarray([pos], jnp.int32),
                  out.gdn, kv)
        kv = out.kv.advance(jnp.ones((1,), jnp.int32))
        pos += 1
    return new


def sample(argv: list[str]) -> None:
    """Prints each prompt's greedy continuation, then one sampled continuation per prompt."""
    del argv
    from ninfer_jax import load_model

    model = load_model(FLAGS.sample_from)
    tok = load_tokenizer(model.path)
    for mode in ("greedy", "sampled"):
        key = None if mode == "greedy" else jax.random.key(FLAGS.seed)
        for prompt in FLAGS.prompts:
            if key is not None:
                key, sub = jax.random.split(key)
            ids = continue_text(model.params, model.config, tok.encode(prompt),
                                FLAGS.max_new_tokens, tok.eos_ids, None if key is None else sub,
                                FLAGS.temperature)
            print(json.dumps({"mode": mode, "prompt": prompt, "text": tok.decode(ids)}))


def train(argv: list[str]) -> None:
    del argv
    log = train_tokenizer.Log(FLAGS.log)
    frontend = pathlib.Path(tempfile.mkdtemp(prefix="demo_frontend_"))
    stories = train_tokenizer.train_stories()
    train_tokenizer.train_tokenizer(stories, frontend)
    tok = load_tokenizer(frontend)
    cfg = demo_config(FLAGS.hidden, FLAGS.groups, tok.vocab_size, tuple(sorted(tok.eos_ids)))
    stream = np.concatenate([tok.encode(d) for d in train_tokenizer.documents(stories, FLAGS.chat_share,
                                                               FLAGS.seed)])
    train_data = train_tokenizer.windows(stream, FLAGS.seq_len)
    valid_data = train_tokenizer.windows(np.asarray(tok.encode(train_tokenizer.valid_text())), FLAGS.seq_len)
    key_model, key_mtp = jax.random.split(jax.random.key(FLAGS.seed))
    params = init_params(cfg, key_model)
    num_params = sum(a.size for a in jax.tree.leaves(params))
    log(event="start", config=cfg.to_dict(), num_params=num_params,
        train_tokens=int(stream.size), valid_tokens=int(valid_data.size), flags={
            k: FLAGS[k].value for k in ("seed", "hidden", "groups", "steps", "mtp_steps",
                                        "batch", "seq_len", "lr", "chat_share",
                                        "valid_windows")})

    opt = optimizer(FLAGS.lr, FLAGS.steps)
    opt_state = opt.init(params)
    train_step = make_train_step(functools.partial(lm_loss, cfg=cfg), opt)
    eval_subset = valid_data[:FLAGS.eval_windows]
    it = batches(train_data, FLAGS.batch, FLAGS.seed)
    recent = []
    for i in range(1, FLAGS.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, window=jnp.asarray(next(it)))
        recent.append(loss)
        if i % FLAGS.eval_every == 0 or i == FLAGS.steps or i == 20:
            train_loss = float(np.mean(jax.device_get(recent)))
            recent = []
            log(event="eval", step=i, train_loss=round(train_loss, 4),
                valid_loss=round(evaluate(params, cfg, eval_subset, FLAGS.batch), 4))
    valid_data = valid_data[:FLAGS.valid_windows]
    valid_loss = evaluate(params, cfg, valid_data, FLAGS.batch)
    log(event="final", valid_loss=round(valid_loss, 4), valid_ppl=round(math.exp(valid_loss), 3),
        valid_windows=len(valid_data))

    # MTP head on the frozen model; its layer starts as a copy of the last attention layer.
    mtp = init_params(cfg, key_mtp, num_mtp_layers=1)["mtp"]
    mtp["layers"] = jax.tree.map(lambda a: jnp.copy(a[-1:]), params["attention"])  # not donated
    mtp_opt = optimizer(FLAGS.lr, FLAGS.mtp_steps)
    mtp_state = mtp_opt.init(mtp)
    mtp_train_step = make_train_step(functools.partial(mtp_loss, cfg=cfg), mtp_opt)
    it = batches(train_data, FLAGS.batch, FLAGS.seed + 1)
    for i in range(1, FLAGS.mtp_steps + 1):
        mtp, mtp_state, loss = mtp_train_step(mtp, mtp_state, frozen=params,
                                              window=jnp.asarray(next(it)))
        if i % FLAGS.eval_every == 0 or i == FLAGS.mtp_steps:
            log(event="mtp", step=i, train_loss=round(float(loss), 4))
    params = {**params, "mtp": mtp}
    cfg = dataclasses.replace(cfg, mtp_num_layers=1)
    log(event="mtp_final", **mtp_accuracy(params, cfg, valid_data, FLAGS.batch))
    if FLAGS.out:
        out = write_artifact(FLAGS.out, cfg, jax.device_get(params), dtype="float32",
                             sources={}, frontend_dir=frontend, notes=[(
                                 f"demo model trained by scripts/train_demo.py --seed={FLAGS.seed}"
                                 f" --steps={FLAGS.steps}; valid ppl {math.exp(valid_loss):.2f}")],
                             overwrite=True)
        log(event="wrote", path=str(out))


def main(argv: list[str]) -> None:
    (sample if FLAGS.sample_from else train)(argv)


if __name__ == "__main__":
    app.run(main)
