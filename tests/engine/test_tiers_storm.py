"""A storm over the Engine with a context store where every tier is tiny: a device of few pages
and 1-3 checkpoint slots, a `cache` head of 2-8 blocks over a `posix` tier, 1-3 lanes. Several
conversations share system prompts and continue (or branch from) each other's histories, some in
a tenant's cache scope of their own, so checkpoints are evicted on the device and in the head and
partial prefixes are reloaded from either tier; requests are cancelled before admission, at exact
worker moments, or by dropping their handles, and the prefix cache is cleared at random.

Whatever was reused, every request ends exactly once and answers what the FakeProgram generates
for its prompt alone (its import refuses a page whose bytes the tokens do not determine, so a
store serving wrong data fails the Engine); a reused prefix is one a request of the same scope
retained; once quiet, every Program page is free or a catalogued checkpoint's, and the store
holds no pin, reservation, job or request, with each block identical in both tiers. A variant
corrupts, forges or deletes block files between turns: the answers stay the same."""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.engine import Finished, FinishReason, GenerationStart
from ninfer_jax.gateway.http.metrics import _tier_metrics
from ninfer_jax.testing.fake_program import HOOK_POINTS
from ninfer_jax.testing.redis_server import RedisServer
from tests.engine.conftest import EOS, prompt_checkpoint, settle
from tests.engine.invariants import assert_transactions_settled
from tests.engine.tier_helpers import (
    BLOCK_BYTES,
    assert_program_explained,
    assert_store_quiet,
    block_files,
    block_path,
    forge,
    frontiers_of,
    submit,
    tiered_engine,
    wait_writes,
    want_ids,
)

SYSTEMS = [[83, 121, 115, 58, 32, 98, 101, 32, 98, 114, 105, 101, 102],  # "Sys: be brief"
           [89, 111, 117, 32, 97, 114, 101, 32, 107, 105, 110, 100]]  # "You are kind"
USER = st.lists(st.integers(97, 122), min_size=1, max_size=6)
MAX_SEQ = 80
PS = 16  # a checkpoint is 1-5 K/V blocks and 1 state block: some fit the head, some not
CANCELS = ["none"] * 6 + ["now", "hook", "drop", "drop_late"]


@dataclasses.dataclass(eq=False)
class Sent:
    ids: list[int]
    budget: int
    seed: int
    scope: str | None
    how: str  # how it is cancelled (CANCELS)
    handle: Any = None
    sink: Any = None  # kept for dropped handles: their events still arrive there
    events: list = dataclasses.field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.how != "none"


def _cancel_at(program, sent: Sent, point: str) -> None:
    """Cancels `sent` the first time the worker reaches `point` with its sequence."""
    fired = []

    def hook(seqs):
        if not fired and sent.handle is not None and any(
                s.tokens[: s.prompt_len] == sent.ids for s in seqs):
            fired.append(True)
            sent.handle.cancel()

    program.on(point, hook)


def _read(sent: Sent) -> None:
    while not sent.handle.done:
        sent.events.append(sent.handle.next_event(timeout=20))


def _drain(sent: Sent) -> None:
    """A dropped handle's events, read from its sink once the worker is idle."""
    while True:
        try:
            sent.events.append(sent.sink.get(timeout=0))
        except queue.Empty:
            return


def _check(sent: Sent, events_log) -> list[int]:
    """One request's events: exactly one Finished, last; output and reuse as promised."""
    finished = [e for e in sent.events if isinstance(e, Finished)]
    assert len(finished) == 1 and sent.events[-1] is finished[0], sent.events
    fin = finished[0]
    got = [t for e in sent.events for t in getattr(e, "token_ids", ())]
    want = want_ids(sent.ids, sent.budget, sent.seed)
    assert got == want[: len(got)]
    if fin.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        assert got == want
    else:
        assert fin.finish_reason is FinishReason.CANCELLED and sent.cancelled, fin
    cached = fin.usage.cached_tokens
    assert 0 <= cached < len(sent.ids)
    if cached:  # a checkpoint that a request of this scope retained
        assert tuple(sent.ids[:cached]) in frontiers_of(events_log, sent.scope), (sent, cached)
    starts = [e for e in sent.events if isinstance(e, GenerationStart)]
    assert len(starts) <= 1 and (not starts or starts[0].cached_tokens == cached)
    return got


def _quiet(t, clear: bool, forged: frozenset[bytes]) -> None:
    s = settle(t.core)
    assert s.available and s.outstanding == 0 and s.free_lanes == s.total_lanes, s
    if clear:
        t.core.clear_prefix_cache()
    wait_writes(t.core)
    assert_program_explained(t)
    assert_transactions_settled(settle(t.core), t.program.stats().num_checkpoints)
    if clear:
        p = t.program.stats()
        assert p.free_pages == p.total_pages and p.num_checkpoints == 0, p
        assert p.free_checkpoint_slots == t.program.limits.total_checkpoint_slots
    assert_store_quiet(t, forged)
    events = t.tiers.events  # what was found had been offloaded before, in the same scope
    for i, (kind, scope, tokens) in enumerate(events):
        if kind == "found":
            assert tokens in frontiers_of(events[:i], scope), (scope, tokens)


