"""The artifact format: one directory per model package.

    manifest.json     family, variant, every dimension (the ModelConfig), dtype, the source
                      files' sha256, the frontend resources present, notes (what was skipped);
                      since format 2 also every tensor's shape, dtype and digest
                      (`artifact/digests.py`) and the exact list of files written
    weights/          since format 4 one safetensors file per params leaf,
                      `weights/<dotted name>.safetensors` holding that one tensor (written and
                      read a piece at a time, `tensorfile`); formats 1-3 saved the pytree with
                      orbax. Since format 3 linear weights are nn.Linear's [out, in] (formats 1
                      and 2 stored [in, out]: they load through `weights.from_legacy_layout`)
    <frontend files>  tokenizer files and chat template, copied when the source has them

Owns writing and reading that layout. Writing goes through `staging.staged_dir` (a temporary
directory beside `out`, renamed into place) and streams: `write_leaves` takes each leaf as
pieces (e.g. one layer of a stacked [L, ...] leaf at a time), hashing and writing each piece
before the next is made, so it holds about one piece. Reading (`open_artifact`) compares three
records of every tensor — what the manifest's config implies, what the manifest lists, what the
weights store — before any data is read (orbax would restore the stored shape and cast the
stored dtype whatever the target says); then `ArtifactReader.read` reads one leaf at a time,
checking its digest and finiteness (unless `verify=False`) before handing it out. Formats 1-3
(orbax) are restored whole when opened.
Format 1 (no digests) loads only with `verify=False`: a default that promises verified weights
must not quietly load unverifiable ones (`python -m ninfer_jax.artifact.upgrade DIR` adds them
and rewrites older layouts as format 3).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ninfer_jax import quant
from ninfer_jax.artifact import digests, staging, tensorfile
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.weights import from_legacy_layout, param_shapes

FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)  # 1: no digests and no file list; 1 and 2: [in, out] linears
DIGESTS_SINCE = 2
LAYOUT_SINCE = 3  # linear weights [out, in]
FILES_SINCE = 4  # weights/<name>.safetensors, one per leaf (before: an orbax checkpoint)
FAMILY = "qwen3_6"
MANIFEST = "manifest.json"
WEIGHTS = "weights"
DTYPES = ("float32", "bfloat16")
HOLDS = "a ninfer artifact"
DRAFTER = "drafter"  # the subdirectory holding a DFlash drafter checkpoint, when there is one
FRONTEND_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
    "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
)

Spec = tuple[tuple[int, ...], str]  # (shape, dtype name)


def is_artifact(path: str | pathlib.Path) -> bool:
    return (pathlib.Path(path) / MANIFEST).is_file()


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def expected_tensors(cfg: ModelConfig, num_mtp_layers: int, dtype: str,
                     legacy: bool = False, quantization: dict | None = None) -> dict[str, Spec]:
    """{tensor name: (shape, dtype)} that a config, MTP depth, dtype and quantization (the
    manifest's record, `quant.record`) imply (`legacy`: as formats 1 and 2 store them). A
    quantized weight `x` is stored as `x.q` (its values) and `x.scale` (fp32 scales)."""
    shapes = param_shapes(cfg, num_mtp_layers, legacy)
    dtypes = quant.leaf_dtypes(shapes, quantization, dtype)
    named = digests.named_leaves(quant.spec_tree(shapes, quantization),
                                 is_leaf=lambda x: isinstance(x, tuple))
    return {name: (tuple(shape), dtypes[name].name) for name, shape in named.items()}


def _spec(shape, dtype) -> str:
    return f"shape {tuple(shape)} dtype {np.dtype(dtype).name}"


def _check_specs(found: dict[str, Spec], expected: dict[str, Spec], where: str) -> None:
    """Raises a CheckpointError naming the first tensor whose name, shape or dtype differ."""
    for name in sorted(set(found) | set(expected)):
        if name not in found:
            raise CheckpointError(f"tensor {name!r} is missing from {where} (expected "
                                  f"{_spec(*expected[name])})")
        if name not in expected:
            raise CheckpointError(f"{where} has tensor {name!r} ({_spec(*found[name])}), which "
                                  f"the config in {MANIFEST} does not have")
        if (tuple(found[name][0]), np.dtype(found[name][1])) != (
                expected[name][0], np.dtype(expected[name][1])):
            raise CheckpointError(f"tensor {name!r} in {where}: found {_spec(*found[name])}, "
                                  f"expected {_spec(*expected[name])} (from {MANIFEST})")


def tensor_records(tensors: dict[str, np.ndarray], sums: dict[str, str]) -> dict[str, dict]:
    """The manifest's `tensors` entry."""
    return {name: {"shape": list(np.shape(a)), "dtype": np.dtype(a.dtype).name,
                   "digest": sums[name]} for name, a in tensors.items()}


def write_manifest(root: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Writes `root/manifest.json` whole or not at all (a fsynced temporary file, renamed)."""
    tmp = root / f".{MANIFEST}{staging.TMP_MARK}"
    with open(tmp, "w") as f:
        f.write(json.dumps(manifest, indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


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
        return (f"its {MANIFEST} (format_version {manifest.get('format_version')!r}) does not list "
                "the files written, so they cannot be told apart from others; run `python -m "
                "ninfer_jax.artifact.upgrade DIR` on it first, or remove it yourself")
    return staging.file_set_problem(path, {*files, MANIFEST})


def _num_mtp_layers(params: dict) -> int:
    return len(params["mtp"]["layers"]["input_norm"]) if "mtp" in params else 0


Leaf = tuple[tuple[int, ...], Callable[[], Iterable[np.ndarray]]]  # (shape, pieces)


def write_artifact(out: str | pathlib.Path, cfg: ModelConfig, params: dict, *, dtype: str,
                   sources: dict[str, str], frontend_dir: pathlib.Path | None,
                   notes: list[str], overwrite: bool = False,
                   drafter_dir: pathlib.Path | None = None) -> pathlib.Path:
    """Writes an artifact directory at `out` from a params pytree in memory, quantized
    weights (`quant.QArray`) included (see `write_leaves` for the rest)."""
    tensors = {name: np.asarray(a) for name, a in digests.named_leaves(params).items()}
    leaves = {name: (a.shape, lambda a=a: [np.ascontiguousarray(a)])
              for name, a in tensors.items()}
    return write_leaves(out, cfg, leaves, num_mtp_layers=_num_mtp_layers(params), dtype=dtype,
                        sources=sources, frontend_dir=frontend_dir, notes=notes,
                        overwrite=overwrite, drafter_dir=drafter_dir,
                        quantization=quant.record(params))


def write_leaves(out: str | pathlib.Path, cfg: ModelConfig, leaves: dict[str, Leaf], *,
                 num_mtp_layers: int, dtype: str, sources: dict[str, str],
                 frontend_dir: pathlib.Path | None, notes: list[str], overwrite: bool = False,
                 drafter_dir: pathlib.Path | None = None,
                 where: str = "the params", quantization: dict | None = None) -> pathlib.Path:
    """Writes an artifact directory at `out` (see `staging` for what may be replaced).

    leaves: {dotted name: (shape, pieces)}, `pieces()` yielding C-contiguous arrays of `dtype`
    (a quantized weight's values and scales: their own dtypes, see `expected_tensors`; the
    weights `quantization` names, `quant.record`) whose bytes in order are the tensor's; names
    and shapes are checked against `cfg` first,
    then each leaf is written, hashed and scanned piece by piece (a NaN/inf is a
    CheckpointError naming the tensor in `where`, and nothing is left at `out`).
    `drafter_dir`: a DFlash drafter checkpoint (public layout) to carry under `drafter/`; it is
    read and checked against `cfg` first, then its files are copied as they are."""
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    staging.check_target(out, overwrite=overwrite, foreign=foreign, holds=HOLDS)
    expected = expected_tensors(cfg, num_mtp_layers, dtype, quantization=quantization)
    _check_specs({n: (shape, expected[n][1] if n in expected else dtype)
                  for n, (shape, _) in leaves.items()}, expected, where)
    drafter_files = _drafter_files(drafter_dir, cfg) if drafter_dir is not None else []
    with staging.staged_dir(out, overwrite=overwrite, foreign=foreign, holds=HOLDS) as tmp:
        if drafter_files:
            (tmp / DRAFTER).mkdir()
            for f in drafter_files:
                shutil.copy2(f, tmp / DRAFTER / f.name)
        frontend = []
        if frontend_dir is not None:
            for name in FRONTEND_FILES:
                if (frontend_dir / name).is_file():
                    shutil.copy2(frontend_dir / name, tmp / name)
                    frontend.append(name)
        (tmp / WEIGHTS).mkdir()
        records = {}
        for name, (shape, pieces) in leaves.items():
            stored = np.dtype(expected[name][1])
            digest = digests.Digest(stored)

            def hashed(pieces=pieces, digest=digest, name=name, stored=stored):
                for piece in pieces():
                    if piece.dtype != stored:
                        raise CheckpointError(f"tensor {name!r} in {where} is {piece.dtype}, "
                                              f"expected {stored}")
                    digest.update(piece)
                    yield piece

            tensorfile.write(tmp / WEIGHTS / f"{name}.safetensors", name, tuple(shape),
                             stored, hashed())
            if not digest.finite:
                raise CheckpointError(f"tensor {name!r} in {where} holds NaN or inf values")
            records[name] = {"shape": list(shape), "dtype": stored.name,
                             "digest": digest.hexdigest()}
        write_manifest(tmp, {
            "format_version": FORMAT_VERSION,
            "family": FAMILY,
            "variant": cfg.variant,
            "dtype": dtype,
            "config": cfg.to_dict(),
            "num_mtp_layers": num_mtp_layers,
            "frontend_files": frontend,
            "drafter_files": [f"{DRAFTER}/{f.name}" for f in drafter_files],
            "sources": {**sources, **{f"{DRAFTER}/{f.name}": sha256_file(f)
                                      for f in drafter_files}},
            "notes": notes,
            "tensor_digest": digests.ALGORITHM,
            "tensors": records,
            **({} if quantization is None else {"quantization": quantization}),
            "files": sorted(f.relative_to(tmp).as_posix() for f in tmp.rglob("*") if f.is_file()),
        })
    return pathlib.Path(out).absolute()


def _drafter_files(drafter_dir: pathlib.Path, cfg: ModelConfig) -> list[pathlib.Path]:
    """The files of a DFlash drafter checkpoint for `cfg`'s target, after loading it whole
    (a config or tensor the layout refuses, a NaN or a target mismatch is a CheckpointError)."""
    from ninfer_jax.artifact.hf import SafetensorsSource, read_config
    from ninfer_jax.models.dflash import DFlashConfig
    from ninfer_jax.models.dflash.weights import params_from_hf as drafter_params

    root = pathlib.Path(drafter_dir)
    dcfg = DFlashConfig.from_hf_dict(read_config(root))
    dcfg.check_target(cfg.num_layers, cfg.hidden_size, cfg.vocab_size)
    source = SafetensorsSource(root)
    drafter_params(dcfg, source)  # reads (and scans) every tensor
    return [root / "config.json", *source.files]


def read_manifest(path: str | pathlib.Path) -> dict[str, Any]:
    file = pathlib.Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"no {MANIFEST} in {str(path)!r}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("family") != FAMILY:
        family = manifest.get("family") if isinstance(manifest, dict) else None
        raise CheckpointError(f"{file}: unknown family {family!r}; known: {FAMILY}")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{file}: format_version {manifest.get('format_version')!r} is "
                              f"not one of {list(READABLE_VERSIONS)}")
    if manifest.get("dtype") not in DTYPES:
        raise CheckpointError(f"{file}: dtype {manifest.get('dtype')!r} is not one of "
                              f"{list(DTYPES)}")
    num_mtp = manifest.get("num_mtp_layers", 0)
    if not isinstance(num_mtp, int) or num_mtp < 0:
        raise CheckpointError(f"{file}: num_mtp_layers must be an int >= 0, got {num_mtp!r}")
    if not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"{file}: 'config' must be an object")
    try:
        quant.check_record(manifest.get("quantization"))
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from e
    return manifest


def _recorded(manifest: dict, file: pathlib.Path) -> dict[str, Spec]:
    tensors = manifest.get("tensors")
    if manifest.get("tensor_digest") != digests.ALGORITHM or not isinstance(tensors, dict):
        raise CheckpointError(f"{file}: 'tensor_digest' must be {digests.ALGORITHM!r} and "
                              "'tensors' an object")
    try:
        if not all(isinstance(t["digest"], str) for t in tensors.values()):
            raise TypeError("a digest is not a string")
        return {name: (tuple(int(n) for n in t["shape"]), np.dtype(t["dtype"]).name)
                for name, t in tensors.items()}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: a 'tensors' entry is malformed: {e!r}") from e


def _stored_spec(name: str, meta: Any, weights: pathlib.Path) -> Spec:
    if not hasattr(meta, "shape") or not hasattr(meta, "dtype"):
        raise CheckpointError(f"{weights} holds {name!r}, which is not an array")
    return tuple(meta.shape), np.dtype(meta.dtype).name


def _stored_files(weights: pathlib.Path, expected: dict[str, Spec]
                  ) -> dict[str, tensorfile.Entry]:
    """{name: Entry} of format 4's one-tensor files, their headers checked against `expected`."""
    entries, found = {}, {}
    for file in sorted(weights.glob("*.safetensors")):
        header = tensorfile.read_header(file)
        name = file.name[: -len(".safetensors")]
        if list(header) != [name]:
            raise CheckpointError(f"{file} must hold exactly the tensor {name!r}, holds "
                                  f"{sorted(header)[:3]}")
        entry = header[name]
        if entry.np_dtype is None:
            raise CheckpointError(f"tensor {name!r} in {weights} has dtype {entry.dtype}")
        entries[name], found[name] = entry, (entry.shape, entry.np_dtype.name)
    _check_specs(found, expected, str(weights))
    return entries


class ArtifactReader:
    """An artifact opened for reading, every record checked (see `open_artifact`): `.config`,
    `.manifest`, `.paths()` and `.read(path)`, one leaf at a time."""

    def __init__(self, root: pathlib.Path, cfg: ModelConfig, manifest: dict, verify: bool,
                 entries: dict[str, tensorfile.Entry] | None, restored: dict | None):
        self.root, self.config, self.manifest, self.verify = root, cfg, manifest, verify
        self._entries, self._restored = entries, restored
        quantization = manifest.get("quantization")
        shapes = quant.spec_tree(param_shapes(cfg, manifest.get("num_mtp_layers", 0)),
                                 quantization)
        flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
        self._shapes = {quant.key_path(path): tuple(s) for path, s in flat[0]}
        self.treedef = jax.tree_util.tree_structure(shapes, is_leaf=lambda x: isinstance(x, tuple))
        # a quantized weight's values and scales keep their stored dtypes whatever `read` asks
        blocks = (quantization or {}).get("blocks", {})
        self._kept = {p for p in self._shapes if ".".join(p[:-1]) in blocks}

    def paths(self) -> list[tuple[str, ...]]:
        """Every leaf's key path in the params pytree, in pytree order."""
        return list(self._shapes)

    def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
        return self._shapes[path]

    def read(self, path: tuple[str, ...], dtype=None) -> np.ndarray:
        """The leaf at `path` as a new array in `dtype` (default: the stored one), its digest and
        finiteness checked first when verifying. Format 4 reads it now, in 64 MiB pieces (cast
        piece by piece: no second whole copy); older formats hand out (and forget) a leaf
        restored when the artifact was opened."""
        name = ".".join(path)
        if path in self._kept:
            dtype = None
        if self._restored is not None:
            leaf = self._restored.pop(name)
            return leaf if dtype is None else leaf.astype(dtype, copy=False)
        entry = self._entries[name]
        stored = entry.np_dtype
        out = np.empty(entry.shape, stored if dtype is None else dtype)
        flat = out.reshape(-1)
        step = max(1, digests.CHUNK_BYTES // stored.itemsize)
        digest = digests.Digest(stored)
        scratch = None if out.dtype == stored else np.empty(min(step, flat.size), stored)
        for start in range(0, flat.size, step):
            n = min(step, flat.size - start)
            piece = flat[start:start + n] if scratch is None else scratch[:n]
            tensorfile.read_bytes_into(entry, piece, start * stored.itemsize)
            if self.verify:
                digest.update(piece)
            if scratch is not None:
                flat[start:start + n] = piece
        if self.verify:
            record = self.manifest["tensors"][name]["digest"]
            found = digest.hexdigest()
            if found != record:
                raise CheckpointError(
                    f"tensor {name!r} does not match its digest in {self.root / MANIFEST} "
                    f"(recorded {record}, found {found}): the weights are damaged or were "
                    "changed after they were written")
            if not digest.finite:
                raise CheckpointError(f"tensor {name!r} in {self.root / WEIGHTS} holds NaN or "
                                      "inf values")
        return out


def open_artifact(path: str | pathlib.Path, *, verify: bool = True) -> ArtifactReader:
    """The artifact at `path`, opened: its manifest read, and every tensor's shape and dtype
    checked against what the config implies (in the manifest and in the stored weights) before
    any data is read. Any disagreement is a CheckpointError naming the tensor. Formats 1-3 are
    restored whole here (orbax), verified when `verify`, and come back in today's layout."""
    root = pathlib.Path(path).absolute()
    file = root / MANIFEST
    manifest = read_manifest(root)
    version = manifest["format_version"]
    legacy = version < LAYOUT_SINCE
    if verify and version < DIGESTS_SINCE:
        raise CheckpointError(
            f"{file}: format_version {version} records no tensor digests, so "
            f"the weights cannot be verified; add them with `python -m ninfer_jax.artifact."
            f"upgrade {root}`, re-run `ninfer convert`, or load with verify=False")
    cfg = ModelConfig.from_dict(manifest["config"])
    expected = expected_tensors(cfg, manifest.get("num_mtp_layers", 0), manifest["dtype"],
                                legacy, manifest.get("quantization"))
    if version >= DIGESTS_SINCE:
        _check_specs(_recorded(manifest, file), expected, f"{file}'s 'tensors'")
    weights = root / WEIGHTS
    if not weights.is_dir():
        raise CheckpointError(f"artifact {str(path)!r} has no {WEIGHTS}/ directory")
    if version >= FILES_SINCE:
        return ArtifactReader(root, cfg, manifest, verify, _stored_files(weights, expected), None)
    params = _restore(root, weights, cfg, manifest, expected, legacy, verify)
    return ArtifactReader(root, cfg, manifest, verify, None, digests.named_leaves(params))


def read_artifact(path: str | pathlib.Path, *,
                  verify: bool = True) -> tuple[ModelConfig, dict, dict[str, Any]]:
    """(config, params as numpy arrays in the stored dtype, manifest) of the artifact at `path`,
    whole (`open_artifact` reads one leaf at a time). Checks as `open_artifact` and
    `ArtifactReader.read` do; params of an older layout come back in today's."""
    reader = open_artifact(path, verify=verify)
    leaves = [reader.read(p) for p in reader.paths()]
    return reader.config, jax.tree_util.tree_unflatten(reader.treedef, leaves), reader.manifest


def _restore(root: pathlib.Path, weights: pathlib.Path, cfg: ModelConfig, manifest: dict,
             expected: dict[str, Spec], legacy: bool, verify: bool) -> dict:
    """The params of an orbax artifact (formats 1-3), whole, checked and in today's layout."""
    file = root / MANIFEST
    try:
        with ocp.StandardCheckpointer() as ckpt:
            stored = digests.named_leaves(ckpt.metadata(weights).item_metadata.tree)
    except Exception as e:  # orbax raises several types for missing or unreadable metadata
        raise CheckpointError(f"cannot read the weights' metadata in {weights}: {e}") from e
    _check_specs({n: _stored_spec(n, m, weights) for n, m in stored.items()}, expected,
                 str(weights))
    target = jax.tree.map(lambda s: np.empty(s, np.dtype(manifest["dtype"])),
                          param_shapes(cfg, manifest.get("num_mtp_layers", 0), legacy),
                          is_leaf=lambda x: isinstance(x, tuple))
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore(weights, target)
    except Exception as e:  # orbax raises several types for damaged data
        raise CheckpointError(f"cannot restore the weights of {str(root)!r}: {e}") from e
    if verify:
        tensors = {n: np.asarray(a) for n, a in digests.named_leaves(params).items()}
        found, nonfinite = digests.scan(tensors)
        for name, record in sorted(manifest["tensors"].items()):
            if found[name] != record["digest"]:
                raise CheckpointError(
                    f"tensor {name!r} does not match its digest in {file} (recorded "
                    f"{record['digest']}, found {found[name]}): the weights are damaged or were "
                    "changed after they were written")
        if nonfinite:
            raise CheckpointError(f"tensor {nonfinite[0]!r} in {weights} holds NaN or inf values")
    return from_legacy_layout(params) if legacy else params
