"""The `posix` store: one checksummed file per block under a root directory.

Config: `root` (directory, created if absent), `num_threads` (transfer threads, default 4).

Layout: `root/blocks/<hh>/<hex>.blk` (committed blocks, fanned out by the id's first byte),
`root/tmp/` (writes in progress; cleared at setup, so a crash leaves no trace), and
`root/quarantine/` (files that failed verification). A file is a 36-byte header (magic, version,
data length, crc32 of the data, the block id) followed by the data.

Crash safety: a dump writes a uniquely named temp file, fsyncs it, renames it over the final name
and fsyncs the directory, so a reader sees either no file or a complete one (never torn), and a
restart finds every block whose rename happened. A file that is truncated, has a foreign id or a
wrong checksum is a miss: it is moved to quarantine and never returned as data.
This store is untokened: a successful dump is its commit (the rename), and it never evicts.
Life (lifecycle.py): after `close()` every call but `wait`/`get_finished` raises InvalidParam.
"""

from __future__ import annotations

import os
import pathlib
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.store.base import Prefetchable, Store, TokenAddressed
from ninfer_jax.store.config import get_int, get_str, require_mapping
from ninfer_jax.store.errors import InvalidParam, OsApiError
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.transfer import TransferPool
from ninfer_jax.store.types import BlockId, BlockPayload, IoResult, JobDescriptor

_HEADER = struct.Struct("<4sHHQI16s")
_MAGIC = b"NJSB"
_VERSION = 1


class PosixStore(Store):
    name = "posix"

    def __init__(self) -> None:
        self.life = Lifecycle("posix")

    def setup(self, config: Mapping[str, Any]) -> None:
        self.life.require_new("setup")
        config = require_mapping(config, "posix")
        if "piped_lower_store" in config:
            raise InvalidParam("posix: must be the last tier of a pipe (it has no tier below "
                               "to write through to)")
        unknown = sorted(set(config) - {"root", "num_threads"})
        if unknown:
            raise InvalidParam(f"posix: unknown config field(s) {unknown}; known: "
                               "['num_threads', 'root']")
        self.root = pathlib.Path(get_str(config, "root", "posix"))
        num_threads = get_int(config, "num_threads", "posix", default=4, minimum=1)
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        self._quarantine = self.root / "quarantine"
        for directory in (self._blocks, self._tmp, self._quarantine):
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise OsApiError(f"posix: cannot create directory {directory}: {e}") from e
        try:
            for leftover in self._tmp.iterdir():
                leftover.unlink()
        except OSError as e:
            raise OsApiError(f"posix: cannot clear {self._tmp}: {e}") from e
        self._jobs = JobTable("posix")
        self._pool = TransferPool("posix", num_threads)
        self._quarantine_lock = threading.Lock()
        self.life.open()

    @while_open
    def as_token_addressed(self) -> TokenAddressed | None:
        return None

    @while_open
    def as_prefetchable(self) -> Prefetchable | None:
        return None

    @while_open
    def path_of(self, block_id: BlockId) -> pathlib.Path:
        return self._path(block_id)

    def _path(self, block_id: BlockId) -> pathlib.Path:
        """Unguarded: transfers under way when close() begins run to their end."""
        name = block_id.hex()
        return self._blocks / name[:2] / f"{name}.blk"

    @while_open
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        """A hit needs a file whose header names the id and whose length matches the header."""
        return [self._header_ok(block_id) for block_id in ids]

    @while_open
    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None) -> None:
        """No retention here: blocks stay until deleted."""
        del ids, ttl_ms

    @while_open
    def load(self, job_id: int, job: JobDescriptor) -> None:
        self._jobs.accept(job_id)
        self._pool.start(self._jobs, job_id, job.prerequisite,
                         lambda: all(self._read(b, p) for b, p in zip(job.block_ids, job.payloads)))

    @while_open
    def dump(self, job_id: int, job: JobDescriptor) -> None:
        self._jobs.accept(job_id)
        self._pool.start(self._jobs, job_id, job.prerequisite,
                         lambda: all(self._write(b, p) for b, p in zip(job.block_ids, job.payloads)))

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

    @while_open
    def quarantined(self) -> list[pathlib.Path]:
        return sorted(self._quarantine.iterdir())

    # -- file I/O on pool threads ---------------------------------------------------------------
    def _write(self, block_id: BlockId, payload: BlockPayload) -> bool:
        views = payload.views()
        crc = 0
        for view in views:
            crc = zlib.crc32(view, crc)
        header = _HEADER.pack(_MAGIC, _VERSION, 0, sum(v.nbytes for v in views), crc,
                              block_id.bytes)
        final = self._path(block_id)
        tmp = self._tmp / f"{block_id.hex()}.{uuid.uuid4().hex}.tmp"
        try:
            final.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for chunk in [memoryview(header), *views]:
                    while chunk.nbytes:
                        chunk = chunk[os.write(fd, chunk):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            _fsync_dir(final.parent)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _read(self, block_id: BlockId, payload: BlockPayload) -> bool:
        views = payload.views()
        path = self._path(block_id)
        try:
            f = open(path, "rb", buffering=0)
        except FileNotFoundError:
            return False
        with f:
            header = self._parse_header(f.read(_HEADER.size), block_id)
            if header is None or os.fstat(f.fileno()).st_size != _HEADER.size + header[0]:
                self._quarantine_file(path)
                return False
            length, crc = header
            if sum(v.nbytes for v in views) != length:
                raise InvalidParam(f"posix: block {block_id.hex()} has {length} bytes, the "
                                   f"destination {sum(v.nbytes for v in views)}")
            actual = 0
            for view in views:
                got = f.readinto(view)
                if got != view.nbytes:
                    self._quarantine_file(path)
                    return False
                actual = zlib.crc32(view, actual)
        if actual != crc:
            self._quarantine_file(path)
            return False
        return True

    def _header_ok(self, block_id: BlockId) -> bool:
        path = self._path(block_id)
        try:
            with open(path, "rb", buffering=0) as f:
                header = self._parse_header(f.read(_HEADER.size), block_id)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return False
        if header is None or size != _HEADER.size + header[0]:
            self._quarantine_file(path)
            return False
        return True

    @staticmethod
    def _parse_header(raw: bytes, block_id: BlockId) -> tuple[int, int] | None:
        """(data length, crc32) of a well-formed header for `block_id`, else None."""
        if len(raw) != _HEADER.size:
            return None
        magic, version, _, length, crc, stored_id = _HEADER.unpack(raw)
        if magic != _MAGIC or version != _VERSION or stored_id != block_id.bytes:
            return None
        return length, crc

    def _quarantine_file(self, path: pathlib.Path) -> None:
        with self._quarantine_lock:
            try:
                os.replace(path, self._quarantine / f"{path.stem}.{time.time_ns()}")
            except FileNotFoundError:
                pass


def _fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
