"""Block files of the posix store: format, safe opening, verification, quarantine, temp owners.

Format: a 36-byte header (magic, version, reserved, data length, crc32 of the data, block id)
followed by the data.

Safe opening: a block's directory is opened with O_DIRECTORY | O_NOFOLLOW and the block file,
relative to it, is `lstat`ed and then opened with O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, so nothing
is followed and nothing blocks. Anything but a regular file at a block path (symlink, FIFO,
directory, device, socket) raises `Foreign` and is never read; a permission or other OS failure
is OsApiError naming the path.

Quarantine moves an entry aside only if it is still the one examined (same device + inode), so a
reader never moves away a good file another store just renamed into place.

Temp owners: each writer (one per store instance) holds an flock on `tmp/<owner>.lock` for its
life and names its temp files `tmp/<owner>.<n>.tmp`, owner = `<pid>-<instance>-<random>`.
`clear_stale_temps` deletes a temp file only when its owner is provably gone: the owner's lock
file is absent (a live owner creates it before its first temp file and removes it after its
last), or its flock can be taken (flocks end with the process or the file description).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import pathlib
import secrets
import stat
import struct
import zlib
from collections.abc import Sequence

from ninfer_jax.store.errors import OsApiError
from ninfer_jax.store.types import BlockId

HEADER = struct.Struct("<4sHHQI16s")
MAGIC = b"NJSB"
VERSION = 1
_CHUNK = 1 << 20  # bytes read per call while verifying
_MAX_OWNER_TRIES = 100

Identity = tuple[int, int, int, int, int]  # dev, inode, size, mtime_ns, ctime_ns


def identity(st: os.stat_result) -> Identity:
    """What a verification is valid for: any rewrite, rename over, or utime changes it."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Foreign(OsApiError):
    """Something other than a regular file sits at a block path; it is never read or followed."""

    def __init__(self, path: pathlib.Path, st: os.stat_result):
        self.kind = _describe(st.st_mode)
        super().__init__(f"posix: {path} is a {self.kind}, not a block file")
        self.identity = identity(st)


def _describe(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
             (stat.S_ISSOCK, "socket")]
    return next((name for test, name in kinds if test(mode)), f"file of mode {mode:o}")


def open_dir(path: pathlib.Path) -> int | None:
    """A read fd of the directory at `path` (never through a symlink); None if absent."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OsApiError(f"posix: {path} is not a usable directory: {e}") from e


def make_dir(path: pathlib.Path) -> int:
    """Creates the directory at `path` if absent and opens it like `open_dir`."""
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    except OSError as e:
        raise OsApiError(f"posix: cannot create directory {path}: {e}") from e
    fd = open_dir(path)
    if fd is None:
        raise OsApiError(f"posix: directory {path} vanished while being created")
    return fd


def stat_entry(dir_fd: int, name: str, path: pathlib.Path) -> os.stat_result | None:
    """`lstat` of `name` in `dir_fd`; None if absent."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OsApiError(f"posix: cannot stat block file {path}: {e}") from e


