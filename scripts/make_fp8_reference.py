"""Builds the FP8 reference fixtures in tests/fixtures/fp8_{dense,moe}/ (dev tier: needs torch,
transformers and accelerate).

    pip install -e '.[dev]' && python scripts/make_fp8_reference.py

Each is a tiny random Qwen3.6 text model written in the official fine-grained FP8 layout, the
one Qwen's `-FP8` checkpoints use: every projection of the decoder layers (attention q/k/v/o,
GDN in_proj_qkv/in_proj_z/out_proj, the MLP's, the shared expert's and every expert's
gate/up/down, experts split per expert) stored as `float8_e4m3fn` with a `weight_scale_inv`
beside it, one bf16 scale per 128x128 block (scale = block amax / 448; the stored value is
weight / scale, rounded to e4m3), and `quantization_config` {quant_method fp8, fmt e4m3,
activation_scheme dynamic, weight_block_size [128, 128], modules_to_not_convert} in
config.json; embeddings, lm_head, norms, the router, the shared-expert gate, in_proj_a/b and
conv1d stay bf16-representable floats. Dims are multiples of 128 (or below it), as the real
models' are, which is also what transformers' dequantizing loader requires.

`reference.npz`: token ids and the fp32 logits transformers computes from this checkpoint
(on CPU it dequantizes the FP8 weights while loading: `dequantize=True`).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    FineGrainedFP8Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer_jax.quant import fp8_blocks
from scripts.make_reference import perturb

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures"
BATCH, SEQ_LEN = 2, 24
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1], "mrope_interleaved": True}
COMMON = {
    "vocab_size": 256, "hidden_size": 128, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "rope_parameters": ROPE, "initializer_range": 0.1,
}
DENSE = {**COMMON, "intermediate_size": 256, "tie_word_embeddings": True}
MOE = {**COMMON, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
       "shared_expert_intermediate_size": 128, "tie_word_embeddings": False}
# What the official checkpoints keep unquantized (module-name fragments).
NOT_CONVERTED = ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "in_proj_a",
                 "in_proj_b", "conv1d"]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
             "gate_proj", "up_proj", "down_proj")


def _quantized(name: str) -> bool:
    module = name[: -len(".weight")] if name.endswith(".weight") else ""
    return module.rsplit(".", 1)[-1] in QUANTIZED


def to_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn values, bf16 scales per 128x128 block) of w [out, in], as Qwen ships
    them: the block scale amax / 448 rounded to bf16, the values w / that scale."""
    scale = fp8_blocks(w).scale.astype(ml_dtypes.bfloat16)
    s = scale.astype(np.float32)
    full = np.repeat(np.repeat(np.where(s > 0, s, 1.0), 128, 0)[: w.shape[0]], 128, 1)
    return (w / full[:, : w.shape[1]]).astype(ml_dtypes.float8_e4m3fn), scale


def write_fp8(model, path: pathlib.Path) -> None:
    """Saves `model` (fp32) and rewrites its tensors in the official FP8 layout."""
    model.save_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f))
        f.unlink()
    out = {}
    for name, w in tensors.items():
        if w.ndim == 3 and ".mlp.experts." in name:  # fused experts -> the per-expert layout
            stem = name.rsplit(".", 1)[0]
            kind = name.rsplit(".", 1)[1]
            for j in range(w.shape[0]):
                if kind == "gate_up_proj":
                    half = w.shape[1] // 2
                    parts = {"gate_proj": w[j, :half], "up_proj": w[j, half:]}
                else:
                    parts = {kind: w[j]}
                for proj, pw in parts.items():
                    out[f"{stem}.{j}.{proj}.weight"], out[f"{stem}.{j}.{proj}.weight_scale_inv"] \
                        = to_fp8(pw)
            continue
        if _quantized(name):
            out[name], out[f"{name}_scale_inv"] = to_fp8(w)
        else:
            out[name] = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def reference(path: pathlib.Path, vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128), dequantize=True))
    model.eval()
    token_ids = np.random.default_rng(seed).integers(0, vocab_size, (BATCH, SEQ_LEN))
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(token_ids)).logits.float().numpy()
    return {"token_ids": token_ids.astype(np.int32), "logits": logits.astype(np.float32)}


def main() -> None:
    torch.manual_seed(0)
    for name, cls, config_cls, cfg, seed in (
            ("fp8_dense", Qwen3_5ForCausalLM, Qwen3_5TextConfig, DENSE, 11),
            ("fp8_moe", Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, MOE, 12)):
        model = cls(config_cls(**cfg)).float().eval()
        perturb(model, seed)
        path = OUT / name
        shutil.rmtree(path, ignore_errors=True)
        write_fp8(model, path)
        ref = reference(path, cfg["vocab_size"], seed)
        np.savez_compressed(path / "reference.npz", **ref)
        print(f"{path}: {sum(f.stat().st_size for f in path.iterdir()) / 1e3:.0f} kB, logits "
              f"max |.| {np.abs(ref['logits']).max():.3f}")


if __name__ == "__main__":
    main()
