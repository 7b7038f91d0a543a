"""`load_model`: the notebook entry point for a model package (artifact or HF checkpoint).

Owns resolving a path to (config, params) in the requested dtype and a jitted full-sequence
`logits`. It keeps no engine state: the Program builds its own step functions from the same
config and params. By default the weights are verified while loading (an artifact's tensor
digests, every tensor's finiteness); `verify=False` is the fast path that skips both.

Loading streams (`load_params`): one params leaf at a time is read (a format-4 artifact's file,
or an HF checkpoint's tensors, a stacked leaf layer by layer into one array), cast to the dtype
on the host, handed to a `placement` (default `jax.device_put`) and dropped before the next, so
host memory holds about one leaf beyond what the placements keep. Artifacts of formats 1-3
(orbax) are restored whole first.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax import quant
from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.artifact.hf import SafetensorsSource, checkpoint_dir, is_hf_checkpoint, read_config
from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.models.qwen3_6 import ModelConfig, forward
from ninfer_jax.models.qwen3_6.weights import hf_plan, params_from_hf

# (key path in the params pytree, e.g. ("attention", "mixer", "q"), host array) -> device array
Placement = Callable[[tuple[str, ...], np.ndarray], jax.Array]

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
    config = read_config(path)
    cfg = ModelConfig.from_hf_dict(config)
    params, notes = params_from_hf(cfg, SafetensorsSource(path, check_finite=verify),
                                   cast=lambda a: a.astype(_dtype(dtype)),
                                   fp8_block=quant.hf_fp8_block(config))
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


def _device_put(_path: tuple[str, ...], host: np.ndarray) -> jax.Array:
    """The default placement: waits for the transfer, so that the host copy is free before the
    next leaf is read (an asynchronous one would still hold it)."""
    return jax.device_put(host).block_until_ready()


def host_placement(_path: tuple[str, ...], host: np.ndarray) -> np.ndarray:
    """A placement that keeps every leaf on the host (the caller sends it to devices)."""
    return host


def load_model(path: str | pathlib.Path | None = None, dtype: str = "float32",
               verify: bool = True, placement: Placement | None = None,
               quantize: str | None = None) -> LoadedModel:
    """Loads an artifact directory or an HF checkpoint directory in `dtype` (float32|bfloat16);
    with no path, the embedded demo model (`DEFAULT_MODEL`). See `load_params` for
    `placement` and the memory it takes. Quantized weights (an FP8 checkpoint, an artifact
    written by `ninfer convert --quantize`) load as `quant.QArray` leaves.

    quantize: "int8" | "int4" quantizes a float model's weights as it loads (`quant.
    quantize_params`: what `ninfer convert --quantize` writes; None: as stored).

    verify: check every tensor's digest (artifacts) and that it holds no NaN/inf (artifacts and
    HF checkpoints); a failure is a CheckpointError naming the tensor. `verify=False` skips the
    hashing and scanning (shapes and dtypes are always checked) and is needed for artifacts of
    format_version 1, which record no digests.
    """
    quant.check_method(quantize, quant.CONVERT_METHODS)
    if quantize is None:
        return load_params(DEFAULT_MODEL if path is None else path, dtype, placement,
                           verify=verify)
    loaded = load_params(DEFAULT_MODEL if path is None else path, dtype, host_placement,
                         verify=verify)
    place = placement if placement is not None else _device_put
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        quant.quantize_params(loaded.params, quantize))
    params = jax.tree_util.tree_unflatten(
        treedef, [place(quant.key_path(p), a) for p, a in flat])
    return dataclasses.replace(loaded, params=params)


def load_params(path: str | pathlib.Path, dtype: str = "float32",
                placement: Placement | None = None, *, verify: bool = True) -> LoadedModel:
    """Streams the model package at `path` (artifact or HF checkpoint directory) into device
    buffers: for each params leaf in turn, its host array is read, cast to `dtype` in numpy and
    passed to `placement(key_path, host_array)` (default: `jax.device_put(host_array)`, waited
    for), whose result becomes the leaf; the host array is dropped before the next leaf is read. A leaf's
    digest and finiteness are checked (`verify`) before it is placed. Host memory beyond what
    the placements keep: about the largest leaf (a stacked [L, ...] leaf whole: the unit
    handed to `placement`) plus one source tensor; formats 1-3 hold the whole model (orbax).
    On the CPU backend the default placement's buffers are host memory too."""
    root = checkpoint_dir(path)
    np_dtype = np.dtype(_dtype(dtype))
    place = placement if placement is not None else _device_put
    if artifact_format.is_artifact(root):
        reader = artifact_format.open_artifact(root, verify=verify)
        cfg, notes, treedef = reader.config, tuple(reader.manifest.get("notes", ())), reader.treedef
        read = functools.partial(reader.read, dtype=np_dtype)
        paths = reader.paths()
    elif is_hf_checkpoint(root):
        config = read_config(root)
        cfg = ModelConfig.from_hf_dict(config)
        plan = hf_plan(cfg, SafetensorsSource(root, check_finite=verify),
                       quant.hf_fp8_block(config))
        notes, paths, treedef = tuple(plan.notes), plan.paths(), plan.treedef

        def read(p):
            return plan.read(p, cast=lambda a: a.astype(np_dtype, copy=False))
    else:
        raise CheckpointError(
            f"{str(root)!r} is neither an artifact (no manifest.json) nor an HF checkpoint "
            "(config.json + *.safetensors)"
        )
    # Each host array lives only until its placement returns.
    params = jax.tree_util.tree_unflatten(treedef, [place(p, read(p)) for p in paths])
    return LoadedModel(config=cfg, params=params, path=root, notes=notes)


def model_config(path: str | pathlib.Path | None = None) -> ModelConfig:
    """The ModelConfig of the package at `path` (None: the embedded default), read from its
    manifest or config.json alone (no weights)."""
    root = checkpoint_dir(DEFAULT_MODEL if path is None else path)
    if artifact_format.is_artifact(root):
        return ModelConfig.from_dict(artifact_format.read_manifest(root)["config"])
    return ModelConfig.from_hf_dict(read_config(root))


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
