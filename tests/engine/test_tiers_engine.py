"""The Engine with a context store, moment by moment (FakeProgram behind a real EngineCore, a
real `cache` -> `posix` pipe): offload at retention writes exactly the blocks the store lacks; a
reload after the device forgot a checkpoint serves its frontier with the same output; a reload
never takes pages an active request was promised and is never undone by the Engine's own writes;
tenants never share blocks; a failing store degrades to misses; close leaves every retained
checkpoint stored."""

from __future__ import annotations

import shutil
import threading
import time
from typing import ClassVar

import pytest

from ninfer_jax.context_store import open_tiers
from ninfer_jax.errors import ConfigError
from ninfer_jax.store import OsApiError, register_store
from ninfer_jax.store.posix import PosixStore
from ninfer_jax.store.proxy.loader import known_stores
from ninfer_jax.testing.fake_program import FakeProgram
from tests.engine.conftest import EOS
from tests.engine.tier_helpers import (
    BLOCK_BYTES,
    IDENTITY,
    assert_program_explained,
    assert_store_quiet,
    block_path,
    stored_blocks,
    submit,
    tier_limits,
    tiered_engine,
    topology,
    wait_writes,
    want_ids,
)

X = list(b"the system say")  # 14 tokens: pages [0, 8) full, [8, 14) the tail
MORE = list(b"more!!")
PS = 8  # page size of these tests: a checkpoint at X is 2 K/V blocks + 1 state block
CHUNK = 32


class FaultyPosix(PosixStore):
    """A posix tier whose calls named in `failing` raise OsApiError (class-wide switch)."""

    failing: ClassVar[frozenset[str]] = frozenset()

    def _fault(self, call: str) -> None:
        if call in self.failing:
            raise OsApiError(f"faulty_posix: injected {call} failure under {self.root}")

    def lookup(self, ids):
        self._fault("lookup")
        return super().lookup(ids)

    def load(self, job_id, job):
        self._fault("load")
        super().load(job_id, job)

    def dump(self, job_id, job):
        self._fault("dump")
        super().dump(job_id, job)


class SlowPosix(PosixStore):
    """A posix tier whose every block write takes `delay_s` longer."""

    delay_s = 0.15

    def _write(self, block_id, payload):
        time.sleep(self.delay_s)
        return super()._write(block_id, payload)


for _name, _cls in (("faulty_posix", FaultyPosix), ("slow_posix", SlowPosix)):
    if _name not in known_stores():
        register_store(_name, _cls)


@pytest.fixture(autouse=True)
def _no_faults():
    yield
    FaultyPosix.failing = frozenset()


def _engine(root, max_concurrency=1, **kw):
    # Every prompt here fits one prefill chunk: its checkpoint is at its end.
    return tiered_engine(root, max_concurrency, page_size=PS, prefill_chunk=CHUNK, **kw)


def _ids(t, tokens, scope=None):
    kv, state = t.layout.checkpoint_ids(tuple(tokens), scope)
    return kv + state


def test_offload_writes_the_missing_blocks_and_a_reload_serves_the_frontier(tmp_path):
    with _engine(tmp_path, capacity=16) as t:
        first = submit(t.core, X, 1).result(timeout=10)
        s = wait_writes(t.core).tiers
        assert list(first.token_ids) == want_ids(X, 1)
        assert (s.offloads, s.blocks_written, s.bytes_written) == (1, 3, 3 * BLOCK_BYTES)
        assert {b.bytes for b in stored_blocks(t)} == set(_ids(t, X))
        turn = X + MORE
        second = submit(t.core, turn, 1).result(timeout=10)  # a device hit at X
        assert second.usage.cached_tokens == len(X)
        s = wait_writes(t.core).tiers
        # Its checkpoint at `turn` shares full page 0 with X: full page 1, tail and state only.
        assert (s.offloads, s.blocks_written) == (2, 3 + 3)
        assert {b.bytes for b in stored_blocks(t)} == set(_ids(t, X) + _ids(t, turn))

        t.core.clear_prefix_cache()
        follow = turn + list(second.token_ids) + MORE
        third = submit(t.core, follow, 4).result(timeout=10)
        s = wait_writes(t.core).tiers
        assert list(third.token_ids) == want_ids(follow, 4)
        assert third.usage.cached_tokens == len(turn)
        assert (s.reloads, s.reloaded_tokens, s.reload_failures) == (1, len(turn), 0)
        assert s.bytes_loaded == 4 * BLOCK_BYTES and dict(s.hits_by_tier)["cache"] == 1
        assert_program_explained(t)
        assert_store_quiet(t)


