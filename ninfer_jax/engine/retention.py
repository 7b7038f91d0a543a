"""Retention: which prefixes the Engine keeps as checkpoints, and their copies in the store.

Worker-owned (DESIGN §7). Decides and performs the checkpoint transitions of the Engine's
requests: CAPTURE of a sequence's frontier into a cataloged checkpoint (evicting the least
recently used one for a slot), DELETE of an inactive one (sent to the context store first when
it is not there yet), PLACE of an image read back from the store. Owns the checkpoints retained
but not yet written to the store, and the reads of a longer prefix started before a request's
admission (a `tiers.Reload`, concluded here). The catalog itself (prefix index, SessionIndex)
is the ResourceManager's; the Program owns the checkpoints' pages and slots.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ninfer_jax.engine.catalog import CatalogEntry, CheckpointCatalog
from ninfer_jax.engine.events import InvariantError
from ninfer_jax.engine.request import RequestRecord
from ninfer_jax.engine.resources import ResourceManager
from ninfer_jax.engine.tiers import ContextTiers, Reload
from ninfer_jax.engine.transactions import Transition
from ninfer_jax.frontend.media import identity_of
from ninfer_jax.program.host import HostProgram


class Retention:
    def __init__(self, program: HostProgram, resources: ResourceManager,
                 tiers: ContextTiers | None, reuse: bool):
        """`reuse`: the Engine keeps checkpoints at all (prefix reuse on, checkpoint slots);
        `tiers`: the context store behind the device, or None."""
        self.program, self.resources, self.tiers, self.reuse = program, resources, tiers, reuse
        self._to_offload: list[CatalogEntry] = []  # retained, not yet sent to the store

    @property
    def catalog(self) -> CheckpointCatalog:
        return self.resources.catalog

    @property
    def writes_pending(self) -> bool:
        """Retained checkpoints wait to be sent to the store (after this iteration's output)."""
        return bool(self._to_offload)

    @property
    def reads_in_flight(self) -> bool:
        return self.tiers is not None and bool(self.tiers.reads_in_flight)

    # Device checkpoints ----------------------------------------------------------------------
    def retain(self, r: RequestRecord, tokens: Sequence[int] | None = None,
               publication: bool = False) -> CatalogEntry | None:
        """Checkpoints a sequence at its committed frontier unless that prefix is cataloged;
        evicts the least recently used checkpoint for a slot. None when nothing is kept.
        `tokens`: the frontier's tokens (default: all but the last, whose effect is not in the
        state yet). `publication`: the turn's checkpoint, into the slot reserved at
        activation when the request holds one (an unused one is freed with the sequence)."""
        if not (self.reuse and r.reuse):
            return None
        if tokens is None:
            tokens = self.program.tokens(r.seq)[:-1]
        tokens = identity_of(tokens, r.prompt.identity_ids, len(tokens))  # what lookup compares
        if len(tokens) != self.program.frontier(r.seq):
            raise InvariantError(f"request {r.request_id}: retain of {len(tokens)} tokens at "
                                 f"frontier {self.program.frontier(r.seq)}")
        existing = self.catalog.get(tokens, r.cache_scope)
        if existing is not None:
            self.catalog.touch(existing)  # reached again: the last to evict
            return existing
        reserved = publication and self.program.has_publication_slot(r.seq)
        if not reserved and not self.program.can_capture():
            victim = self.catalog.least_recent()
            if victim is None:
                return None
            self.drop(victim, evicted=True)
        txn = self.resources.begin(Transition.CAPTURE, r.request_id)
        ckpt = self.program.capture(r.seq, publication=reserved)
        entry = self.resources.adopt(txn.commit(checkpoint=ckpt, tokens=tokens,
                                                scope=r.cache_scope))
        if self.tiers is not None:  # written through once this iteration's output is out
            self._to_offload.append(entry)
        return entry

    def prompt_kept_at_end(self, r: RequestRecord) -> bool:
        """Whether the prompt's checkpoint is at its end rather than at the start of its last
        prefill chunk: with a reuse boundary (checkpointed there too), a prompt of one chunk (a
        repeat runs one chunk either way), or a one-token request (its turn's checkpoint is at
        the prompt's end: a second state image for one prompt is not worth a chunk)."""
        return (r.prompt.reuse_boundary is not None or r.sampling.max_new_tokens == 1
                or len(r.prompt.token_ids) <= self.program.limits.prefill_chunk)

    def drop(self, entry: CatalogEntry, evicted: bool, keep: bool = True) -> None:
        """Releases a device checkpoint; with `keep`, one not yet in the context store goes
        there first."""
        if entry in self._to_offload:
            self._to_offload.remove(entry)
            if keep:
                self._offload(entry)
        txn = self.resources.begin(Transition.DELETE)
        self.program.release_checkpoint(entry.ckpt)
        self.resources.adopt(txn.commit(checkpoint=entry.ckpt, tokens=entry.tokens,
                                        scope=entry.scope, evicted=evicted))

    # The context store -----------------------------------------------------------------------
    def advance_offloads(self) -> bool:
        """Sends retained checkpoints to the context store and concludes finished writes."""
        if self.tiers is None:
            return False
        offloaded = bool(self._to_offload)
        while self._to_offload:
            self._offload(self._to_offload.pop(0))
        return self.tiers.poll() or offloaded

    def _offload(self, entry: CatalogEntry) -> None:
        self.tiers.offload(self.program, entry.ckpt, entry.tokens, entry.scope)

    def start_reload(self, r: RequestRecord, may_evict: bool) -> Reload | None:
        """Starts reading a checkpoint longer than the device's best from the context store,
        or None. Probes the store once per request, and only when the request could start
        (the reload takes no capacity an active request was promised: it is planned like any
        admission, from pages nobody reserved and inactive checkpoints)."""
        if self.tiers is None or r.store_probed or not (self.reuse and r.reuse):
            return None
        source = self.catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope)
        above = 0 if source is None else source.frontier
        if r.prompt_tokens - 1 <= above:
            return None
        victims = self.catalog.eviction_order(keep=source) if may_evict else []
        need = self.program.pages_needed(r.prompt_tokens, r.sampling.max_new_tokens) + 2
        if self.program.release_to_fit(need, [v.ckpt for v in victims]) is None:
            return None
        r.store_probed = True
        start = time.perf_counter()
        found = self.tiers.find(r.prompt.identity, r.cache_scope, above)
        return None if found is None else self.tiers.start_reload(found, start)

    def poll_reads(self, materializing: Sequence[RequestRecord]) -> None:
        """Notes the context-store reads that ended (when any of these requests waits on one)."""
        if self.tiers is not None and any(r.txn.reload is not None for r in materializing):
            self.tiers.poll()

    def conclude_reload(self, r: RequestRecord) -> bool:
        """When the read of `r`'s MATERIALIZE has ended, imports the checkpoint it brought
        (when it checks out and fits). False: still reading."""
        if not self.tiers.read_ended(r.txn.reload):
            return False
        self._import(r)
        return True

    def _import(self, r: RequestRecord) -> None:
        reload, r.txn.reload = r.txn.reload, None
        image = self.tiers.reload_result(reload)
        found = reload.found
        if image is None or self.catalog.get(found.tokens, r.cache_scope) is not None:
            return
        # The blocks are read before evicting on the device: a victim not yet in the store is
        # written there first, and that write may evict the blocks just found.
        source = self.catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope)
        victims = self.catalog.eviction_order(keep=source) if r.may_evict else []
        for victim in victims:
            if self.program.can_import(found.frontier):
                break
            self.drop(victim, evicted=True)
        if not self.program.can_import(found.frontier):
            return
        place = self.resources.begin(Transition.PLACE, r.request_id)
        if r.prompt.identity_ids is not None:  # the store holds identities: the real prefix
            f = found.frontier
            image = dataclasses.replace(image, tokens=tuple(r.prompt.token_ids[:f]),
                                        media=r.prompt.media_before(f))
        ckpt = self.program.import_checkpoint(image)
        self.resources.adopt(place.commit(checkpoint=ckpt, tokens=found.tokens,
                                          scope=r.cache_scope))
        self.tiers.record_reload(found, time.perf_counter() - reload.started)

    def abort_reload(self, r: RequestRecord) -> None:
        """Revokes the read of a request's MATERIALIZE in flight (nothing was imported)."""
        if r.txn is not None and r.txn.reload is not None:
            reload, r.txn.reload = r.txn.reload, None
            self.tiers.abort_reload(reload)
