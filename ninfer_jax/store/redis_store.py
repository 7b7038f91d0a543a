"""The `redis` store: one checksummed value per block on a Redis server (the remote tier).

Config: `url` (required: `redis://host:port/db`, or `rediss://`, `unix://`), `key_prefix`
(default `ninfer:blk:`; a block's key is the prefix plus its id in hex), `ttl_ms` (each stored
block expires this long after its dump; absent or None: never), `num_threads` (transfer threads,
default 4) and `socket_timeout_s` (bounds every connect and every reply, default 5.0). `setup`
connects and PINGs: a server it cannot reach is OsApiError naming the url (a password masked).

Value: a 60-byte header (magic b"NIB1", the 16-byte block id, u64 LE data length, the 32-byte
blake2b digest of the data) followed by the data, the payload's buffers concatenated.

Untokened, like posix: a successful dump is its commit (one SET per block, with PX when `ttl_ms`
is set; a job's blocks are pipelined), and there is no pin and no prefetch facet. This store
evicts nothing itself but the server does (`ttl_ms`, its maxmemory policy), so a hit is a hint
until the load. Lookup is one pipelined EXISTS per id and reads no data: a corrupted value is
still a hit; the load of it then fails. A load verifies magic, id, length (which must equal the
destination's size) and digest before copying a block into its destination: any mismatch, a
missing key (expired or evicted since the lookup) or a server error completes the job with
success=False, and a block that failed never touches its destination. A value that fails
verification for any reason but a size mismatch is deleted, but only while the server still
holds those exact bytes (a concurrent good rewrite survives), so the next lookup misses.
Blocks are content-addressed (G1): concurrent dumps of one id are last-writer-wins over identical
content, and several stores, in one process or many, may share a server and prefix. `touch`
extends (never shortens) the expiry of blocks that have one.

Errors (G15): a lookup or touch the server cannot answer is OsApiError naming the url. A lost
connection is retried once at once, a timeout is not retried: no call waits on the server
longer than about socket_timeout_s (twice that across a reconnect).
"""

from __future__ import annotations

import hashlib
import logging
import re
import struct
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ninfer_jax.store.base import Prefetchable, Store, TokenAddressed
from ninfer_jax.store.config import (
    get_float,
    get_int,
    get_str,
    reject_unknown,
    require_mapping,
)
from ninfer_jax.store.errors import General, InvalidParam, OsApiError, StoreError
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.transfer import TransferPool, gather, scatter
from ninfer_jax.store.types import BlockId, IoResult, JobDescriptor, as_block_ids

_log = logging.getLogger(__name__)
_FIELDS = ("url", "key_prefix", "ttl_ms", "num_threads", "socket_timeout_s")
DEFAULT_PREFIX = "ninfer:blk:"
MAGIC = b"NIB1"
HEADER = struct.Struct("<4s16sQ32s")  # magic, block id, data length, blake2b-256 of the data
PIPELINE_BYTES = 8 << 20  # a job's blocks go to the server in pipelines of about this size
# Deletes KEYS[1] only while it holds the value whose sha1 is ARGV[1].
_DROP_IF_SAME = """local value = redis.call('GET', KEYS[1])
if value and redis.sha1hex(value) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0"""
# Raises each key's expiry to ARGV[1] ms; keys without an expiry, or with a later one, keep it.
_EXTEND = """local ms = tonumber(ARGV[1])
for _, key in ipairs(KEYS) do
  local left = redis.call('PTTL', key)
  if left >= 0 and left < ms then redis.call('PEXPIRE', key, ms) end
end
return 0"""

Views = list[memoryview]


def digest(views: Sequence[memoryview]) -> bytes:
    hasher = hashlib.blake2b(digest_size=32)
    for view in views:
        hasher.update(view)
    return hasher.digest()


def encode_value(block_id: BlockId, views: Sequence[memoryview]) -> bytearray:
    """Header + data of one block, ready to SET."""
    length = sum(v.nbytes for v in views)
    value = bytearray(HEADER.size + length)
    data = memoryview(value)[HEADER.size:]
    gather(views, np.frombuffer(data, np.uint8))
    HEADER.pack_into(value, 0, MAGIC, block_id.bytes, length, digest([data]))
    return value


