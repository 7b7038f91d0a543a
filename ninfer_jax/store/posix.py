"""The `posix` store: one checksummed file per block under a root directory.

Config: `root` (directory, created if absent), `num_threads` (transfer threads, default 4),
`block_bytes` (optional: every block is exactly this many bytes; a dump or load of another size is
refused at submit) and `piped_lower_store` (injected by a pipe: the tier below).

Layout: `root/blocks/<hh>/<hex>.blk` (committed blocks, fanned out by the id's first byte),
`root/tmp/` (writes in progress, named per writer; see posix_files), and `root/quarantine/`
(whatever failed verification or was not a regular file). File format and safe opening live in
posix_files.

Crash safety: a dump writes a temp file unique to this writer, fsyncs it, renames it over the
final name and fsyncs the directory, so a reader sees either no file or a complete one (never
torn), and a restart finds every block whose rename happened. Several stores (in one process or
many) may share a root: setup deletes only temp files of writers that are provably gone, and
concurrent dumps of one block are last-rename-wins over identical content (G1).

Verification: a hit needs a regular file whose header names the id, whose length matches and
whose data matches its crc32. Anything else is a miss and is moved to quarantine, so it is never
served; a load of it is a failed job. Lookup verifies a file once per identity (device, inode,
size, mtime_ns, ctime_ns) and remembers it, so a repeated lookup costs an `lstat` instead of
reading the whole block; a rewrite, rename or utime changes the identity and forces a new check.
A file changed in the last SETTLE_NS is checked on every lookup (timestamps are coarse). Every
load verifies the data it copies, so corruption that keeps the identity (bit rot under an
unchanged inode) fails the load and quarantines the file. Timestamps must come from this
machine's clock (a local filesystem). This store is untokened: a successful dump is its commit
(the rename), and it never evicts.

With a tier below (a middle tier of a pipe, e.g. cache -> posix -> redis), it behaves as the cache
tier does with one:
- Write-through: a dump first stores its blocks below (lower.py) and only then writes its files,
  so it succeeds only once the tier below holds every block too; a failure below fails the job
  and leaves no file here.
- `lookup(ids)` (the base lookup, which a tier above calls on this one) reports a block as a hit
  if it is a verified file here OR the tier below reports it (asked only for the blocks missing
  here, so a block can come up from any depth); a failure below is OsApiError as usual.
- `load` reads the blocks it has here and fetches the rest from below in one lower load (a
  block whose file fails verification is quarantined and fetched too), then writes them here,
  best-effort (a failed write is logged; the load still succeeds). Bytes from below are verified
  by that tier; the file written holds exactly them.
- Prefetchable (posix_prefetch) when `block_bytes` is also given (a prefetch has no caller's
  buffer to size its reads by): its lookup answers hits here or the prefetch signal, and a
  prefetch writes the blocks below as files here. Without `block_bytes` there is no facet and
  the base lookup and load above serve every block, from here or from below.
`touch` is not passed down (retention below is that tier's own), as in the cache tier.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import pathlib
import stat
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ninfer_jax.store import posix_files as files
from ninfer_jax.store.base import Prefetchable, Store, TokenAddressed
from ninfer_jax.store.config import get_int, get_str, reject_unknown, require_mapping
from ninfer_jax.store.errors import InvalidParam, OsApiError
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.lower import LowerTier
from ninfer_jax.store.posix_prefetch import PosixPrefetch
from ninfer_jax.store.transfer import TransferPool
from ninfer_jax.store.types import BlockId, BlockPayload, IoResult, JobDescriptor

_log = logging.getLogger(__name__)
_FIELDS = ("root", "num_threads", "block_bytes", "piped_lower_store")
MAX_VERIFIED = 1 << 16  # remembered verifications (oldest forgotten first)
SETTLE_NS = 2_000_000_000  # a file's timestamps must be this old for its check to be remembered


class PosixStore(Store):
    name = "posix"

    def __init__(self) -> None:
        self.life = Lifecycle("posix")

    def setup(self, config: Mapping[str, Any]) -> None:
        self.life.require_new("setup")
        config = require_mapping(config, "posix")
        reject_unknown(config, _FIELDS, "posix")
        self.root = pathlib.Path(get_str(config, "root", "posix"))
        num_threads = get_int(config, "num_threads", "posix", default=4, minimum=1)
        self.block_bytes = (None if config.get("block_bytes") is None
                            else get_int(config, "block_bytes", "posix", minimum=1))
        self._lower = LowerTier.from_config(config, "posix")
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        self._quarantine = self.root / "quarantine"
        for directory in (self._blocks, self._tmp, self._quarantine):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OsApiError(f"posix: cannot create directory {directory}: {e}") from e
        self._owner = files.TempOwner(self._tmp)
        try:
            files.clear_stale_temps(self._tmp)
        except OsApiError:
            self._owner.release()
            raise
        self._quarantine_numbers = itertools.count()
        self._quarantined = 0  # entries this store moved to quarantine/
        self._verified: collections.OrderedDict[BlockId, files.Identity] = (
            collections.OrderedDict())
        self._verified_lock = threading.Lock()
        self._jobs = JobTable("posix")
        self._pool = TransferPool("posix", num_threads)
        self._prefetch = None
        if self._lower is not None and self.block_bytes is not None:
            self._prefetch = PosixPrefetch(self.life, self._lower, self._jobs, self._pool,
                                           self.block_bytes, self._present, self._write)
        self.life.open()

    @while_open
    def as_token_addressed(self) -> TokenAddressed | None:
        return None

    @while_open
    def as_prefetchable(self) -> Prefetchable | None:
        return self._prefetch

    @while_open
    def path_of(self, block_id: BlockId) -> pathlib.Path:
        return self._path(block_id)

    @while_open
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        """Hits are verified block files, or blocks the tier below reports (if there is one);
        a permission or I/O failure, here or below, raises OsApiError."""
        hits = [self._present(block_id) for block_id in ids]
        if self._lower is None:
            return hits
        below = iter(self._lower.lookup([b for b, hit in zip(ids, hits) if not hit]))
        return [hit or next(below) for hit in hits]

    @while_open
    def lookup_here(self, ids: Sequence[BlockId]) -> list[bool]:
        """Hits among this tier's own files only (not the tiers below)."""
        return [self._present(block_id) for block_id in ids]

    @while_open
    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None) -> None:
        """No retention here: blocks stay until deleted."""
        del ids, ttl_ms

    @while_open
    def load(self, job_id: int, job: JobDescriptor) -> None:
        """Reads files here; with a tier below, blocks missing here are read from it."""
        self._check_sizes(job)
        self._jobs.accept(job_id)
        self._pool.start(self._jobs, job_id, job.prerequisite,
                         lambda: self._load(job.block_ids, job.payloads))

    @while_open
    def dump(self, job_id: int, job: JobDescriptor) -> None:
        """Writes through to the tier below (if any), then writes the files here."""
        self._check_sizes(job)
        self._jobs.accept(job_id)
        self._pool.start(self._jobs, job_id, job.prerequisite,
                         lambda: self._dump(job.block_ids, job.payloads))

    def get_finished(self) -> list[IoResult]:
        self.life.require_set_up("get_finished")
        return self._jobs.get_finished()

    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        self.life.require_set_up("wait")
        return self._jobs.wait(job_ids)

    def close(self) -> None:
        """Refuses new calls, cancels jobs not yet moving bytes, waits for the rest; idempotent."""
        if self.life.close():
            self._pool.close()
            self._owner.release()

    @while_open
    def quarantined(self) -> list[pathlib.Path]:
        return sorted(self._quarantine.iterdir())

    @property
    def quarantine_count(self) -> int:
        """How many block files this store moved to quarantine/ (each also logged)."""
        return self._quarantined

    # -- jobs -------------------------------------------------------------------------------------
    def _check_sizes(self, job: JobDescriptor) -> None:
        if self.block_bytes is None:
            return
        for block_id, payload in zip(job.block_ids, job.payloads):
            if payload.nbytes != self.block_bytes:
                raise InvalidParam(f"posix: payload of block {block_id.hex()} has "
                                   f"{payload.nbytes} bytes, block_bytes is {self.block_bytes}")

    def _load(self, ids: list[BlockId], payloads: list[BlockPayload]) -> bool:
        if self._lower is None:
            return all(self._read(b, p) for b, p in zip(ids, payloads))
        missing = [i for i, (b, p) in enumerate(zip(ids, payloads)) if not self._read(b, p)]
        if not missing:
            return True
        ids, payloads = [ids[i] for i in missing], [payloads[i] for i in missing]
        if not self._lower.load(ids, payloads, pinned=False):
            return False
        for block_id, payload in zip(ids, payloads):
            try:
                self._write(block_id, payload)
            except OsApiError as e:
                _log.warning("posix: block %s was read from the tier below but not stored "
                             "here: %s", block_id.hex(), e)
        return True

    def _dump(self, ids: list[BlockId], payloads: list[BlockPayload]) -> bool:
        if self._lower is not None and not self._lower.dump(ids, payloads):
            return False
        return all(self._write(b, p) for b, p in zip(ids, payloads))

    # -- verification memory --------------------------------------------------------------------
    def _is_verified(self, block_id: BlockId, ident: files.Identity) -> bool:
        with self._verified_lock:
            return self._verified.get(block_id) == ident

    def _remember(self, block_id: BlockId, ident: files.Identity) -> None:
        """Records a verification, unless the file changed too recently to be told apart.

        File timestamps are coarse (a clock tick, or a second on some filesystems), so a file
        rewritten in place right after it was verified could keep its identity; like git's
        "racily clean" rule, only files unchanged for SETTLE_NS are remembered.
        """
        if time.time_ns() - max(ident[3], ident[4]) < SETTLE_NS:
            return
        with self._verified_lock:
            self._verified[block_id] = ident
            self._verified.move_to_end(block_id)
            if len(self._verified) > MAX_VERIFIED:
                self._verified.popitem(last=False)

    def _forget(self, block_id: BlockId) -> None:
        with self._verified_lock:
            self._verified.pop(block_id, None)

    # -- file I/O (unguarded: transfers under way when close() begins run to their end) ------
    def _path(self, block_id: BlockId) -> pathlib.Path:
        name = block_id.hex()
        return self._blocks / name[:2] / f"{name}.blk"

    @contextlib.contextmanager
    def _block_dir(self, block_id: BlockId) -> Iterator[int | None]:
        fd = files.open_dir(self._blocks / block_id.hex()[:2])
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def _present(self, block_id: BlockId) -> bool:
        name, path = f"{block_id.hex()}.blk", self._path(block_id)
        with self._block_dir(block_id) as dir_fd:
            if dir_fd is None:
                return False
            st = files.stat_entry(dir_fd, name, path)
            if st is None:
                return False
            if stat.S_ISREG(st.st_mode) and self._is_verified(block_id, files.identity(st)):
                return True
            fd = self._open(dir_fd, block_id)
            if fd is None:
                return False
            try:
                ident = files.identity(os.fstat(fd))
                ok = files.verify(fd, block_id)
            finally:
                os.close(fd)
            if ok:
                self._remember(block_id, ident)
            else:
                self._quarantine_entry(dir_fd, block_id, ident, "failed verification")
            return ok

    def _open(self, dir_fd: int, block_id: BlockId) -> int | None:
        """The block's file opened for reading; None if absent or foreign (then quarantined)."""
        try:
            return files.open_block(dir_fd, f"{block_id.hex()}.blk", self._path(block_id))
        except files.Foreign as e:
            self._quarantine_entry(dir_fd, block_id, e.identity, f"is a {e.kind}")
            return None

    def _quarantine_entry(self, dir_fd: int, block_id: BlockId, ident: files.Identity,
                          why: str) -> None:
        self._forget(block_id)
        name = f"{block_id.hex()}.blk"
        dest = self._quarantine / f"{name}.{self._owner.name}.{next(self._quarantine_numbers)}"
        if files.quarantine(dir_fd, name, self._path(block_id), ident, dest):
            with self._verified_lock:
                self._quarantined += 1
            _log.warning("posix: block file %s %s; moved to %s (a miss)", self._path(block_id),
                         why, dest)

    def _read(self, block_id: BlockId, payload: BlockPayload) -> bool:
        views = payload.views()
        with self._block_dir(block_id) as dir_fd:
            if dir_fd is None:
                return False
            fd = self._open(dir_fd, block_id)
            if fd is None:
                return False
            try:
                ident = files.identity(os.fstat(fd))
                header = files.read_header(fd, block_id)
                if header is None:
                    self._quarantine_entry(dir_fd, block_id, ident, "has a bad header or length")
                    return False
                length, crc = header
                if sum(v.nbytes for v in views) != length:
                    raise InvalidParam(f"posix: block {block_id.hex()} has {length} bytes, the "
                                       f"destination {sum(v.nbytes for v in views)}")
                actual = files.read_data(fd, views)
            finally:
                os.close(fd)
            if actual != crc:
                self._quarantine_entry(dir_fd, block_id, ident, "failed its checksum")
                return False
            self._remember(block_id, ident)
            return True

    def _write(self, block_id: BlockId, payload: BlockPayload) -> bool:
        views = payload.views()
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        header = files.HEADER.pack(files.MAGIC, files.VERSION, 0, sum(v.nbytes for v in views),
                                   crc, block_id.bytes)
        name, final = f"{block_id.hex()}.blk", self._path(block_id)
        tmp = self._owner.temp_path()
        try:
            dir_fd = files.make_dir(final.parent)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                try:
                    for chunk in [memoryview(header), *views]:
                        while chunk.nbytes:
                            chunk = chunk[os.write(fd, chunk):]
                    os.fsync(fd)
                    existing = files.stat_entry(dir_fd, name, final)
                    if existing is not None and not stat.S_ISREG(existing.st_mode):
                        self._quarantine_entry(dir_fd, block_id, files.identity(existing),
                                               "is not a regular file")
                    os.replace(tmp, name, dst_dir_fd=dir_fd)
                    os.fsync(dir_fd)
                finally:
                    os.close(fd)
            finally:
                os.close(dir_fd)
        except OsApiError:
            tmp.unlink(missing_ok=True)
            raise
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise OsApiError(f"posix: writing block {block_id.hex()} to {final} failed: "
                             f"{e}") from e
        return True
