"""`python -m ninfer_jax.artifact.upgrade DIR`: an older artifact to the current format in place.

Owns the two steps between formats. Format 1 -> 2 adds what format 2 records (every tensor's
shape, dtype and digest, and the list of files written); only `manifest.json` is rewritten
(atomically) and the weights stay byte for byte. The digests bless the weights as they are now:
shapes and dtypes are checked against the manifest and NaN/inf refused, but damage that keeps
values finite cannot be seen, so upgrade an artifact you trust, or re-run `ninfer convert` from
its source. Format 2 -> 3 stores the linear weights in nn.Linear's [out, in] layout: the
weights are read and verified against their format-2 digests, then the whole artifact is
written again through `write_artifact` (a staged directory renamed into place).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from ninfer_jax.artifact import digests
from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.errors import CheckpointError, NinferError
from ninfer_jax.models.qwen3_6.weights import from_legacy_layout


def _add_digests(root: pathlib.Path, manifest: dict) -> None:
    """Format 1 -> 2: the manifest only."""
    _, params, _ = artifact_format.read_artifact(root, verify=False)
    # read_artifact turned the layout into today's; the digests are of the tensors as stored
    # (the swap of the linear weights' last two axes is its own inverse).
    params = from_legacy_layout(params)
    tensors = {name: np.asarray(a) for name, a in digests.named_leaves(params).items()}
    digests.check_finite(tensors, str(root / artifact_format.WEIGHTS))
    sums, _ = digests.scan(tensors)
    weights = root / artifact_format.WEIGHTS
    files = [name for name in manifest.get("frontend_files", []) if (root / name).is_file()]
    files += [f.relative_to(root).as_posix() for f in weights.rglob("*") if f.is_file()]
    artifact_format.write_manifest(root, {
        **manifest,
        "format_version": 2,
        "tensor_digest": digests.ALGORITHM,
        "tensors": artifact_format.tensor_records(tensors, sums),
        "files": sorted(files),
    })


def upgrade(path: str | pathlib.Path) -> pathlib.Path:
    """Brings the artifact at `path` to the current format; returns its absolute path."""
    root = pathlib.Path(path).absolute()
    manifest = artifact_format.read_manifest(root)
    if manifest["format_version"] == artifact_format.FORMAT_VERSION:
        raise CheckpointError(f"{root} is already at format_version "
                              f"{artifact_format.FORMAT_VERSION}")
    if manifest["format_version"] == 1:
        _add_digests(root, manifest)
    cfg, params, manifest = artifact_format.read_artifact(root, verify=True)
    artifact_format.write_artifact(
        root, cfg, params, dtype=manifest["dtype"], sources=manifest.get("sources", {}),
        frontend_dir=root, notes=manifest.get("notes", []), overwrite=True)
    return root


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m ninfer_jax.artifact.upgrade ARTIFACT_DIR", file=sys.stderr)
        return 2
    try:
        print(upgrade(argv[1]))
    except NinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
