"""The artifact format: one directory per model package.

    manifest.json     family, variant, every dimension (the ModelConfig), dtype, the source
                      files' sha256, the frontend resources present, notes (what was skipped),
                      the exact list of files written
    weights/          the params pytree saved with orbax
    <frontend files>  tokenizer files and chat template, copied when the source has them

Owns writing and reading that layout. Writing goes through `staging.staged_dir` (a temporary
directory beside `out`, renamed into place); the file list is how a later `overwrite` knows the
directory holds nothing else. Reading an artifact restores the params with targets built from
the manifest, so a truncated or mismatched weights directory is an error, not a silently
different model.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ninfer_jax.artifact import staging
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6.config import ModelConfig

FORMAT_VERSION = 1
FAMILY = "qwen3_6"
MANIFEST = "manifest.json"
WEIGHTS = "weights"
HOLDS = "a ninfer artifact"
FRONTEND_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def is_artifact(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def foreign(path: pathlib.Path) -> str | None:
    """Why `path` is not exactly an artifact written by `write_artifact`, or None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("family") != FAMILY:
        return f"{staging.holdings(path)}, and no {MANIFEST} of a {FAMILY} artifact"
    files = manifest.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return (f"its {MANIFEST} does not list the files written, so they cannot be told apart "
                "from others; remove it yourself")
    return staging.file_set_problem(path, {*files, MANIFEST})


def write_artifact(out: str | pathlib.Path, cfg: ModelConfig, params: dict, *, dtype: str,
                   sources: dict[str, str], frontend_dir: pathlib.Path | None,
                   notes: list[str], overwrite: bool = False) -> pathlib.Path:
    """Writes an artifact directory at `out` (see `staging` for what may be replaced)."""
    with staging.staged_dir(out, overwrite=overwrite, foreign=foreign, holds=HOLDS) as tmp:
        frontend = []
        if frontend_dir is not None:
            for name in FRONTEND_FILES:
                if (frontend_dir / name).is_file():
                    shutil.copy2(frontend_dir / name, tmp / name)
                    frontend.append(name)
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp / WEIGHTS, params)
        manifest = {
            "format_version": FORMAT_VERSION,
            "family": FAMILY,
            "variant": cfg.variant,
            "dtype": dtype,
            "config": cfg.to_dict(),
            "num_mtp_layers": len(params["mtp"]["layers"]["input_norm"]) if "mtp" in params else 0,
            "frontend_files": frontend,
            "sources": sources,
            "notes": notes,
            "files": sorted(f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return pathlib.Path(out).absolute()


def read_manifest(path: str | pathlib.Path) -> dict[str, Any]:
    file = pathlib.Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"no {MANIFEST} in {str(path)!r}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if manifest.get("family") != FAMILY:
        raise CheckpointError(f"{file}: unknown family {manifest.get('family')!r}; known: {FAMILY}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: format_version {manifest.get('format_version')!r} is not {FORMAT_VERSION}"
        )
    return manifest


def read_artifact(path: str | pathlib.Path, target: dict) -> dict:
    """Restores the params saved under `path`, checked against `target`'s structure and shapes.

    target: a pytree of jax.ShapeDtypeStruct (or arrays) describing what the manifest implies.
    """
    weights = pathlib.Path(path).absolute() / WEIGHTS
    if not weights.is_dir():
        raise CheckpointError(f"artifact {str(path)!r} has no {WEIGHTS}/ directory")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(weights, abstract)
    except Exception as e:  # orbax raises several types for structure/shape mismatches
        raise CheckpointError(f"cannot restore the weights of {str(path)!r}: {e}") from e


def params_shapes(params: dict) -> dict:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), params)
