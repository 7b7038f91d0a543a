"""HF checkpoint -> artifact conversion (`ninfer convert`).

Streams: every name and shape is checked first (`weights.hf_plan`), then each params leaf is
made one source tensor at a time (a stacked [L, ...] leaf layer by layer), cast, hashed and
written before the next tensor is read (`format.write_leaves`). Host memory holds about one
source tensor and its cast copy, whatever the checkpoint's size.
"""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np

from ninfer_jax import quant
from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.artifact import staging
from ninfer_jax.artifact.hf import SafetensorsSource, checkpoint_dir, read_config
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import hf_plan
from ninfer_jax.progress import bar

SOURCE_DTYPES = {"float32", "bfloat16"}


class _Counted:
    """A tensor source that advances a progress bar for every tensor read."""

    def __init__(self, source: SafetensorsSource, bar):
        self.source, self.bar = source, bar

    def keys(self):
        return self.source.keys()

    def get(self, name: str) -> np.ndarray:
        tensor = self.source.get(name)
        self.bar.update(1)
        return tensor


def convert(hf_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "float32",
            overwrite: bool = False, progress: bool | None = None,
            drafter: str | pathlib.Path | None = None,
            quantize: str | None = None) -> tuple[pathlib.Path, list[str]]:
    """Writes the artifact of the HF checkpoint at `hf_dir` to `out`; returns (out, notes).
    `drafter`: a DFlash drafter checkpoint directory (public layout) the artifact carries
    under `drafter/`, where `Engine.open(..., speculative="dflash")` finds it.

    `out` is refused before anything is read unless it is new, empty, or (with `overwrite`)
    exactly an artifact written before; see `staging`. progress: a bar over the tensors read
    (None: in a notebook only; see `ninfer_jax.progress`).

    quantize: "int8" | "int4" writes the weights `quant.quantizes` names group-wise quantized
    (`quant.quantize_int`; each stacked leaf is quantized whole, so host memory then holds one
    leaf); None keeps them as the checkpoint has them. An FP8 checkpoint (fine-grained, the
    official layout) is written as FP8 values and scales either way: it is not requantized.
    """
    if dtype not in SOURCE_DTYPES:
        raise CheckpointError(f"dtype must be one of {sorted(SOURCE_DTYPES)}, got {dtype!r}")
    staging.check_target(out, overwrite=overwrite, foreign=artifact_format.foreign,
                         holds=artifact_format.HOLDS)
    quant.check_method(quantize, quant.CONVERT_METHODS)
    root = checkpoint_dir(hf_dir)
    config = read_config(root)
    cfg = ModelConfig.from_hf_dict(config)
    source = SafetensorsSource(root)
    target = np.float32 if dtype == "float32" else ml_dtypes.bfloat16

    def cast(a: np.ndarray) -> np.ndarray:
        return a.astype(target, copy=False)

    with bar(progress, len(list(source.keys())), "reading tensors", "tensor") as b:
        plan = hf_plan(cfg, _Counted(source, b), quant.hf_fp8_block(config))
        quantization = quant.record(plan.tree)
        if quantize is not None and quantization is not None:
            raise CheckpointError(f"{str(root)!r} is {quantization['method']} already; "
                                  f"--quantize={quantize} takes a float checkpoint")
        leaves = {}
        for path in plan.paths():
            name = ".".join(path)
            if quantize is not None and quant.quantizes(path):
                leaves.update(_quantized(plan, path, name, quantize))
            else:
                leaves[name] = (plan.shape(path), lambda path=path: plan.pieces(path, cast))
        if quantize is not None:
            quantization = quant.blocks_record(((p, plan.shape(p)) for p in plan.paths()),
                                               quantize)
        sources = {f.name: artifact_format.sha256_file(f)
                   for f in [root / "config.json", *source.files]}
        path = artifact_format.write_leaves(
            out, cfg, leaves, num_mtp_layers=plan.num_mtp_layers(), dtype=dtype,
            sources=sources, frontend_dir=root, notes=plan.notes, overwrite=overwrite,
            drafter_dir=None if drafter is None else checkpoint_dir(drafter),
            quantization=quantization)
        # Tensors the model does not use (e.g. a vision tower); a fused gate_up is read twice.
        b.update(max(0, b.total - b.n))
    return path, plan.notes


def _quantized(plan, path: tuple[str, ...], name: str, method: str) -> dict:
    """The leaves `name.q`, `name.scale` of the weight at `path`, quantized when first read."""
    held = {}

    def field(which: str):
        if which not in held:
            held.update(vars(quant.quantize_int(plan.read(path, _float32), method)))
        yield np.ascontiguousarray(held.pop(which))

    *lead, out, cols = plan.shape(path)
    g = quant.group_size(cols)
    values = (*lead, out, cols // 2 if method == "int4" else cols)
    return {f"{name}.q": (values, lambda: field("q")),
            f"{name}.scale": ((*lead, out, cols // g), lambda: field("scale"))}


def _float32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32, copy=False)