def open_block(dir_fd: int, name: str, path: pathlib.Path) -> int | None:
    """A read fd of the regular file `name` in `dir_fd`; None if absent; `Foreign` if not regular.

    The lstat comes first so a device is never opened; the fstat after opening closes the race
    with a swap in between.
    """
    st = stat_entry(dir_fd, name, path)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise Foreign(path, st)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENODEV):  # swapped for a link or node
            st = stat_entry(dir_fd, name, path)
            if st is None:
                return None
            raise Foreign(path, st) from e
        raise OsApiError(f"posix: cannot open block file {path}: {e}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise Foreign(path, st)
    return fd


def read_header(fd: int, block_id: BlockId) -> tuple[int, int] | None:
    """(data length, crc32) if the file starts with a well-formed header for `block_id`."""
    raw = os.pread(fd, HEADER.size, 0)
    if len(raw) != HEADER.size:
        return None
    magic, version, _, length, crc, stored_id = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or stored_id != block_id.bytes:
        return None
    if os.fstat(fd).st_size != HEADER.size + length:
        return None
    return length, crc


def read_data(fd: int, views: Sequence[memoryview], crc: int = 0) -> int | None:
    """Fills `views` with the data after the header; the running crc32, or None if short."""
    offset = HEADER.size
    for view in views:
        done = 0
        while done < view.nbytes:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                return None
            done += got
        crc = zlib.crc32(view, crc)
        offset += view.nbytes
    return crc


def verify(fd: int, block_id: BlockId) -> bool:
    """The header names `block_id`, the length matches and the data's crc32 is the stored one."""
    header = read_header(fd, block_id)
    if header is None:
        return False
    length, expected = header
    scratch = memoryview(bytearray(min(length, _CHUNK)))
    crc, offset = 0, HEADER.size
    while offset < HEADER.size + length:
        n = min(_CHUNK, HEADER.size + length - offset)
        got = os.preadv(fd, [scratch[:n]], offset)
        if got == 0:
            return False
        crc = zlib.crc32(scratch[:got], crc)
        offset += got
    return crc == expected


def quarantine(dir_fd: int, name: str, path: pathlib.Path, examined: Identity,
               dest: pathlib.Path) -> bool:
    """Moves the entry `name` (at `path`) to `dest` if it is still the examined one; whether
    it did."""
    st = stat_entry(dir_fd, name, path)
    if st is None or identity(st)[:2] != examined[:2]:
        return False  # gone, or already replaced by another writer's complete file
    try:
        os.replace(name, dest, src_dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise OsApiError(f"posix: cannot quarantine {path} to {dest}: {e}") from e
    moved = os.stat(dest, follow_symlinks=False)
    if identity(moved)[:2] != examined[:2]:
        # Another writer renamed a complete file into place between the check and the move:
        # one id is one content (G1), so putting it back is right even over a newer copy.
        os.replace(dest, name, dst_dir_fd=dir_fd)
        return False
    return True


_instances = itertools.count()


class TempOwner:
    """One writer's claim on its temp files: a held flock on `tmp/<owner>.lock`."""

    def __init__(self, tmp_dir: pathlib.Path):
        self._tmp = tmp_dir
        self._numbers = itertools.count()
        self._fd: int | None = None
        for _ in range(_MAX_OWNER_TRIES):
            name = f"{os.getpid()}-{next(_instances)}-{secrets.token_hex(4)}"
            lock = tmp_dir / f"{name}.lock"
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                continue
            except OSError as e:
                raise OsApiError(f"posix: cannot create the writer lock {lock}: {e}") from e
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A cleaner may have taken the lock between our create and flock, judged the owner
            # dead and removed the file: then the lock we hold is on a ghost; try a new name.
            try:
                current = identity(os.stat(lock, follow_symlinks=False))
            except FileNotFoundError:
                current = None
            if current is not None and current[:2] == identity(os.fstat(fd))[:2]:
                self.name, self._lock, self._fd = name, lock, fd
                return
            os.close(fd)
        raise OsApiError(f"posix: could not claim a writer lock in {tmp_dir} after "
                         f"{_MAX_OWNER_TRIES} tries")

    def temp_path(self) -> pathlib.Path:
        return self._tmp / f"{self.name}.{next(self._numbers)}.tmp"

    def release(self) -> None:
        """Removes the lock file, then drops the lock (in that order, so no cleaner races)."""
        if self._fd is not None:
            self._lock.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


def clear_stale_temps(tmp_dir: pathlib.Path) -> None:
    """Deletes temp files (and locks) of owners that are provably gone; see the module doc."""
    by_owner: dict[str, list[str]] = {}
    try:
        for entry in os.listdir(tmp_dir):
            by_owner.setdefault(entry.partition(".")[0], []).append(entry)
    except OSError as e:
        raise OsApiError(f"posix: cannot list {tmp_dir}: {e}") from e
    for owner, names in by_owner.items():
        lock = tmp_dir / f"{owner}.lock"
        state, fd = _lock_state(lock)
        if state == "live":
            continue
        try:
            for name in names:
                if name != lock.name:
                    _unlink(tmp_dir / name)
            if state == "dead":
                _unlink(lock)
        finally:
            if fd is not None:
                os.close(fd)


def _lock_state(lock: pathlib.Path) -> tuple[str, int | None]:
    """("live", None), ("dead", fd holding the lock) or ("absent", None) for an owner's lock."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "absent", None
    except OSError:
        return "dead", None  # not a lock file this store made (a symlink, a socket): junk
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return "live", None
    except OSError:
        pass  # a FIFO or other junk that cannot be locked: no owner holds it
    return "dead", fd


def _unlink(path: pathlib.Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        raise OsApiError(f"posix: cannot remove stale temp file {path}: {e}") from e
