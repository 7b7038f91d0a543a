"""Params -> Hugging Face checkpoint (`ninfer export-hf`): the exact inverse of `weights.py`.

Owns writing a text-only transformers checkpoint (`config.json` for `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM`, one `model.safetensors` with `model.*`, `lm_head.*` when untied and
`mtp.*` when the params have a head) plus the model's frontend files. Linear weights are already
in nn.Linear's [out, in]; reading the result with `params_from_hf` gives the same params bit for
bit. The directory is written through `staging.staged_dir`; `model.safetensors` records
in its metadata (`ninfer_export_files`) the files written, which is how a later `--overwrite`
recognises a checkpoint of ours.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from ninfer_jax.artifact import staging
from ninfer_jax.artifact.format import FRONTEND_FILES
from ninfer_jax.models.qwen3_6.config import FULL, ModelConfig
from ninfer_jax.models.qwen3_6.vision import hf_vision_tensors
from ninfer_jax.models.qwen3_6.weights import VISION_PREFIX, check_param_shapes


def _t(a) -> np.ndarray:
    """A linear weight as stored (the params keep nn.Linear's [out, in])."""
    return np.ascontiguousarray(np.asarray(a))


def _mlp(p: dict, pre: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    if cfg.variant == "dense":
        return {f"{pre}mlp.gate_proj.weight": _t(p["gate"]), f"{pre}mlp.up_proj.weight": _t(p["up"]),
                f"{pre}mlp.down_proj.weight": _t(p["down"])}
    ex = {k: np.asarray(v) for k, v in p["experts"].items()}
    return {
        f"{pre}mlp.gate.weight": _t(p["router"]),
        f"{pre}mlp.experts.gate_up_proj": np.concatenate([ex["gate"], ex["up"]], axis=1),
        f"{pre}mlp.experts.down_proj": _t(ex["down"]),
        f"{pre}mlp.shared_expert.gate_proj.weight": _t(p["shared"]["gate"]),
        f"{pre}mlp.shared_expert.up_proj.weight": _t(p["shared"]["up"]),
        f"{pre}mlp.shared_expert.down_proj.weight": _t(p["shared"]["down"]),
        f"{pre}mlp.shared_expert_gate.weight": _t(p["shared_gate"]),
    }


def _norms(p: dict, pre: str) -> dict[str, np.ndarray]:
    return {f"{pre}input_layernorm.weight": np.asarray(p["input_norm"]),
            f"{pre}post_attention_layernorm.weight": np.asarray(p["post_norm"])}


def _attention_layer(p: dict, pre: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    m, a = p["mixer"], f"{pre}self_attn."
    return {**_norms(p, pre), **_mlp(p["mlp"], pre, cfg),
            f"{a}q_proj.weight": _t(m["q"]), f"{a}k_proj.weight": _t(m["k"]),
            f"{a}v_proj.weight": _t(m["v"]), f"{a}o_proj.weight": _t(m["o"]),
            f"{a}q_norm.weight": np.asarray(m["q_norm"]),
            f"{a}k_norm.weight": np.asarray(m["k_norm"])}


def _linear_layer(p: dict, pre: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    m, a = p["mixer"], f"{pre}linear_attn."
    return {**_norms(p, pre), **_mlp(p["mlp"], pre, cfg),
            f"{a}in_proj_qkv.weight": _t(m["in_qkv"]), f"{a}in_proj_z.weight": _t(m["in_z"]),
            f"{a}in_proj_b.weight": _t(m["in_b"]), f"{a}in_proj_a.weight": _t(m["in_a"]),
            f"{a}conv1d.weight": np.ascontiguousarray(np.asarray(m["conv"]).T[:, None, :]),
            f"{a}dt_bias": np.asarray(m["dt_bias"]), f"{a}A_log": np.asarray(m["A_log"]),
            f"{a}norm.weight": np.asarray(m["norm"]), f"{a}out_proj.weight": _t(m["out"])}


def _layer(stack: dict, i: int) -> dict:
    return _map(stack, lambda a: np.asarray(a)[i])


def _map(tree, fn):
    return {k: _map(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def hf_tensors(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Every HF-named tensor of `params` (numpy, in the params' dtype)."""
    check_param_shapes(cfg, params)
    out = {"model.embed_tokens.weight": np.asarray(params["embed"]),
           "model.norm.weight": np.asarray(params["final_norm"])}
    counts = {FULL: 0, "linear_attention": 0}
    for i, kind in enumerate(cfg.layer_types):
        j, counts[kind] = counts[kind], counts[kind] + 1
        if kind == FULL:
            out.update(_attention_layer(_layer(params["attention"], j), f"model.layers.{i}.", cfg))
        else:
            out.update(_linear_layer(_layer(params["linear"], j), f"model.layers.{i}.", cfg))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = _t(params["lm_head"])
    if "mtp" in params:
        mtp = params["mtp"]
        out.update({"mtp.fc.weight": _t(mtp["fc"]),
                    "mtp.pre_fc_norm_embedding.weight": np.asarray(mtp["embed_norm"]),
                    "mtp.pre_fc_norm_hidden.weight": np.asarray(mtp["hidden_norm"]),
                    "mtp.norm.weight": np.asarray(mtp["final_norm"])})
        for j in range(len(mtp["layers"]["input_norm"])):
            out.update(_attention_layer(_layer(mtp["layers"], j), f"mtp.layers.{j}.", cfg))
    if cfg.vision is not None:  # a vision-language checkpoint: the text under language_model
        out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in out.items()}
        out.update({VISION_PREFIX + k: v
                    for k, v in hf_vision_tensors(params["vision"], cfg.vision).items()})
    return out


def _vl_config(cfg: ModelConfig, text: dict) -> dict:
    """The `config.json` of the vision-language model (text config nested)."""
    v = cfg.vision
    text = {**text, "model_type": "qwen3_5_text" if cfg.variant == "dense"
            else "qwen3_5_moe_text"}
    text.pop("architectures")
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration" if cfg.variant == "dense"
                          else "Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5" if cfg.variant == "dense" else "qwen3_5_moe",
        "text_config": text,
        "vision_config": {
            "model_type": "qwen3_5_vision" if cfg.variant == "dense" else "qwen3_5_moe_vision",
            "depth": v.depth, "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size, "num_heads": v.num_heads,
            "out_hidden_size": v.out_hidden_size, "in_channels": v.in_channels,
            "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "num_position_embeddings": v.num_position_embeddings, "hidden_act": v.hidden_act,
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}},
        "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "dtype": text["dtype"],
    }


def hf_config(cfg: ModelConfig, num_mtp_layers: int, dtype: str) -> dict:
    """The `config.json` of the transformers model for `cfg` (text-only, or with the vision
    tower when `cfg.vision`)."""
    text = {
        "architectures": ["Qwen3_5ForCausalLM" if cfg.variant == "dense"
                          else "Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_text" if cfg.variant == "dense" else "qwen3_5_moe_text",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "layer_types": list(cfg.layer_types),
        "num_attention_heads": cfg.num_q_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "linear_conv_kernel_dim": cfg.conv_kernel,
        "linear_num_key_heads": cfg.linear_num_k_heads,
        "linear_num_value_heads": cfg.linear_num_v_heads,
        "linear_key_head_dim": cfg.linear_k_dim, "linear_value_head_dim": cfg.linear_v_dim,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim,
                            "mrope_interleaved": True,
                            "mrope_section": list(cfg.mrope_section)},
        "mtp_num_hidden_layers": num_mtp_layers,
        "eos_token_id": list(cfg.eos_token_ids) or None,
        "dtype": dtype,
    }
    if cfg.variant == "dense":
        text["intermediate_size"] = cfg.intermediate_size
    else:
        text.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                    moe_intermediate_size=cfg.moe_intermediate_size,
                    shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    return text if cfg.vision is None else _vl_config(cfg, text)


FILES_KEY = "ninfer_export_files"
HOLDS = "a checkpoint written by `ninfer export-hf`"


def foreign(path: pathlib.Path) -> str | None:
    """Why `path` is not exactly a checkpoint written by `export_hf`, or None."""
    try:
        with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
            files = json.loads((f.metadata() or {})[FILES_KEY])
    except (OSError, KeyError, ValueError, SafetensorError):  # absent, unreadable, not ours
        return f"{staging.holdings(path)}, and no model.safetensors written by export-hf"
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return f"its model.safetensors has a malformed {FILES_KEY!r}"
    return staging.file_set_problem(path, set(files))


def check_out(out: str | pathlib.Path, overwrite: bool = False) -> pathlib.Path:
    """Raises a CheckpointError when `export_hf` may not write to `out` (see `staging`)."""
    return staging.check_target(out, overwrite=overwrite, foreign=foreign, holds=HOLDS)


def export_hf(cfg: ModelConfig, params: dict, out: str | pathlib.Path,
              frontend_dir: pathlib.Path | None = None,
              overwrite: bool = False) -> pathlib.Path:
    """Writes the HF checkpoint of (cfg, params) to `out`: a new or empty directory, or (with
    `overwrite`) one holding exactly a checkpoint written here before. Returns `out`."""
    check_out(out, overwrite)
    tensors = hf_tensors(cfg, params)
    dtype = str(next(iter(tensors.values())).dtype)
    num_mtp = len(params["mtp"]["layers"]["input_norm"]) if "mtp" in params else 0
    config = hf_config(cfg, num_mtp, "bfloat16" if dtype == "bfloat16" else "float32")
    frontend = [name for name in FRONTEND_FILES
                if frontend_dir is not None and (frontend_dir / name).is_file()]
    files = ["config.json", "model.safetensors", *frontend]
    with staging.staged_dir(out, overwrite=overwrite, foreign=foreign, holds=HOLDS) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"),
                  metadata={"format": "pt", FILES_KEY: json.dumps(files)})
        for name in frontend:
            shutil.copy2(frontend_dir / name, tmp / name)
    return pathlib.Path(out).absolute()