def _storm(data, root: Path, damage: bool, redis_url: str | None = None) -> None:
    concurrency = data.draw(st.integers(1, 3), label="lanes")
    kw = {"capacity": data.draw(st.integers(2, 8), label="head blocks"),
          "policy": data.draw(st.sampled_from(["lru", "clock", "fifo"]), label="policy"),
          "total_checkpoint_slots": data.draw(st.integers(1, 3), label="ckpt slots"),
          "total_pages": data.draw(st.integers(MAX_SEQ // PS, MAX_SEQ // PS * concurrency + 3),
                                   label="pages"),
          "max_seq_len": MAX_SEQ, "page_size": PS}
    scopes = [None, None, "tenant"]
    step = data.draw(st.sampled_from([0.0, 0.001]), label="step seconds")
    lower = {"lower": "redis", "redis_url": redis_url} if redis_url else {}
    with tiered_engine(root, concurrency, program_kw={"step_seconds": step}, **lower,
                       **kw) as t:
        histories: list[tuple[str | None, list[int]]] = []
        forged: set[bytes] = set()
        for _ in range(data.draw(st.integers(2, 4), label="turns")):
            sent: list[Sent] = []
            for _ in range(data.draw(st.integers(1, 5), label="requests")):
                if histories and data.draw(st.integers(0, 2), label="continue"):
                    scope, base = data.draw(st.sampled_from(histories), label="history")
                    if not data.draw(st.integers(0, 3), label="branch"):
                        base = base[: data.draw(st.integers(1, len(base)), label="cut")]
                    if not data.draw(st.integers(0, 3), label="other tenant"):
                        scope = data.draw(st.sampled_from(scopes), label="scope")
                else:
                    scope = data.draw(st.sampled_from(scopes), label="scope")
                    base = list(data.draw(st.sampled_from(SYSTEMS), label="system"))
                ids = base + data.draw(USER, label="user")
                budget = data.draw(st.integers(1, 6), label="budget")
                if len(ids) + budget > MAX_SEQ:
                    ids = ids[-(MAX_SEQ - budget):]
                r = Sent(ids, budget, data.draw(st.sampled_from([0, 0, 5]), label="seed"), scope,
                         data.draw(st.sampled_from(CANCELS), label="cancel"))
                if r.how == "hook":
                    _cancel_at(t.program, r, data.draw(st.sampled_from(HOOK_POINTS)))
                r.handle = submit(t.core, r.ids, r.budget, r.seed, r.scope)
                r.sink = r.handle._sink
                if r.how == "now":
                    r.handle.cancel()
                elif r.how == "drop":
                    r.handle = None
                sent.append(r)
                if data.draw(st.integers(0, 5), label="clear") == 0:
                    t.core.clear_prefix_cache()
            for r in sent:
                if r.how == "drop_late":
                    time.sleep(0.001)
                    r.handle = None
                elif r.handle is not None:
                    _read(r)
            settle(t.core)
            for r in sent:
                if r.handle is None:
                    _drain(r)
                got = _check(r, t.tiers.events)
                if not r.cancelled:
                    histories.append((r.scope, r.ids + got))
            if data.draw(st.integers(0, 2), label="let writes land"):
                wait_writes(t.core)  # else the next turn's reloads race this turn's writes
                if damage and data.draw(st.booleans(), label="damage"):
                    forged |= _damage(data, t.root)
                if data.draw(st.booleans(), label="forget the device's"):
                    t.core.clear_prefix_cache()  # the next turn reloads from the store
        _quiet(t, False, frozenset(forged))
        _quiet(t, True, frozenset(forged))
        if not damage and not redis_url:
            assert t.core.stats().tiers.reload_failures == 0
            assert not list((t.root / "quarantine").iterdir())


DAMAGE = st.lists(st.sampled_from(["keep"] * 3 + ["flip", "cut", "forge", "delete"]),
                  min_size=1, max_size=8)


def _damage(data, root: Path) -> set[bytes]:
    """Corrupts, truncates, forges or deletes some block files (the plan is drawn first: how
    many files there are depends on timing); returns the ids of the forged ones."""
    plan, forged = data.draw(DAMAGE, label="damage plan"), set()
    for i, path in enumerate(block_files(root)):
        how = plan[i % len(plan)]
        if how == "flip":
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(bytes(raw))
        elif how == "cut":
            os.truncate(path, path.stat().st_size // 2)
        elif how == "forge":  # valid checksum, wrong bytes: the envelope or the tag refuses it
            forge(path, bytes(BLOCK_BYTES))
            forged.add(bytes.fromhex(path.name.split(".")[0]))
        elif how == "delete":
            path.unlink()
    return forged


STORM = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@STORM
@given(data=st.data())
def test_storm_answers_identically_and_leaves_nothing_behind(data):
    with tempfile.TemporaryDirectory() as root:
        _storm(data, Path(root), damage=False)


@pytest.mark.slow  # ~13 s; damaged block files: tests/store/ (posix quarantine)
@STORM
@given(data=st.data())
def test_storm_with_damaged_block_files_answers_identically(data):
    with tempfile.TemporaryDirectory() as root:
        _storm(data, Path(root), damage=True)


@pytest.mark.parametrize("how", ["flip", "delete", "forge_state", "forge_kv"])
def test_a_damaged_block_is_a_miss_that_stats_show(tmp_path, how):
    """After a restart (an empty head), one damaged block of the longest checkpoint: the next
    turn reuses less (or the forged state image is refused), answers the same, and says so."""
    system = SYSTEMS[0] + [32, 120, 121, 122]
    with tiered_engine(tmp_path, 1) as t:
        first = list(submit(t.core, system, 4).result(timeout=10).token_ids)
        wait_writes(t.core)
    assert len(first) == 4 and EOS not in first
    turn = system + first + [104, 105]
    longest = tuple(system + first[:-1])  # the first turn's checkpoint
    kv, state = t.layout.checkpoint_ids(longest, None)
    victim = block_path(tmp_path, (state if how == "forge_state" else kv)[-1])
    if how == "flip":
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 1
        victim.write_bytes(bytes(raw))
    elif how == "delete":
        victim.unlink()
    else:
        forge(victim, bytes(BLOCK_BYTES))
    with tiered_engine(tmp_path, 1) as t:
        r = submit(t.core, turn, 5).result(timeout=10)
        s = t.core.stats()
    assert list(r.token_ids) == want_ids(turn, 5)
    assert s.available and s.tiers.lookups == 1
    # A file failing its checksum is moved aside and counted (a forged one passes it: the tag
    # or the envelope refuses its bytes).
    damaged = int(how == "flip")
    assert dict(s.tiers.quarantined_by_tier) == {"posix": damaged}
    assert len(list((tmp_path / "quarantine").iterdir())) == damaged
    published = {(m.name, sample.labels.get("tier")): sample.value
                 for m in _tier_metrics(s.tiers) for sample in m.samples}
    assert published[("ninfer_store_quarantined", "posix")] == damaged  # /metrics says it too
    if how.startswith("forge"):  # found whole, refused by its envelope or tag: nothing reused
        assert s.tiers.reload_failures == 1 and s.tiers.reloads == 0
        assert r.usage.cached_tokens == 0
    else:  # a miss at lookup: the first prompt's checkpoint below it is reloaded instead
        assert s.tiers.reload_failures == 0 and s.tiers.reloads == 1
        assert r.usage.cached_tokens == prompt_checkpoint(len(system))


@pytest.fixture(scope="module")
def evicting_redis():
    """A Redis that holds about a hundred blocks beyond its own use, evicting the least
    recently used."""
    with RedisServer(maxmemory_policy="allkeys-lru") as server:
        client = server.client()
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 40_000)
        yield server
        assert server.client().info("stats")["evicted_keys"] > 0  # it did evict


@STORM
@given(data=st.data())
def test_storm_over_an_evicting_redis_answers_identically(data, evicting_redis):
    """The bottom tier is Redis evicting under memory pressure: blocks vanish below the head
    between turns, and every reload that misses a block is a miss, never a wrong answer."""
    evicting_redis.client().flushdb()
    with tempfile.TemporaryDirectory() as root:
        _storm(data, Path(root), damage=False, redis_url=evicting_redis.url)


@pytest.mark.parametrize("pad", range(4))
@pytest.mark.parametrize("victim", ["tail", "first"])
def test_a_forged_kv_block_is_refused_at_every_frontier_alignment(tmp_path, pad, victim):
    """A K/V block forged with a valid file checksum, at frontiers that end a page exactly or
    1-3 tokens into one (the tail block then holds a partial page): its tag refuses it, so the
    reload is a miss and the answer is the one computed from scratch."""
    system = SYSTEMS[1] + [32] * (pad + 1)
    with tiered_engine(tmp_path, 1) as t:
        first = list(submit(t.core, system, 4).result(timeout=10).token_ids)
        wait_writes(t.core)
    assert len(first) == 4 and EOS not in first
    longest = tuple(system + first[:-1])
    kv, _ = t.layout.checkpoint_ids(longest, None)
    assert len(longest) % t.layout.page_size == pad  # 0: the tail block is a whole page
    forge(block_path(tmp_path, kv[-1] if victim == "tail" else kv[0]), bytes(BLOCK_BYTES))
    turn = system + first + [104, 105]
    with tiered_engine(tmp_path, 1) as t:
        r = submit(t.core, turn, 5).result(timeout=10)
        s = t.core.stats()
    assert list(r.token_ids) == want_ids(turn, 5)
    assert s.tiers.reload_failures == 1 and s.tiers.reloads == 0 and r.usage.cached_tokens == 0
