"""Builds the transformers reference fixtures in tests/fixtures/ (dev tier: needs torch).

    pip install -e '.[dev]' && python scripts/make_reference.py
    python scripts/make_reference.py --long_only   # only reference_long.npz, from the
                                                   # checkpoints already in tests/fixtures/

For each tiny random model it writes an HF checkpoint directory as transformers saves it, plus
`reference.npz` with the token ids, fp32 logits and greedy continuations. The weights that
commonly hide bugs (norms, q/k norms, the gated norm, dt_bias, A_log) are perturbed so they
matter. `dense` and `moe` also get `reference_long.npz`: one sequence of LONG_LEN tokens, longer
than two GDN chunks (our `gdn_chunk_size` of 64, and transformers' own chunk of 64), so the GDN
state carried from chunk to chunk is compared too. To stay small (tens of KB) it keeps the logits
only at LONG_POSITIONS (around the chunk boundaries and at the end), plus the greedy
continuation of the whole sequence and each greedy token's log-probability. Fixtures:

- `dense`: text-only `qwen3_5_text`, tied embeddings, q != kv heads, GDN k-heads != v-heads,
  k_dim != v_dim, partial rotary 0.5, conv kernel 3, layer pattern L L F L F.
- `moe`: text-only `qwen3_5_moe_text`, untied, 8 experts top-2, shared expert, 3:1 pattern.
- `dense_vl`: the `dense` weights inside a `qwen3_5` multimodal checkpoint (nested
  `text_config`, `model.language_model.*` prefixes, a tiny vision tower, `mtp.*` weights added
  as real checkpoints carry them), saved sharded with `model.safetensors.index.json`, and
  `mtp_reference.npz`, the MTP head's draft logits from transformers' generic `MtpModel`
  (`scripts/make_mtp_reference.py`).

The tests compare against these files and never import torch.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scripts.make_mtp_reference import save_mtp_reference

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
BATCH, SEQ_LEN, NEW_TOKENS = 3, 40, 12
LONG_LEN, LONG_NEW_TOKENS = 160, 8
# The first and last positions of GDN chunks [0, 64), [64, 128), [128, 160) and their
# neighbours, and the last position of every prefill chunk of 24 tokens.
LONG_POSITIONS = (0, 1, 23, 47, 63, 64, 65, 71, 95, 119, 127, 128, 129, 143, 158, 159)

DENSE = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_conv_kernel_dim": 3,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "initializer_range": 0.1,
}

MOE = {
    "vocab_size": 320,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
    "initializer_range": 0.1,
}

VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 16,
}


def perturb(model: torch.nn.Module, seed: int) -> None:
    """Randomises the weights that default to constants so a wrong formula shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[0]
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 4 + 0.05))
            elif leaf.endswith("linear_attn.norm"):
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def reference(model, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, vocab_size, size=(BATCH, SEQ_LEN), dtype=np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(token_ids)).logits.float().numpy()
        prompt = torch.from_numpy(token_ids[:, : SEQ_LEN // 2])
        out = model.generate(
            prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
            eos_token_id=None,
        )
    return {
        "token_ids": token_ids.astype(np.int32),
        "logits": logits.astype(np.float32),
        "greedy_prompt_len": np.array(SEQ_LEN // 2, np.int32),
        "greedy_tokens": out[:, SEQ_LEN // 2 :].numpy().astype(np.int32),
    }


def long_reference(model, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    """One LONG_LEN-token sequence: fp32 logits at LONG_POSITIONS, its greedy continuation with
    each greedy token's log-probability, and the smallest top-1/top-2 logit gap of those steps
    (to show they are decided)."""
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(0, vocab_size, size=(1, LONG_LEN), dtype=np.int64)
    ids = torch.from_numpy(token_ids)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().numpy()
        out = model.generate(ids, max_new_tokens=LONG_NEW_TOKENS, do_sample=False,
                             attention_mask=torch.ones_like(ids), pad_token_id=0,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    steps = np.stack([s.float().numpy()[0] for s in out.logits])  # [new, V]
    top2 = np.sort(steps, axis=-1)[:, -2:]
    return {
        "token_ids": token_ids.astype(np.int32),
        "positions": np.array(LONG_POSITIONS, np.int32),
        "logits": logits[:, list(LONG_POSITIONS)].astype(np.float32),
        "greedy_tokens": out.sequences[:, LONG_LEN:].numpy().astype(np.int32),
        "greedy_logprobs": torch.log_softmax(torch.from_numpy(steps), -1).max(-1).values.numpy(),
        "greedy_min_margin": np.array((top2[:, 1] - top2[:, 0]).min(), np.float32),
    }


def save_long(model, name: str, vocab_size: int, seed: int) -> None:
    ref = long_reference(model, vocab_size, seed)
    np.savez_compressed(OUT / name / "reference_long.npz", **ref)
    print(name, "reference_long.npz", f"{(OUT / name / 'reference_long.npz').stat().st_size} bytes",
          f"greedy min margin {float(ref['greedy_min_margin']):.4f}")


def save(model, name: str, ref: dict[str, np.ndarray], **save_kwargs) -> pathlib.Path:
    path = OUT / name
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path, **save_kwargs)
    np.savez_compressed(path / "reference.npz", **ref)
    for extra in ("generation_config.json",):
        (path / extra).unlink(missing_ok=True)
    return path


def add_mtp_weights(path: pathlib.Path, cfg: dict, seed: int) -> None:
    """Adds `mtp.*` tensors named as in the published Qwen3.5 checkpoints (one decoder layer)."""
    rng = np.random.default_rng(seed)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    nq, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    mtp = {
        "mtp.fc.weight": w(h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": w(h),
        "mtp.pre_fc_norm_hidden.weight": w(h),
        "mtp.norm.weight": w(h),
        "mtp.layers.0.input_layernorm.weight": w(h),
        "mtp.layers.0.post_attention_layernorm.weight": w(h),
        "mtp.layers.0.self_attn.q_proj.weight": w(nq * hd * 2, h),
        "mtp.layers.0.self_attn.k_proj.weight": w(nkv * hd, h),
        "mtp.layers.0.self_attn.v_proj.weight": w(nkv * hd, h),
        "mtp.layers.0.self_attn.o_proj.weight": w(h, nq * hd),
        "mtp.layers.0.self_attn.q_norm.weight": w(hd),
        "mtp.layers.0.self_attn.k_norm.weight": w(hd),
        "mtp.layers.0.mlp.gate_proj.weight": w(inter, h),
        "mtp.layers.0.mlp.up_proj.weight": w(inter, h),
        "mtp.layers.0.mlp.down_proj.weight": w(h, inter),
    }
    shard = "model-mtp.safetensors"
    save_file(mtp, str(path / shard), metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: shard for k in mtp})
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    if "--long_only" in sys.argv[1:]:
        for name, cls, vocab_size, seed in (("dense", Qwen3_5ForCausalLM, DENSE["vocab_size"], 6),
                                            ("moe", Qwen3_5MoeForCausalLM, MOE["vocab_size"], 7)):
            save_long(cls.from_pretrained(OUT / name, dtype=torch.float32).eval(), name,
                      vocab_size, seed)
        return

    dense_cfg = Qwen3_5TextConfig(**DENSE)
    dense = Qwen3_5ForCausalLM(dense_cfg).eval()
    perturb(dense, seed=1)
    dense_ref = reference(dense, DENSE["vocab_size"], seed=2)
    save(dense, "dense", dense_ref)
    save_long(dense, "dense", DENSE["vocab_size"], seed=6)

    moe_cfg = Qwen3_5MoeTextConfig(**MOE)
    moe = Qwen3_5MoeForCausalLM(moe_cfg).eval()
    perturb(moe, seed=3)
    # A random router is nearly uniform; scale it so top-k choices are decisive.
    with torch.no_grad():
        for layer in moe.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    save(moe, "moe", reference(moe, MOE["vocab_size"], seed=4))
    save_long(moe, "moe", MOE["vocab_size"], seed=7)

    vl_cfg = Qwen3_5Config(text_config=DENSE, vision_config=VISION, tie_word_embeddings=True)
    vl = Qwen3_5ForConditionalGeneration(vl_cfg).eval()
    text_state = {f"model.language_model.{k[len('model.'):]}": v for k, v in dense.state_dict().items()
                  if k.startswith("model.")}
    missing, unexpected = vl.load_state_dict(text_state, strict=False)
    assert not unexpected, unexpected
    assert all(k.startswith("model.visual.") or k == "lm_head.weight" for k in missing), missing
    vl.tie_weights()
    vl_ref = reference(vl, DENSE["vocab_size"], seed=2)
    np.testing.assert_allclose(vl_ref["logits"], dense_ref["logits"], rtol=0, atol=1e-5)
    path = save(vl, "dense_vl", vl_ref, max_shard_size="100KB")
    add_mtp_weights(path, DENSE, seed=5)
    save_mtp_reference(path)

    for name in ("dense", "moe", "dense_vl"):
        files = sorted(p.name for p in (OUT / name).iterdir())
        keys = set()
        for f in (OUT / name).glob("*.safetensors"):
            keys |= set(load_file(str(f)))
        print(name, files, f"{len(keys)} tensors")


if __name__ == "__main__":
    main()
