"""`python -m ninfer_jax.artifact.upgrade DIR`: a format-1 artifact to the current format in place.

Owns adding what format 2 records (every tensor's shape, dtype and digest, and the list of files
written) to an older manifest. Only `manifest.json` is rewritten (atomically); the weights stay
byte for byte. The digests bless the weights as they are now: shapes and dtypes are checked
against the manifest and NaN/inf refused, but damage that keeps values finite cannot be seen, so
upgrade an artifact you trust, or re-run `ninfer convert` from its source.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from ninfer_jax.artifact import digests
from ninfer_jax.artifact import format as artifact_format
from ninfer_jax.errors import CheckpointError, NinferError


def upgrade(path: str | pathlib.Path) -> pathlib.Path:
    """Rewrites the manifest of the format-1 artifact at `path`; returns its absolute path."""
    root = pathlib.Path(path).absolute()
    manifest = artifact_format.read_manifest(root)
    if manifest["format_version"] == artifact_format.FORMAT_VERSION:
        raise CheckpointError(f"{root} is already at format_version "
                              f"{artifact_format.FORMAT_VERSION}")
    _, params, _ = artifact_format.read_artifact(root, verify=False)
    tensors = {name: np.asarray(a) for name, a in digests.named_leaves(params).items()}
    digests.check_finite(tensors, str(root / artifact_format.WEIGHTS))
    sums, _ = digests.scan(tensors)
    weights = root / artifact_format.WEIGHTS
    files = [name for name in manifest.get("frontend_files", []) if (root / name).is_file()]
    files += [f.relative_to(root).as_posix() for f in weights.rglob("*") if f.is_file()]
    artifact_format.write_manifest(root, {
        **manifest,
        "format_version": artifact_format.FORMAT_VERSION,
        "tensor_digest": digests.ALGORITHM,
        "tensors": artifact_format.tensor_records(tensors, sums),
        "files": sorted(files),
    })
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
