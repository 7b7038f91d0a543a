"""ContextTiers: the Engine's prefix checkpoints in the context store (DESIGN §7, §11).

Owns the store topology the Engine was opened with and three transitions of a checkpoint:
- offload: when a checkpoint is retained, the blocks the store lacks (`engine/blocks.py`) are
  copied to the host and written down the topology on the store's transfer threads; their
  completions are consumed by `poll` on later worker iterations, so decode never waits for a
  write;
- find: the longest stored prefix of a prompt, by lookups through the prefetch cycle (lookup ->
  prefetch signal -> prefetch -> lookup): the run of full K/V blocks bounds the candidate
  frontiers, the first state block of each says which were checkpointed, and the longest one
  whose every block is stored wins;
- reload: its blocks are read into host buffers on the store's transfer threads
  (`start_reload`; `poll` notes the read's end, so decode rounds go on meanwhile), then the
  state image's envelope is checked and the image handed back for the Program to import
  (`reload_result`); `abort_reload` revokes a read whose request was cancelled.
Any store failure, missing or corrupted block is a miss (counted, logged), never a wrong answer.
Runs on the Engine's worker thread only; imports no jax.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ninfer_jax.engine.blocks import BlockLayout, ImageError
from ninfer_jax.program.checkpoints import CheckpointId, CheckpointImage
from ninfer_jax.store import BlockId, BlockPayload, RequestContext, StoreError
from ninfer_jax.store.proxy.api import StoreNode

if TYPE_CHECKING:
    from ninfer_jax.program.host import HostProgram

log = logging.getLogger(__name__)
PREFETCH_ROUNDS = 3  # lookup -> prefetch rounds before a lookup that still signals is a miss


@dataclasses.dataclass(frozen=True)
class TierStats:
    """Counters of the context store, published in `EngineStats.tiers`."""

    tiers: tuple[str, ...]  # the topology's stores, head first (empty: no context store)
    offloads: int = 0  # checkpoints whose missing blocks were written
    blocks_written: int = 0
    bytes_written: int = 0
    pending_writes: int = 0  # write jobs not yet completed
    pending_reads: int = 0  # reads not yet concluded (a revoked one holds its blocks until its end)
    write_failures: int = 0
    lookups: int = 0  # prompts looked up after a device-catalog miss
    reloads: int = 0  # checkpoints reloaded into the device
    reloaded_tokens: int = 0
    bytes_loaded: int = 0
    reload_failures: int = 0  # found but not reloadable (a failed read, a bad image)
    store_errors: int = 0  # store calls that raised (each also a miss or a failed write)
    hits_by_tier: tuple[tuple[str, int], ...] = ()  # reloads by the highest tier holding them
    evictions_by_tier: tuple[tuple[str, int], ...] = ()  # blocks evicted by host-memory tiers
    # block files a disk tier found damaged or foreign and moved to its quarantine/ (a miss)
    quarantined_by_tier: tuple[tuple[str, int], ...] = ()
    reload_seconds: float = 0.0  # total, lookup to import
    last_reload_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class StoredPrefix:
    tokens: tuple[int, ...]  # the checkpoint's F tokens
    digest: bytes
    kv: list[BlockId]
    state: list[BlockId]
    tier: str

    @property
    def frontier(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(eq=False)
class Reload:
    """A read of a found checkpoint's blocks: in flight while `done` is None."""

    found: StoredPrefix
    rid: str
    job: int
    buffers: list[np.ndarray]
    started: float  # perf_counter at the lookup's start
    done: bool | None = None  # the read's success, once it ended
    aborted: bool = False


