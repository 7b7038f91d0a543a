"""`load_model`: the notebook entry point for a model package (artifact or HF checkpoint).

Owns resolving a path to (config, params) in the requested dtype and a jitted full-sequence
`logits`. It keeps no engine state: the Program builds its own step functions from the same
config and params. By default the weights are verified while loading (an artifact's tensor
digests, every tensor's finiteness); `verify=False` is the fast path that skips both.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.artifact.hf import SafetensorsSource, checkpoint_dir, is_hf_checkpoint, read_config
from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.models.qwen3_6 import ModelConfig, forward
from ninfer_jax.models.qwen3_6.weights import params_from_hf

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The embedded default: the demo model shipped as package data (scripts/train_demo.py).
DEFAULT_MODEL = pathlib.Path(__file__).resolve().parent / "assets" / "demo"
# Its DFlash2 drafter, in the public checkpoint layout (scripts/train_dflash.py).
DEFAULT_DRAFTER = pathlib.Path(__file__).resolve().parent / "assets" / "demo_dflash"
DRAFTER_DIR = "drafter"  # where a model directory carries its drafter


def _dtype(dtype: str):
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_hf(path: str | pathlib.Path, dtype: str = "float32", verify: bool = True):
    """(config, params as numpy, notes) from an HF checkpoint directory; `verify` refuses a
    tensor holding NaN or inf."""
    cfg = ModelConfig.from_hf_dict(read_config(path))
    params, notes = params_from_hf(cfg, SafetensorsSource(path, check_finite=verify),
                                   cast=lambda a: a.astype(_dtype(dtype)))
    return cfg, params, notes


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg, token_ids):
    return forward(params, cfg, token_ids)


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model package in memory: `.config`, `.params` (device arrays), `.logits(token_ids)`."""

    config: ModelConfig
    params: dict
    path: pathlib.Path
    notes: tuple[str, ...] = ()

    def logits(self, token_ids) -> np.ndarray:
        """token_ids: int array [B, T] (no padding) -> float32 numpy logits [B, T, vocab]."""
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[1] == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"token_ids must be a non-empty int array [B, T], got "
                             f"shape {ids.shape} dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token_ids must be in [0, vocab_size={self.config.vocab_size}), "
                             f"got range [{ids.min()}, {ids.max()}]")
        return np.asarray(_logits(self.params, self.config, jnp.asarray(ids, jnp.int32)))


def load_model(path: str | pathlib.Path | None = None, dtype: str = "float32",
               verify: bool = True) -> LoadedModel:
    """Loads an artifact directory or an HF checkpoint directory in `dtype` (float32|bfloat16);
    with no path, the embedded demo model (`DEFAULT_MODEL`).

    verify: check every tensor's digest (artifacts) and that it holds no NaN/inf (artifacts and
    HF checkpoints); a failure is a CheckpointError naming the tensor. `verify=False` skips the
    hashing and scanning (shapes and dtypes are always checked) and is needed for artifacts of
    format_version 1, which record no digests.
    """
    root = checkpoint_dir(DEFAULT_MODEL if path is None else path)
    jdtype = _dtype(dtype)
    if artifact_format.is_artifact(root):
        cfg, np_params, manifest = artifact_format.read_artifact(root, verify=verify)
        params = jax.tree.map(lambda a: jnp.asarray(a, jdtype), np_params)
        notes = tuple(manifest.get("notes", ()))
    elif is_hf_checkpoint(root):
        cfg, np_params, notes = read_hf(root, dtype, verify=verify)
        params = jax.tree.map(jnp.asarray, np_params)
    else:
        raise CheckpointError(
            f"{str(root)!r} is neither an artifact (no manifest.json) nor an HF checkpoint "
            "(config.json + *.safetensors)"
        )
    return LoadedModel(config=cfg, params=params, path=root, notes=tuple(notes))


@dataclasses.dataclass(frozen=True)
class LoadedDrafter:
    """A DFlash drafter in memory: `.config` (DFlashConfig), `.params` (device arrays)."""

    config: object
    params: dict
    path: pathlib.Path


def drafter_path(model_path: pathlib.Path, drafter: str | pathlib.Path | None) -> pathlib.Path:
    """Where a model's drafter is: `drafter` when given, else `<model>/drafter/`, else (for the
    embedded default model) the shipped demo drafter; a ConfigError says how to give one."""
    if drafter is not None:
        return pathlib.Path(drafter)
    if (model_path / DRAFTER_DIR / "config.json").is_file():
        return model_path / DRAFTER_DIR
    if model_path.resolve() == DEFAULT_MODEL:
        return DEFAULT_DRAFTER
    raise ConfigError(f"speculative='dflash' needs a DFlash drafter: {str(model_path)!r} has no "
                      f"{DRAFTER_DIR}/ directory; pass drafter=PATH (--drafter), a DFlash "
                      "checkpoint directory (config.json with dflash_config + *.safetensors)")


def load_drafter(path: str | pathlib.Path, dtype: str = "float32",
                 verify: bool = True) -> LoadedDrafter:
    """A DFlash / DFlash2 drafter from a checkpoint directory in the public layout, in `dtype`;
    `verify` refuses a tensor holding NaN or inf."""
    from ninfer_jax.models.dflash import DFlashConfig
    from ninfer_jax.models.dflash.weights import params_from_hf as drafter_params

    root = checkpoint_dir(path)
    if not is_hf_checkpoint(root):
        raise CheckpointError(f"drafter {str(root)!r} is not a checkpoint directory "
                              "(config.json + *.safetensors)")
    cfg = DFlashConfig.from_hf_dict(read_config(root))
    params = drafter_params(cfg, SafetensorsSource(root, check_finite=verify))
    jdtype = _dtype(dtype)
    return LoadedDrafter(config=cfg, params=jax.tree.map(lambda a: jnp.asarray(a, jdtype),
                                                         params), path=root)
