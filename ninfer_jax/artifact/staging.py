"""Writing an output directory in one step: build it beside the target, then rename it in.

Owns the `--out` rules of the writers (`ninfer convert`, `ninfer export-hf`):
- a new path or an empty directory is written; a non-empty one only when it holds exactly what
  the same writer wrote before (the writer's `foreign` check says what else it holds) and the
  caller asked for `overwrite`;
- everything is written into a fresh directory `.<name>.ninfer-tmp-<hex>` beside the target (same
  filesystem), fsynced, and renamed into place. A replaced target is first renamed aside to
  `.<name>.ninfer-old-<hex>` and removed only once the new one is in place;
- a failure part-way removes the temporary directory and leaves the target as it was. A kill
  leaves the temporary directory behind; later runs never read or remove it.
Nothing is removed that this module did not create, except a replaced target the writer
recognised as its own.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
from collections.abc import Callable, Iterator

from ninfer_jax.errors import CheckpointError

TMP_MARK = ".ninfer-tmp-"
OLD_MARK = ".ninfer-old-"

# (directory) -> None when it holds only what the writer writes, else what else it holds.
Foreign = Callable[[pathlib.Path], "str | None"]


def _is_empty_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_target(out: str | pathlib.Path, *, overwrite: bool, foreign: Foreign,
                 holds: str) -> pathlib.Path:
    """The absolute target, or a CheckpointError saying why nothing may be written there.

    holds: what the writer's own output is called in messages, e.g. "a ninfer artifact".
    """
    out = pathlib.Path(out).absolute()
    if out.is_symlink():
        raise CheckpointError(f"--out {str(out)!r} is a symbolic link; give the directory itself")
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {str(out)!r} exists and is not a directory")
    if not out.exists() or _is_empty_dir(out):
        return out
    reason = foreign(out)
    if reason is not None:
        raise CheckpointError(
            f"--out {str(out)!r} is not empty and is not {holds} ({reason}); refusing to write "
            "there: choose a new or empty directory")
    if not overwrite:
        raise CheckpointError(
            f"--out {str(out)!r} already holds {holds}; pass --overwrite (overwrite=True) to "
            "replace it")
    return out


def holdings(root: pathlib.Path) -> str:
    """'it holds' and up to three of the entries directly under `root`, for messages."""
    names = sorted(entry.name for entry in root.iterdir())
    shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
    return f"it holds {shown}"


def file_set_problem(root: pathlib.Path, written: set[str]) -> str | None:
    """None when every entry under `root` is a file named in `written` (POSIX paths relative to
    `root`) or a directory on the way to one; else the first other entry, described."""
    dirs = {str(parent) for name in written for parent in pathlib.PurePosixPath(name).parents}
    for entry in sorted(root.rglob("*")):
        rel = entry.relative_to(root).as_posix()
        if entry.is_symlink():
            return f"it holds the link {rel!r}"
        if entry.is_dir() and rel not in dirs:
            return f"it holds the directory {rel!r}"
        if not entry.is_dir() and rel not in written:
            return f"it holds {rel!r}"
    return None


def _new_sibling(out: pathlib.Path, mark: str) -> pathlib.Path:
    """A path beside `out` that does not exist yet."""
    while True:
        path = out.parent / f".{out.name}{mark}{secrets.token_hex(4)}"
        if not path.exists() and not path.is_symlink():
            return path


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    for entry in root.rglob("*"):
        if not entry.is_symlink():
            _fsync(entry)
    _fsync(root)


def _move_in(tmp: pathlib.Path, out: pathlib.Path, replace: bool) -> pathlib.Path | None:
    """Renames `tmp` to `out`; returns where a replaced `out` was set aside (still to remove)."""
    if not replace:
        os.rename(tmp, out)  # atomic; fails if something appeared in an empty `out` meanwhile
        return None
    old = _new_sibling(out, OLD_MARK)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    return old


@contextlib.contextmanager
def staged_dir(out: str | pathlib.Path, *, overwrite: bool, foreign: Foreign,
               holds: str) -> Iterator[pathlib.Path]:
    """Yields a fresh directory to write into; on a clean exit it becomes `out` (see module).

    The target is checked before the body runs and again just before the rename, so a target
    that changed meanwhile is never replaced unchecked.
    """
    out = check_target(out, overwrite=overwrite, foreign=foreign, holds=holds)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _new_sibling(out, TMP_MARK)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot create a directory beside --out {str(out)!r}: {e}") from e
    try:
        yield tmp
        _fsync_tree(tmp)
        check_target(out, overwrite=overwrite, foreign=foreign, holds=holds)
        old = _move_in(tmp, out, replace=out.exists() and not _is_empty_dir(out))
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # disk full and other write errors come as OSError or the writer's own
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"writing --out {str(out)!r} failed ({type(e).__name__}: {e}); "
                              "it was left as it was") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(out.parent)
    if old is not None:
        # The new one is in place: a failure to remove the old copy leaves `.<name>.ninfer-old-*`.
        shutil.rmtree(old, ignore_errors=True)
