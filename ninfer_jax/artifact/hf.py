"""Reading Hugging Face checkpoint directories: config.json plus single-file or sharded safetensors.

Owns file discovery, the shard index and lazy tensor access, and (with `check_finite`) refusing
a tensor that holds NaN or inf, by name. It knows tensor names only as strings; the schema,
with its shapes and dtypes, lives in `models/qwen3_6/weights.py`.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import numpy as np
from safetensors import safe_open

from ninfer_jax.artifact.digests import check_finite as _check_finite
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
            self._file_of = {name: root / shard for name, shard in weight_map.items()}
            missing = sorted({str(f) for f in self._file_of.values() if not f.is_file()})
            if missing:
                raise CheckpointError(f"shard files named in {INDEX} are missing: {missing}")
        else:
            files = sorted(root.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {str(root)!r}")
            self._file_of = {}
            for f in files:
                for name in self._open(f).keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._file_of[name] = f
        self.files = sorted(set(self._file_of.values()))
        self._handles: dict[pathlib.Path, object] = {}

    def _open(self, file: pathlib.Path):
        try:
            return safe_open(str(file), framework="numpy")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"cannot read safetensors file {str(file)!r}: {e}") from e

    def keys(self) -> Iterator[str]:
        return iter(self._file_of)

    def get(self, name: str) -> np.ndarray:
        if name not in self._file_of:
            raise CheckpointError(f"missing tensor {name!r}")
        file = self._file_of[name]
        if file not in self._handles:
            self._handles[file] = self._open(file)
        tensor = self._handles[file].get_tensor(name)
        if self.check_finite:
            _check_finite({name: tensor}, str(file))
        return tensor


def read_config(path: str | pathlib.Path) -> dict:
    file = checkpoint_dir(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {str(path)!r}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
