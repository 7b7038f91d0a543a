"""HF checkpoint -> artifact conversion (`ninfer convert`)."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np

from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.artifact import staging
from ninfer_jax.artifact.hf import SafetensorsSource, checkpoint_dir, read_config
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import params_from_hf

SOURCE_DTYPES = {"float32", "bfloat16"}


def convert(hf_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "float32",
            overwrite: bool = False) -> tuple[pathlib.Path, list[str]]:
    """Writes the artifact of the HF checkpoint at `hf_dir` to `out`; returns (out, notes).

    `out` is refused before anything is read unless it is new, empty, or (with `overwrite`)
    exactly an artifact written before; see `staging`.
    """
    if dtype not in SOURCE_DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(SOURCE_DTYPES)}, got {dtype!r}")
    staging.check_target(out, overwrite=overwrite, foreign=artifact_format.foreign,
                         holds=artifact_format.HOLDS)
    root = checkpoint_dir(hf_dir)
    cfg = ModelConfig.from_hf_dict(read_config(root))
    source = SafetensorsSource(root)
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    params, notes = params_from_hf(cfg, source, cast=lambda a: a.astype(target))
    sources = {f.name: artifact_format.sha256_file(f) for f in [root / "config.json", *source.files]}
    path = artifact_format.write_artifact(out, cfg, params, dtype=dtype, sources=sources,
                                          frontend_dir=root, notes=notes, overwrite=overwrite)
    return path, notes