class ContextTiers:
    def __init__(self, node: StoreNode, layout: BlockLayout, tiers: list[Any],
                 ttl_ms: int | None = None):
        """`tiers`: the topology's stores, head first (for per-tier statistics only)."""
        self.node, self.layout, self.ttl_ms = node, layout, ttl_ms
        self._tiers = tiers
        self._names = tuple(getattr(t, "name", type(t).__name__) for t in tiers) or ("store",)
        self._requests = itertools.count()
        self._jobs = itertools.count()
        self._puts: dict[int, tuple[str, int, int]] = {}  # job -> (request, blocks, bytes)
        self._payloads: dict[int, list[BlockPayload]] = {}  # kept alive until completion
        self._gets: dict[int, Reload] = {}  # reads in flight or not yet concluded
        self._hits = {name: 0 for name in self._names}
        self._origins: dict[BlockId, int] = {}  # during a find: tier rank of prefetched ids
        self._stats = TierStats(self._names)

    # Offload -----------------------------------------------------------------------------------
    def offload(self, program: HostProgram, ckpt: CheckpointId, tokens: tuple[int, ...],
                scope: str | None) -> None:
        """Writes the blocks of checkpoint `ckpt` (of `tokens`) that the store lacks."""
        kv, state = self._ids(*self.layout.checkpoint_ids(tokens, scope))
        rid = self._open("put")
        try:
            hits = self.node.lookup(rid, kv + state)
            if hits is None:  # some are below the head only: the bottom tier holds them all
                hits = self._tiers[-1].lookup(kv + state) if self._tiers \
                    else [False] * (len(kv) + len(state))
            pages = [i for i, hit in enumerate(hits[: len(kv)]) if not hit]
            with_state = not all(hits[len(kv):])
            if not pages and not with_state:
                self._finish(rid)
                return
            image = program.export_checkpoint(ckpt, pages)
            ids = [kv[i] for i in pages]
            payloads = [BlockPayload([*image.pages[i],
                                      self.layout.tag(kv[i].bytes, image.pages[i])])
                        for i in pages]
            if with_state:
                digest = self.layout.prefix_digests(tokens, scope, [len(tokens)])[len(tokens)]
                sealed = self.layout.seal(image.state, len(tokens), digest)
                ids += state
                payloads += [BlockPayload([row]) for row in sealed]
            token = self.node.prepare_put(rid, ids)
            job = next(self._jobs)
            self.node.submit_put(job, payloads, token)
        except StoreError as e:
            self._error("offload", e)
            self._count(write_failures=1)
            self._finish(rid)
            return
        self._puts[job] = (rid, len(ids), len(ids) * self.layout.block_bytes)
        self._payloads[job] = payloads
        self._count(pending_writes=1)

    def poll(self) -> bool:
        """Concludes the writes that completed and notes the reads that ended; True if any."""
        if not self._puts and not self._gets:
            return False
        try:
            results = self.node.get_finished()
        except StoreError as e:
            self._error("poll", e)
            return False
        for result in results:
            reload = self._gets.get(result.job_id)
            if reload is None:
                self._conclude(result.job_id, result.success)
                continue
            reload.done = result.success
            if reload.aborted:
                self._end_get(reload)
        return bool(results)

    def _drain(self) -> None:
        """Waits for the writes in flight and concludes them."""
        if not self._puts:
            return
        try:
            results = self.node.wait(list(self._puts))
        except StoreError as e:
            self._error("wait", e)
            return
        for result in results:
            self._conclude(result.job_id, result.success)

    def _conclude(self, job: int, success: bool) -> None:
        put = self._puts.pop(job, None)
        self._payloads.pop(job, None)
        if put is None:
            log.warning("context store: completion of unknown job %d", job)
            return
        rid, blocks, nbytes = put
        try:
            self.node.complete_put(rid, success)
        except StoreError as e:
            self._error("complete_put", e)
            success = False
        self._finish(rid)
        if success:
            self._count(pending_writes=-1, offloads=1, blocks_written=blocks,
                        bytes_written=nbytes)
        else:
            self._count(pending_writes=-1, write_failures=1)

    # Find and reload ---------------------------------------------------------------------------
    def find(self, tokens, scope: str | None, above: int = 0) -> StoredPrefix | None:
        """The longest stored checkpoint of a prefix of `tokens` longer than `above` (and
        shorter than the prompt: its last token is always prefilled)."""
        tokens, ps = tuple(tokens), self.layout.page_size
        self._drain()  # this Engine's own writes in flight are not half-visible to its lookups
        self._count(lookups=1)
        self._origins = {}
        rid = self._open("find")
        try:
            full = self._ids(self.layout.full_ids(tokens, scope, len(tokens) - 1))[0]
            run = self._run_length(rid, full)
            frontiers = range(above + 1, min(len(tokens) - 1, (run + 1) * ps) + 1)
            if not frontiers:
                return None
            digests = self.layout.prefix_digests(tokens, scope, frontiers)
            firsts = [BlockId(self.layout.state_ids(digests[f], 1)[0]) for f in frontiers]
            hits = self._lookup(rid, firsts)
            for f in sorted((f for f, hit in zip(frontiers, hits) if hit), reverse=True):
                tail = BlockId(self.layout.tail_id(
                    tokens, f, [k.bytes for k in full], scope))
                kv = full[: (f - 1) // ps] + [tail]
                state = self._ids(self.layout.state_ids(digests[f]))[0]
                if all(self._lookup(rid, kv + state)):
                    return StoredPrefix(tokens[:f], digests[f], kv, state,
                                        self._tier(kv + state))
            return None
        except StoreError as e:
            self._error("find", e)
            return None
        finally:
            self._finish(rid)

    def start_reload(self, found: StoredPrefix, started: float) -> Reload | None:
        """Starts reading a found checkpoint's blocks; None (a miss) if the store refuses."""
        ids = found.kv + found.state
        buffers = [np.empty(self.layout.block_bytes, np.uint8) for _ in ids]
        rid = self._open("get")
        prepared = False
        try:
            token = self.node.prepare_get(rid, ids)
            prepared = True
            job = next(self._jobs)
            self.node.submit_get(job, [BlockPayload([b]) for b in buffers], token)
        except StoreError as e:
            self._error("reload", e)
            if prepared:
                self._complete_get(rid)
            self._finish(rid)
            self._count(reload_failures=1)
            return None
        reload = Reload(found, rid, job, buffers, started)
        self._gets[job] = reload
        return reload

    def reload_result(self, reload: Reload) -> CheckpointImage | None:
        """The image of a read that ended (`reload.done` set by `poll`), checked; None (a miss,
        counted) if the read failed or a block does not carry its tag."""
        if not self.read_ended(reload) or reload.aborted:
            raise ValueError(f"reload job {reload.job} is in flight or aborted")
        self._end_get(reload)
        found = reload.found
        if reload.done:
            kv = reload.buffers[: len(found.kv)]
            bad = [i for i, (b, block) in enumerate(zip(found.kv, kv))
                   if not self.layout.check(b.bytes, block)]
            try:
                if bad:
                    raise ImageError(f"K/V block(s) {bad} of frontier {found.frontier} do not "
                                     "carry their own tags")
                state = self.layout.open(np.stack(reload.buffers[len(found.kv):]),
                                         found.frontier, found.digest)
                self._count(bytes_loaded=len(reload.buffers) * self.layout.block_bytes)
                pages = [[block[: self.layout.page_bytes]] for block in kv]
                return CheckpointImage(found.tokens, pages, state)
            except ImageError as e:
                log.warning("context store: %s", e)
        self._count(reload_failures=1)
        return None

    def read_ended(self, reload: Reload) -> bool:
        """Whether the read ended (as the last `poll` saw it); then `reload_result` answers."""
        return reload.done is not None

    def abort_reload(self, reload: Reload) -> None:
        """Revokes a read (its request ended): its store request ends when the read does."""
        reload.aborted = True
        if reload.done is not None:
            self._end_get(reload)

    @property
    def reads_in_flight(self) -> int:
        return sum(r.done is None for r in self._gets.values())

    def _end_get(self, reload: Reload) -> None:
        if self._gets.pop(reload.job, None) is None:
            return
        self._complete_get(reload.rid)
        self._finish(reload.rid)

    def _complete_get(self, rid: str) -> None:
        try:
            self.node.complete_get(rid)
        except StoreError as e:
            self._error("complete_get", e)

    def record_reload(self, found: StoredPrefix, seconds: float) -> None:
        self._hits[found.tier] = self._hits.get(found.tier, 0) + 1
        self._count(reloads=1, reloaded_tokens=found.frontier, reload_seconds=seconds)
        self._stats = dataclasses.replace(self._stats, last_reload_seconds=seconds,
                                          hits_by_tier=tuple(self._hits.items()))

    # Life and statistics -----------------------------------------------------------------------
    @property
    def outlives_process(self) -> bool:
        """Whether some tier keeps blocks after the process ends (disk, Redis: any but the
        host-memory ones)."""
        return any(not hasattr(tier, "buffer") for tier in self._tiers)

    def stats(self) -> TierStats:
        evictions = tuple((name, tier.buffer.evictions) for name, tier in
                          zip(self._names, self._tiers) if hasattr(tier, "buffer"))
        quarantined = tuple((name, tier.quarantine_count) for name, tier in
                            zip(self._names, self._tiers) if hasattr(tier, "quarantine_count"))
        return dataclasses.replace(self._stats, evictions_by_tier=evictions,
                                   quarantined_by_tier=quarantined,
                                   pending_reads=len(self._gets))

    def close(self, timeout_s: float = 60.0) -> None:
        """Waits for the writes in flight (so a clean shutdown leaves them stored) and the reads
        (revoked), then closes the topology."""
        for reload in list(self._gets.values()):
            self.abort_reload(reload)
        deadline = time.monotonic() + timeout_s
        while (self._puts or self._gets) and time.monotonic() < deadline:
            if not self.poll():
                time.sleep(0.005)
        self.node.close()

    # Internals ---------------------------------------------------------------------------------
    @staticmethod
    def _ids(*groups: list[bytes]) -> tuple[list[BlockId], ...]:
        return tuple([BlockId(raw) for raw in group] for group in groups)

    def _open(self, kind: str) -> str:
        rid = f"{kind}-{next(self._requests)}"
        self.node.on_new_request(RequestContext(rid, ttl_ms=self.ttl_ms))
        return rid

    def _finish(self, rid: str) -> None:
        try:
            self.node.on_request_finished(rid)
        except StoreError as e:
            self._error("finish", e)

    def _lookup(self, rid: str, ids: list[BlockId], prefix: bool = False):
        """Hits of `ids` through the prefetch cycle (with `prefix`: the index of the last hit
        of the run of hits from the first); a lookup that keeps signalling is a miss."""
        for _ in range(PREFETCH_ROUNDS):
            hits = self.node.lookup_on_prefix(rid, ids) if prefix else self.node.lookup(rid, ids)
            if hits is not None:
                return hits
            if len(self._tiers) > 1:
                self._note_origins(ids)
            plan = self.node.prepare_prefetch(rid)
            job, ok = next(self._jobs), False
            try:
                self.node.submit_prefetch(job, plan)
                ok = self.node.wait([job])[0].success
            finally:
                self.node.complete_prefetch(rid, ok)
        return -1 if prefix else [False] * len(ids)

    def _run_length(self, rid: str, ids: list[BlockId]) -> int:
        """How many of `ids`, from the first, are stored."""
        return self._lookup(rid, ids, prefix=True) + 1 if ids else 0

    def _note_origins(self, ids: list[BlockId]) -> None:
        """Before a prefetch moves them up: the highest tier holding each missing id itself
        (a middle tier's plain lookup also reports the tiers below it)."""
        try:
            missing = list(ids)
            for rank, tier in enumerate(self._tiers):
                if not missing:
                    break
                probe = getattr(tier, "lookup_here", tier.lookup)
                hits = probe(missing)
                self._origins.update({b: rank for b, hit in zip(missing, hits) if hit and rank})
                missing = [b for b, hit in zip(missing, hits) if not hit]
        except StoreError as e:  # statistics only
            log.debug("context store: tier probe failed: %s", e)

    def _tier(self, ids: list[BlockId]) -> str:
        """The slowest tier the blocks of a reload came from (the head if none was below)."""
        if not self._names:
            return "store"
        return self._names[max((self._origins.get(b, 0) for b in ids), default=0)]

    def _count(self, **deltas: float) -> None:
        self._stats = dataclasses.replace(
            self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()})

    def _error(self, where: str, error: Exception) -> None:
        log.warning("context store: %s failed: %s", where, error)
        self._count(store_errors=1)