def check_value(block_id: BlockId, raw: bytes | None, nbytes: int) -> tuple[str, bool] | None:
    """None if `raw` is block `block_id` with `nbytes` data bytes, else (why not, corrupt)."""
    if raw is None:
        return "no such key (expired, evicted or never stored)", False
    if len(raw) < HEADER.size:
        return f"value of {len(raw)} bytes is shorter than the {HEADER.size}-byte header", True
    magic, id_bytes, length, expected = HEADER.unpack_from(raw)
    if magic != MAGIC:
        return f"bad magic {magic!r}", True
    if id_bytes != block_id.bytes:
        return f"header names block {id_bytes.hex()}", True
    if len(raw) - HEADER.size != length:
        return f"header says {length} data bytes, the value holds {len(raw) - HEADER.size}", True
    if digest([memoryview(raw)[HEADER.size:]]) != expected:
        return "data digest mismatch", True
    if length != nbytes:
        return f"block has {length} bytes, the destination {nbytes}", False
    return None


def masked_url(url: str) -> str:
    """`url` with any password replaced by ***, for messages and logs."""
    url = re.sub(r"(password=)[^&]*", r"\1***", url)
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _chunks(ids: Sequence[BlockId],
            views: Sequence[Views]) -> Iterator[list[tuple[BlockId, Views]]]:
    chunk: list[tuple[BlockId, Views]] = []
    size = 0
    for block_id, block_views in zip(ids, views):
        chunk.append((block_id, block_views))
        size += sum(v.nbytes for v in block_views)
        if size >= PIPELINE_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class RedisStore(Store):
    name = "redis"

    def __init__(self) -> None:
        self.life = Lifecycle("redis")

    def setup(self, config: Mapping[str, Any]) -> None:
        self.life.require_new("setup")
        config = require_mapping(config, "redis")
        if "piped_lower_store" in config:
            raise InvalidParam("redis: must be the last tier of a pipe (it has no tier below "
                               "to write through to)")
        reject_unknown(config, _FIELDS, "redis")
        url = get_str(config, "url", "redis")
        self._prefix = get_str(config, "key_prefix", "redis", default=DEFAULT_PREFIX).encode()
        self._ttl_ms = (None if config.get("ttl_ms") is None
                        else get_int(config, "ttl_ms", "redis", minimum=1))
        num_threads = get_int(config, "num_threads", "redis", default=4, minimum=1)
        timeout_s = get_float(config, "socket_timeout_s", "redis", default=5.0, above=0.0)
        self.url = masked_url(url)
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 1, (redis.ConnectionError,)))
        except (ValueError, TypeError) as e:
            raise InvalidParam(f"redis: config field 'url' is not a Redis url "
                               f"({self.url}): {e}") from e
        try:
            self._client.ping()
            self._drop_if_same = self._client.register_script(_DROP_IF_SAME)
            self._extend = self._client.register_script(_EXTEND)
        except redis.RedisError as e:
            self._client.close()
            raise self._error("PING", e) from e
        self._jobs = JobTable("redis")
        self._pool = TransferPool("redis", num_threads)
        self.life.open()

    @while_open
    def as_token_addressed(self) -> TokenAddressed | None:
        return None

    @while_open
    def as_prefetchable(self) -> Prefetchable | None:
        return None

    @while_open
    def key_of(self, block_id: BlockId) -> bytes:
        """The server key holding `block_id`."""
        return self._key(block_id)

    @while_open
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        """Keys present on the server (not verified: see the module docstring)."""
        ids = as_block_ids(ids)
        if not ids:
            return []
        pipe = self._client.pipeline(transaction=False)
        for block_id in ids:
            pipe.exists(self._key(block_id))
        try:
            counts = pipe.execute()
        except redis.RedisError as e:
            raise self._error(f"lookup of {len(ids)} block(s)", e) from e
        return [bool(n) for n in counts]

    @while_open
    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None) -> None:
        """Raises the expiry of blocks that have one to `ttl_ms` (else the store's ttl_ms)."""
        ids = as_block_ids(ids)
        if ttl_ms is not None and (isinstance(ttl_ms, bool) or not isinstance(ttl_ms, int)
                                   or ttl_ms < 0):
            raise InvalidParam(f"redis: touch ttl_ms must be a non-negative int or None, "
                               f"got {ttl_ms!r}")
        ms = self._ttl_ms if ttl_ms is None else ttl_ms
        if ms is None or not ids:
            return
        try:
            self._extend(keys=[self._key(b) for b in ids], args=[ms])
        except redis.RedisError as e:
            raise self._error(f"touch of {len(ids)} block(s)", e) from e

    @while_open
    def load(self, job_id: int, job: JobDescriptor) -> None:
        views = self._views(job, writable=True)
        self._start(job_id, job, "load", lambda: self._read(job.block_ids, views))

    @while_open
    def dump(self, job_id: int, job: JobDescriptor) -> None:
        views = self._views(job, writable=False)
        self._start(job_id, job, "dump", lambda: self._write(job.block_ids, views))

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
            self._client.close()

    # -- transfers (unguarded: those under way when close() begins run to their end) ----------
    def _key(self, block_id: BlockId) -> bytes:
        return self._prefix + block_id.hex().encode()

    def _error(self, what: str, e: redis.RedisError) -> StoreError:
        cls = OsApiError if isinstance(e, (redis.ConnectionError, redis.TimeoutError)) else General
        return cls(f"redis: {what} on {self.url} failed: {type(e).__name__}: {e}")

    @staticmethod
    def _views(job: JobDescriptor, writable: bool) -> list[Views]:
        """Each payload's byte views, checked at submit so a bad buffer is the caller's error."""
        views = [payload.views() for payload in job.payloads]
        for block_id, block_views in zip(job.block_ids, views):
            if writable and any(v.readonly for v in block_views):
                raise InvalidParam(f"redis: load destination of block {block_id.hex()} is "
                                   "read-only")
        return views

    def _start(self, job_id: int, job: JobDescriptor, kind: str, work: Callable[[], bool]) -> None:
        def guarded() -> bool:
            try:
                return work()
            except redis.RedisError as e:
                _log.warning("%s", self._error(f"{kind} job {job_id}", e))
                return False

        self._jobs.accept(job_id)
        self._pool.start(self._jobs, job_id, job.prerequisite, guarded)

    def _write(self, ids: Sequence[BlockId], views: Sequence[Views]) -> bool:
        for chunk in _chunks(ids, views):
            pipe = self._client.pipeline(transaction=False)
            for block_id, block_views in chunk:
                pipe.set(self._key(block_id), encode_value(block_id, block_views),
                         px=self._ttl_ms)
            pipe.execute()
        return True

    def _read(self, ids: Sequence[BlockId], views: Sequence[Views]) -> bool:
        for chunk in _chunks(ids, views):
            pipe = self._client.pipeline(transaction=False)
            for block_id, _ in chunk:
                pipe.get(self._key(block_id))
            for (block_id, block_views), raw in zip(chunk, pipe.execute()):
                if not self._copy_out(block_id, raw, block_views):
                    return False
        return True

    def _copy_out(self, block_id: BlockId, raw: bytes | None, views: Views) -> bool:
        """Verifies `raw` whole, then copies it into `views`; a bad value is dropped."""
        problem = check_value(block_id, raw, sum(v.nbytes for v in views))
        if problem is None:
            scatter(np.frombuffer(memoryview(raw)[HEADER.size:], np.uint8), views)
            return True
        why, corrupt = problem
        key = self._key(block_id)
        _log.warning("redis: load of block %s (key %r on %s) failed: %s", block_id.hex(), key,
                     self.url, why)
        if corrupt:
            self._drop_if_same(keys=[key], args=[hashlib.sha1(raw).hexdigest()])
        return False
