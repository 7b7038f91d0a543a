"""Random-weight benchmark models written once as an HF checkpoint that every engine loads.

The suites that compare engines give all of them the same directory: ours loads it with
`ninfer_jax.loader.load_model`, transformers with `Qwen3_5ForCausalLM.from_pretrained`. The
weights are `init_params` (seeded) in fp32, written by the shipped exporter
(`ninfer_jax.artifact.export.export_hf`).
"""

from __future__ import annotations

import gc
import pathlib

CONFIG_NAMES = ("tiny", "medium")


def model_config(name: str):
    """The ModelConfig of a benchmark model: `tiny` (the test config) or `medium` (~470M)."""
    from configs.models import MEDIUM
    from ninfer_jax.testing import tiny_dense

    return {"tiny": tiny_dense, "medium": lambda: MEDIUM}[name]()


def write_random_checkpoint(name: str, out: pathlib.Path, seed: int = 0) -> dict:
    """Writes config `name` with seeded random fp32 weights to `out` (a new directory).
    Returns {"num_params", "weight_bytes", "decode_weight_bytes", "vocab_size"}: a decode step
    reads every weight but the MTP head's and only one row of an untied embedding table."""
    import jax
    import numpy as np

    from ninfer_jax.artifact.export import export_hf
    from ninfer_jax.models.qwen3_6.weights import init_params

    cfg = model_config(name)
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(seed)))
    leaves = jax.tree.leaves(params)
    total = sum(a.nbytes for a in leaves)
    decode = total - sum(a.nbytes for a in jax.tree.leaves(params.get("mtp", {})))
    if not cfg.tie_word_embeddings:
        decode -= params["embed"].nbytes
    export_hf(cfg, params, out)
    info = {"num_params": sum(a.size for a in leaves), "weight_bytes": total,
            "decode_weight_bytes": decode, "vocab_size": cfg.vocab_size}
    del params, leaves
    gc.collect()
    return info


def write_demo_checkpoint(out: pathlib.Path) -> dict:
    """Writes the embedded demo model (its trained weights, fp32) to `out` as an HF checkpoint;
    returns what `write_random_checkpoint` returns."""
    import jax
    import numpy as np

    from ninfer_jax.artifact.export import export_hf
    from ninfer_jax.loader import load_model

    model = load_model(None, dtype="float32")
    params = jax.tree.map(np.asarray, model.params)
    leaves = jax.tree.leaves(params)
    export_hf(model.config, params, out)
    info = {"num_params": sum(a.size for a in leaves),
            "weight_bytes": sum(a.nbytes for a in leaves), "vocab_size": model.config.vocab_size}
    del model, params, leaves
    gc.collect()
    return info
