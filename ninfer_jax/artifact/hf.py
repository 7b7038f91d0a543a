"""Reading Hugging Face checkpoint directories: config.json plus single-file or sharded safetensors.

Owns file discovery, the shard index and lazy tensor access, and (with `check_finite`) refusing
a tensor that holds NaN or inf, by name. Each `get` reads one tensor into a fresh array with
plain file reads (`tensorfile`); nothing stays mapped, so a reader that drops each tensor holds
about one tensor, whatever the checkpoint's size. It knows tensor names only as strings; the schema,
with its shapes and dtypes, lives in `models/qwen3_6/weights.py`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import numpy as np

from ninfer_jax.artifact import tensorfile
from ninfer_jax.artifact.digests import all_finite
from ninfer_jax.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_dir(path: str | pathlib.Path) -> pathlib.Path:
    """The path as a readable directory, or a CheckpointError naming it."""
    p = pathlib.Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"{str(p)!r} is not a directory")
    return p


def is_hf_checkpoint(path: str | pathlib.Path) -> bool:
    p = pathlib.Path(path)
    return (p / "config.json").is_file() and ((p / INDEX).is_file() or (p / SINGLE).is_file()
                                              or any(p.glob("*.safetensors")))


class SafetensorsSource:
    """Lazy, name-addressed access to every tensor of a checkpoint directory (numpy arrays).

    check_finite: `get` raises a CheckpointError naming a tensor that holds NaN or inf.
    """

    def __init__(self, path: str | pathlib.Path, check_finite: bool = True):
        self.check_finite = check_finite
        root = checkpoint_dir(path)
        index = root / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index} is not a valid shard index: {e}") from e
            file_of = {name: root / shard for name, shard in weight_map.items()}
            missing = sorted({str(f) for f in file_of.values() if not f.is_file()})
            if missing:
                raise CheckpointError(f"shard files named in {INDEX} are missing: {missing}")
            headers = {f: tensorfile.read_header(f) for f in sorted(set(file_of.values()))}
            self._entries = {}
            for name, f in file_of.items():
                if name not in headers[f]:
                    raise CheckpointError(f"{INDEX} places tensor {name!r} in {str(f)!r}, "
                                          "which does not hold it")
                self._entries[name] = headers[f][name]
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {str(root)!r}")
            self._entries = {}
            for f in files:
                self._entries.update(tensorfile.read_header(f))
        self.files = sorted({e.file for e in self._entries.values()})

    def keys(self) -> Iterator[str]:
        return iter(self._entries)

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as a new array (read now; no mapping is kept)."""
        if name not in self._entries:
            raise CheckpointError(f"missing tensor {name!r}")
        entry = self._entries[name]
        tensor = tensorfile.read(entry)
        if self.check_finite and not all_finite(tensor):
            raise CheckpointError(f"tensor {name!r} in {entry.file!s} holds NaN or inf values")
        return tensor


def read_config(path: str | pathlib.Path) -> dict:
    file = checkpoint_dir(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {str(path)!r}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