def test_a_reload_survives_the_device_eviction_it_causes(tmp_path):
    """The lane frees and the next request reloads in the same worker iteration that retained
    the finished one's turn: the only checkpoint slot holds that new checkpoint, not yet in the
    store. Evicting it for the reload writes it to the store first, and that write evicts
    blocks from the head; the reload must have read its blocks before."""
    with _engine(tmp_path, capacity=6, total_checkpoint_slots=1) as t:
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
        t.core.clear_prefix_cache()  # X now only in the store: 3 of the head's 6 blocks
        other = list(b"other talk")
        assert len(want_ids(other, 3)) == 3
        b = submit(t.core, other, 3)  # its turn checkpoint needs 3 more head blocks
        c = submit(t.core, X + MORE, 4)  # waits for the only lane
        rb, rc = b.result(timeout=10), c.result(timeout=10)
        s = wait_writes(t.core).tiers
    assert list(rb.token_ids) == want_ids(other, 3)
    assert list(rc.token_ids) == want_ids(X + MORE, 4)
    assert rc.usage.cached_tokens == len(X)
    assert s.reloads == 1 and s.reload_failures == 0


@pytest.mark.parametrize("spare", [2, 3])
def test_a_reload_never_takes_pages_promised_to_an_active_request(tmp_path, spare):
    """An active request holds its complete growth reservation. With `spare` unpromised pages
    a follow-up whose reload needs 2 pages for X plus 2 of its own cannot reload: with 2 spare
    it cannot even start from root (3 pages), so it waits for the active one and reloads then;
    with 3 it runs from root beside it. The active request always finishes intact."""
    budget = 40
    long_prompt = next(p for p in (list(b"tell a story %d" % i) for i in range(100))
                       if len(want_ids(p, budget)) == budget)
    need = -(-(len(long_prompt) + budget) // PS)
    with _engine(tmp_path, 2, capacity=16, total_pages=need + spare,
                 total_checkpoint_slots=2) as t:
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
        t.core.clear_prefix_cache()
        lookups = t.core.stats().tiers.lookups
        active_at_materialize = []
        t.program.on("after_materialize", lambda seqs: active_at_materialize.append(
            len(t.program.handles())))
        gate = t.program.pause("after_decode")
        a = submit(t.core, long_prompt, budget)
        gate.wait()  # `a` is decoding and holds its reservation
        follow = X + MORE
        c = submit(t.core, follow, 4)
        gate.release()
        ra, rc = a.result(timeout=10), c.result(timeout=10)
        s = wait_writes(t.core)
    assert s.available and list(ra.token_ids) == want_ids(long_prompt, budget)
    assert list(rc.token_ids) == want_ids(follow, 4)
    # The active request looked its own prompt up (a miss); the follow-up only when it could
    # reload without touching that request's reservation.
    if spare == 2:  # waited for the pages the active request held, then reloaded X
        assert active_at_materialize == [1, 1] and rc.usage.cached_tokens == len(X)
        assert s.tiers.reloads == 1 and s.tiers.lookups == lookups + 2
    else:  # from root, beside the active request; the store was not even asked
        assert active_at_materialize == [1, 2] and rc.usage.cached_tokens == 0
        assert s.tiers.reloads == 0 and s.tiers.lookups == lookups + 1


def test_tenants_never_reuse_each_others_blocks(tmp_path):
    with _engine(tmp_path, capacity=16) as t:
        submit(t.core, X, 1, scope="acme").result(timeout=10)
        wait_writes(t.core)
        acme = stored_blocks(t)
        t.core.clear_prefix_cache()
        for scope in (None, "globex"):
            r = submit(t.core, X + MORE, 4, scope=scope).result(timeout=10)
            assert list(r.token_ids) == want_ids(X + MORE, 4)
            assert r.usage.cached_tokens == 0
        s = wait_writes(t.core).tiers
        assert s.reloads == 0 and s.lookups == 3
        for scope in (None, "globex"):  # each wrote its own blocks, none of acme's
            ids = set(_ids(t, X + MORE, scope))
            assert ids <= {b.bytes for b in stored_blocks(t)}
        assert acme.isdisjoint({b for b in stored_blocks(t) if b.bytes in set(
            _ids(t, X + MORE, None) + _ids(t, X + MORE, "globex"))})
        t.core.clear_prefix_cache()
        r = submit(t.core, X + MORE, 4, scope="acme").result(timeout=10)
        assert r.usage.cached_tokens == len(X)  # its own blocks still serve it
        assert wait_writes(t.core).tiers.reloads == 1


@pytest.mark.parametrize("failing", [{"lookup"}, {"load"}, {"dump"}, {"lookup", "load", "dump"}])
def test_a_failing_store_degrades_to_misses(tmp_path, failing):
    with _engine(tmp_path, lower="faulty_posix") as t:
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
    with _engine(tmp_path, capacity=8, lower="faulty_posix") as t:  # X is below the head only
        FaultyPosix.failing = frozenset(failing)
        answers = [submit(t.core, X + MORE + [97 + i], 3).result(timeout=10) for i in range(3)]
        s = wait_writes(t.core)
        FaultyPosix.failing = frozenset()
        assert s.available
        for i, r in enumerate(answers):
            assert list(r.token_ids) == want_ids(X + MORE + [97 + i], 3)
        if failing == {"dump"}:  # X reloads; no new checkpoint can be written
            assert answers[0].usage.cached_tokens == len(X) and s.tiers.reloads >= 1
            assert s.tiers.write_failures >= 1 and s.tiers.offloads == 0
        else:  # X cannot come back
            assert answers[0].usage.cached_tokens == 0 and s.tiers.reloads == 0
        if "lookup" in failing:
            assert s.tiers.store_errors >= 3
        assert_program_explained(t)
        assert_store_quiet(t)
        t.core.clear_prefix_cache()
        r = submit(t.core, X + list(b"healed"), 3).result(timeout=10)
        assert r.usage.cached_tokens == len(X)  # X was never lost below


def test_a_vanished_block_directory_is_a_miss_and_heals(tmp_path):
    """The block directory replaced by a file (a disk swapped under the store): every lookup
    and write there fails with OsApiError; the Engine answers from root, then reloads again
    once the directory is back."""
    with _engine(tmp_path) as t:
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
    blocks = tmp_path / "blocks"
    with _engine(tmp_path, capacity=8) as t:
        shutil.move(blocks, tmp_path / "away")
        blocks.write_bytes(b"not a directory")
        r = submit(t.core, X + MORE, 3).result(timeout=10)
        s = wait_writes(t.core)
        assert s.available and list(r.token_ids) == want_ids(X + MORE, 3)
        assert r.usage.cached_tokens == 0 and s.tiers.store_errors >= 1
        assert s.tiers.write_failures >= 1 and s.tiers.offloads == 0
        blocks.unlink()
        shutil.move(tmp_path / "away", blocks)
        t.core.clear_prefix_cache()
        r = submit(t.core, X + list(b"again"), 3).result(timeout=10)
        assert r.usage.cached_tokens == len(X)
        wait_writes(t.core)
        assert_store_quiet(t)


def test_a_store_that_cannot_be_set_up_is_a_config_error(tmp_path):
    (tmp_path / "blocks").write_bytes(b"not a directory")
    program = FakeProgram(tier_limits(1), eos_id=EOS)
    with pytest.raises(ConfigError, match="context_store: .*blocks"):
        open_tiers(topology(tmp_path, 8), program, IDENTITY)


@pytest.mark.parametrize(("stores", "message"), [
    (["posix", "cache"], r"stores\[1\] is 'cache' below 'posix' \(context_store.stores\[0\]\)"),
    (["cache", "redis", "posix"], r"stores\[2\] is 'posix' below 'redis'"),
])
def test_a_pipe_not_fastest_first_is_a_config_error(tmp_path, stores, message):
    """A host-memory cache below the disk (or the disk below Redis) only adds a copy: the
    Engine refuses the topology before any store is set up, naming both tiers."""
    configs = {"cache": {"capacity": 8}, "posix": {"root": str(tmp_path / "disk")},
               "redis": {"url": "redis://127.0.0.1:1/0"}}
    pipe = {"type": "pipe", "stores": [{"store": s, "config": configs[s]} for s in stores]}
    program = FakeProgram(tier_limits(1), eos_id=EOS)
    with pytest.raises(ConfigError, match=message):
        open_tiers(pipe, program, IDENTITY)
    assert not (tmp_path / "disk").exists()  # refused before any store was set up


def test_close_waits_for_pending_writes(tmp_path):
    """Writes that take long are still stored once close returns, the ones queued behind the
    store's transfer threads too."""
    prompts = [X + [97 + i] for i in range(4)]
    with _engine(tmp_path, capacity=64, lower="slow_posix") as t:
        for ids in prompts:
            submit(t.core, ids, 1).result(timeout=10)
        assert t.core.stats().tiers.pending_writes >= 1
        started = time.monotonic()
        t.core.close()
        assert time.monotonic() - started >= SlowPosix.delay_s
        wanted = {b for ids in prompts for b in _ids(t, ids)}
    assert all(block_path(tmp_path, b).exists() for b in wanted)


def test_close_stores_a_checkpoint_retained_in_the_last_iteration(tmp_path):
    """A checkpoint retained in the worker's last iteration is sent to the store on close,
    not dropped with the device."""
    with _engine(tmp_path, capacity=16) as t:
        gate = t.program.pause("after_commit")
        h = submit(t.core, X, 1)
        gate.wait()  # the prompt's checkpoint is retained right after this commit
        closer = threading.Thread(target=t.core.close)
        closer.start()
        while not t.core._stop.is_set():
            time.sleep(0.001)
        gate.release()
        closer.join(10)
        assert not closer.is_alive()
        del h
    assert all(block_path(tmp_path, b).exists() for b in _ids(t, X))
    with _engine(tmp_path, capacity=16) as t:  # a restart reloads it
        r = submit(t.core, X + MORE, 2).result(timeout=10)
    assert r.usage.cached_tokens == len(X)


def test_finished_store_requests_leave_no_prefetch_signal(tmp_path):
    with _engine(tmp_path, capacity=16) as t:
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
    with _engine(tmp_path, capacity=16) as t:  # a restart: X is below the head only
        # Its find prefetches page 0 (a full page of X); its offload then looks up X's tail
        # and state, which the head lacks and the tier below holds: the prefetch signal.
        submit(t.core, X, 1).result(timeout=10)
        wait_writes(t.core)
        assert_store_quiet(t)
        assert not t.head._prefetch_facet._signals


def test_a_peer_topology_serves_reloads(tmp_path):
    """A peer (routing by request length) over a host tier and a disk tier, through the
    Engine's own set-up: offloads and reloads go through whichever branch routing picks."""
    from ninfer_jax.engine import EngineCore, EngineCoreConfig
    from tests.engine.conftest import FRONTEND
    from tests.engine.tier_helpers import tier_limits

    program = FakeProgram(tier_limits(2, prefill_chunk=CHUNK), eos_id=EOS)
    peer = {"type": "peer", "routing": {"strategy": "length", "config": {"thresholds": [4]}},
            "branches": [{"type": "store", "store": "cache", "config": {"capacity": 64}},
                         {"type": "store", "store": "posix", "config": {"root": str(tmp_path)}}]}
    tiers = open_tiers(peer, program, b"fake-model")
    core = EngineCore(program, FRONTEND, EngineCoreConfig(idle_wait_s=0.005), tiers)
    try:
        first = submit(core, X, 2).result(timeout=10)
        wait_writes(core)
        assert core.stats().tiers.offloads >= 1 and core.stats().tiers.tiers == ("store",)
        core.clear_prefix_cache()
        r = submit(core, X + MORE, 2).result(timeout=10)
        assert list(r.token_ids) == want_ids(X + MORE, 2)
        assert r.usage.cached_tokens >= len(X) and first.usage.cached_tokens == 0
        assert dict(core.stats().tiers.hits_by_tier) == {"store": 1}
    finally:
        core.close()


def test_host_tier_evictions_are_counted(tmp_path):
    with tiered_engine(tmp_path, capacity=4) as t:
        for i in range(3):
            submit(t.core, X + [i], 2).result(timeout=10)
            wait_writes(t.core)
        evicted = dict(t.core.stats().tiers.evictions_by_tier)
        assert evicted == {"cache": t.head.buffer.evictions} and evicted["cache"] > 0
