"""Safetensors files read and written with plain file I/O, one tensor at a time.

Owns the safetensors layout (an 8-byte little-endian header length, a JSON header of
`{name: {dtype, shape, data_offsets}}`, then the raw C-order bytes) for the two places that need
bounded host memory: reading HF checkpoints (`hf.SafetensorsSource`) and the weights of artifact
format 4 (`format.py`, one file per params leaf). Reads go through `readinto` into a fresh
array, not a memory map: pages of a mapping stay in the process's resident set for as long as
the mapping lives, so mapping every shard of a checkpoint counts the whole checkpoint. Writes
stream: the header is written first from the known shape and dtype, then the bytes in pieces.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterable

import ml_dtypes
import numpy as np

from ninfer_jax.errors import CheckpointError

# safetensors dtype names; other names (rare 8-bit floats, complex) are left to `safe_open`.
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "U32": np.dtype(np.uint32), "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
NAMES = {dtype.name: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
READ_BYTES = 64 << 20  # one readinto call (Linux reads at most ~2 GiB per call)


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: `dtype` is the safetensors name ("BF16"), `start`/`stop` absolute
    byte offsets in the file."""

    file: pathlib.Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int

    @property
    def np_dtype(self) -> np.dtype | None:
        return DTYPES.get(self.dtype)


def read_header(file: pathlib.Path) -> dict[str, Entry]:
    """{tensor name: Entry} of a safetensors file; a CheckpointError names a file that is not
    one."""
    try:
        with open(file, "rb") as f:
            size = file.stat().st_size
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {length} does not fit the file ({size} bytes)")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        base, out = 8 + length, {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in meta["data_offsets"])
            shape = tuple(int(n) for n in meta["shape"])
            if not 0 <= begin <= end <= size - base:
                raise ValueError(f"tensor {name!r}'s data_offsets {[begin, end]} lie outside")
            dtype = DTYPES.get(meta["dtype"])
            if dtype is not None and end - begin != dtype.itemsize * int(np.prod(shape)):
                raise ValueError(f"tensor {name!r} holds {end - begin} bytes, not those of "
                                 f"shape {shape} {meta['dtype']}")
            out[name] = Entry(file, name, str(meta["dtype"]), shape, base + begin, base + end)
        return out
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read safetensors file {str(file)!r}: {e}") from e


def read_bytes_into(entry: Entry, out: np.ndarray, offset: int = 0) -> None:
    """Fills the C-contiguous `out` with the tensor's bytes from `offset` (bytes into its data)
    on, `out.nbytes` of them."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start + offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:done + READ_BYTES])
            if not n:
                raise CheckpointError(f"{str(entry.file)!r} ends inside its tensor data")
            done += n


def read(entry: Entry) -> np.ndarray:
    """The tensor as a fresh numpy array (no memory map is kept)."""
    dtype = entry.np_dtype
    if dtype is None:  # a dtype this module does not map: safetensors reads it, then unmaps
        from safetensors import safe_open

        with safe_open(str(entry.file), framework="numpy") as f:
            return np.array(f.get_tensor(entry.name))
    out = np.empty(entry.shape, dtype)
    read_bytes_into(entry, out)
    return out


def write(file: pathlib.Path, name: str, shape: tuple[int, ...], dtype: np.dtype,
          pieces: Iterable[np.ndarray]) -> None:
    """Writes a one-tensor safetensors file from `pieces`: C-contiguous arrays of `dtype` whose
    bytes, in order, are the tensor's (e.g. the layers of a stacked [L, ...] tensor)."""
    dtype = np.dtype(dtype)
    nbytes = dtype.itemsize * int(np.prod(shape))
    header = json.dumps({name: {"dtype": NAMES[dtype.name], "shape": list(shape),
                                "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    written = 0
    with open(file, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for piece in pieces:
            if piece.dtype != dtype or not piece.flags.c_contiguous:
                raise ValueError(f"{name}: a piece of dtype {piece.dtype} (contiguous "
                                 f"{piece.flags.c_contiguous}) for a {dtype} tensor")
            f.write(memoryview(piece.reshape(-1).view(np.uint8)))
            written += piece.nbytes
    if written != nbytes:
        raise ValueError(f"{name}: wrote {written} bytes for shape {shape} {dtype} ({nbytes})")
