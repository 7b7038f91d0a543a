"""A synthetic sharded HF checkpoint of real-model-like tensor sizes, written cheaply, and a
peak-RSS probe run in a fresh process (`python -m tests.artifact.synthetic probe ...`).

The checkpoint is a dense Qwen3.6 text model in the `model.*` layout, bf16, split into shards of
about `shard_bytes` with a `model.safetensors.index.json`, as published checkpoints are. Values
come from one random block tiled (finite, distinct per tensor offset), so writing GBs costs
little more than the disk.
"""

from __future__ import annotations

import json
import pathlib
import resource
import sys
import time

import ml_dtypes
import numpy as np

from ninfer_jax.models.qwen3_6.config import ModelConfig


def dense_config(hidden: int, intermediate: int, num_layers: int, vocab: int) -> dict:
    """The config.json of a dense text model: every 4th layer full attention, 16 q / 2 kv heads
    x 128 and linear 16 k / 32 v heads x 128 (the published models' head sizes)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "layer_types": ["full_attention" if (n + 1) % 4 == 0 else "linear_attention"
                        for n in range(num_layers)],
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                            "mrope_section": [6, 5, 5]},
        "dtype": "bfloat16",
    }


def _hf_tensors(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor of the text model, in checkpoint order."""
    h, i, v, d = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv, hv, dv = cfg.num_q_heads, cfg.num_kv_heads, cfg.linear_num_v_heads, cfg.linear_v_dim
    out = [("model.embed_tokens.weight", (v, h))]
    for n, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{n}."
        out += [(f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]
        if kind == "full_attention":
            a = f"{p}self_attn."
            out += [(f"{a}q_proj.weight", (hq * d * 2, h)), (f"{a}k_proj.weight", (hkv * d, h)),
                    (f"{a}v_proj.weight", (hkv * d, h)), (f"{a}o_proj.weight", (h, hq * d)),
                    (f"{a}q_norm.weight", (d,)), (f"{a}k_norm.weight", (d,))]
        else:
            a = f"{p}linear_attn."
            out += [(f"{a}in_proj_qkv.weight", (cfg.conv_dim, h)),
                    (f"{a}in_proj_z.weight", (hv * dv, h)), (f"{a}in_proj_b.weight", (hv, h)),
                    (f"{a}in_proj_a.weight", (hv, h)),
                    (f"{a}conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel)),
                    (f"{a}dt_bias", (hv,)), (f"{a}A_log", (hv,)), (f"{a}norm.weight", (dv,)),
                    (f"{a}out_proj.weight", (h, hv * dv))]
        out += [(f"{p}mlp.gate_proj.weight", (i, h)), (f"{p}mlp.up_proj.weight", (i, h)),
                (f"{p}mlp.down_proj.weight", (h, i))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def _write_safetensors(path: pathlib.Path, tensors: list[tuple[str, tuple[int, ...]]],
                       block: np.ndarray) -> None:
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for k, (_, shape) in enumerate(tensors):
            n = int(np.prod(shape))
            rolled = np.roll(block, (k * 7919) % block.size)  # tensors differ from each other
            f.writelines(memoryview(rolled[: min(block.size, n - start)].view(np.uint16)) for start in range(0, n, block.size))


def write_checkpoint(root: pathlib.Path, config: dict, shard_bytes: int) -> list[int]:
    """Writes config.json (`config`), the shards of about `shard_bytes` and the index; returns
    the shard file sizes."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    cfg = ModelConfig.from_hf_dict(config)
    block = (np.random.default_rng(0).standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)
    shards, current, size = [], [], 0
    for name, shape in _hf_tensors(cfg):
        nbytes = 2 * int(np.prod(shape))
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(root / file, tensors, block)
        weight_map.update({name: file for name, _ in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return [(root / f).stat().st_size for f in sorted(set(weight_map.values()))]


def _rss_bytes() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes, from /proc/self/status."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _reset_peak() -> None:
    """Resets VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def probe(what: str, src: str, out: str) -> dict:
    """Runs one operation after the imports and reports RSS before and the peak during it."""
    import jax

    from ninfer_jax import loader
    from ninfer_jax.artifact.convert import convert

    jax.numpy.zeros(1).block_until_ready()  # the backend is up before the baseline
    held = [0]

    def discard(path, host):
        held[0] += host.nbytes
        return jax.numpy.zeros((), host.dtype)

    _reset_peak()
    baseline, _ = _rss_bytes()
    t0 = time.perf_counter()
    if what == "convert":
        convert(src, out, dtype="bfloat16")
    elif what == "load_params":  # a placement that keeps no device copy
        loader.load_params(src, "bfloat16", placement=discard)
    elif what == "load_model":  # device buffers live in host memory on CPU: counted below
        held[0] = sum(a.nbytes for a in jax.tree.leaves(loader.load_model(src, "bfloat16").params))
    else:
        raise ValueError(what)
    seconds = time.perf_counter() - t0
    _, peak = _rss_bytes()
    return {"what": what, "baseline": baseline, "peak": peak, "held": held[0],
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "seconds": seconds}


if __name__ == "__main__":
    if sys.argv[1] == "write":
        c = dense_config(*(int(x) for x in sys.argv[3:7]))
        print(write_checkpoint(pathlib.Path(sys.argv[2]), c, int(sys.argv[7])))
    else:
        print(json.dumps(probe(*sys.argv[2:5])))
