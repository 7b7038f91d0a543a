"""Proxy: entry windows, pipe, peer frames and routing, assembler and loader (G5, G10-G14)."""

import numpy as np
import pytest

from ninfer_jax.store import (
    AddressedToken,
    BlockId,
    InvalidParam,
    IoContext,
    NotFound,
    RequestContext,
    Store,
    StoreAssembler,
    StoreEntry,
    load_store,
)
from ninfer_jax.store.proxy.peer import frame_token, unframe_token
from ninfer_jax.store.proxy.routing import create_strategy
from tests.store.helpers import BLOCK_BYTES, block_data, empties, ids, payloads

CACHE = {"type": "store", "store": "cache",
         "config": {"capacity": 4, "policy": "lru", "block_bytes": BLOCK_BYTES}}


def posix_node(root):
    return {"type": "store", "store": "posix", "config": {"root": str(root)}}


def register(sched, rid="r", ttl=None, count=None):
    ctx = RequestContext()
    ctx.request_id, ctx.ttl_ms, ctx.total_block_count = rid, ttl, count
    sched.on_new_request(ctx)


def put(node, rid, numbers, job):
    token = node.prepare_put(rid, ids(*numbers))
    node.submit_put(job, payloads(numbers), token, IoContext())
    assert node.wait([job])[0].success
    node.complete_put(rid)


def test_seed_reload_flow_runs_as_documented(tmp_path):
    assembler = StoreAssembler({"type": "pipe", "stores": [
        {"store": "cache", "config": {"capacity": 8, "policy": "clock", "block_bytes": 64}},
        {"store": "posix", "config": {"root": str(tmp_path)}}]})
    scheduler, worker = assembler.get_scheduler(), assembler.get_worker()
    register(scheduler, "w")
    put(scheduler, "w", [0, 1, 2], 9)
    scheduler.on_request_finished("w")
    ctx = RequestContext()
    ctx.request_id, ctx.ttl_ms, ctx.total_block_count = "req-1", 60000, 128
    scheduler.on_new_request(ctx)
    keys = b"".join(block.to_bytes() for block in ids(0, 1, 2, 3))
    n = scheduler.lookup_on_prefix("req-1", keys)
    assert n == 2
    token = scheduler.prepare_get("req-1", keys[: 16 * (n + 1)])
    outs = empties(n + 1)
    worker.submit_get(1, outs, token, IoContext())
    results = worker.wait([1])
    assert results[0].success and results[0].job_id == 1
    scheduler.complete_get("req-1")
    scheduler.on_request_finished("req-1")
    np.testing.assert_array_equal(outs[2].buffers[0], block_data(2))
    assembler.close()


def test_at_most_one_window_per_kind():
    node = StoreAssembler(CACHE).root
    register(node)
    put(node, "r", [1], 1)
    node.prepare_get("r", ids(1))
    with pytest.raises(InvalidParam, match="already has an open get window"):
        node.prepare_get("r", ids(1))
    node.prepare_put("r", ids(2))  # other kinds are independent
    node.complete_get("r")
    node.prepare_get("r", ids(1))


def test_failed_prepare_opens_nothing_and_can_be_retried():
    node = StoreAssembler(CACHE).root
    register(node)
    with pytest.raises(NotFound):
        node.prepare_get("r", ids(1))
    put(node, "r", [1], 1)
    node.prepare_get("r", ids(1))


@pytest.mark.parametrize("op", ["complete_get", "complete_put", "complete_prefetch"])
def test_complete_without_open_window_is_invalid(op):
    node = StoreAssembler(CACHE).root
    register(node)
    with pytest.raises(InvalidParam, match="no open"):
        getattr(node, op)("r")


def test_operations_on_unregistered_request_are_invalid():
    node = StoreAssembler(CACHE).root
    for call in (lambda: node.lookup("x", ids(1)), lambda: node.prepare_get("x", ids(1)),
                 lambda: node.touch("x", ids(1)), lambda: node.on_request_finished("x")):
        with pytest.raises(InvalidParam, match="'x' is not registered"):
            call()


def test_duplicate_registration_is_invalid():
    node = StoreAssembler(CACHE).root
    register(node)
    with pytest.raises(InvalidParam, match="already registered"):
        register(node)


def test_complete_refused_until_job_consumed():
    node = StoreAssembler(CACHE).root
    register(node)
    token = node.prepare_put("r", ids(1))
    node.submit_put(1, payloads([1]), token)
    node.store.jobs.wait_all_finished()
    with pytest.raises(InvalidParam, match="not been consumed"):
        node.complete_put("r")
    node.wait([1])
    node.complete_put("r")
    assert node.lookup("r", ids(1)) == [True]


def test_request_facts_snapshotted_at_registration():
    node = StoreAssembler(CACHE).root
    ctx = RequestContext("r", 1000)
    node.on_new_request(ctx)
    ctx.ttl_ms = 5
    assert node.context("r").ttl_ms == 1000


def test_finish_closes_leftover_windows_best_effort():
    node = StoreAssembler(CACHE).root
    register(node)
    put(node, "r", [1], 1)
    node.prepare_get("r", ids(1))
    node.prepare_put("r", ids(2))
    node.on_request_finished("r")
    store = node.store
    assert store.buffer.pin_count(ids(1)[0]) == 0 and store.buffer.pending_ids() == set()


def test_finish_keeps_a_slot_guarded_while_its_job_is_unconsumed():
    node = StoreAssembler(CACHE).root
    register(node)
    put(node, "r", [1], 1)
    token = node.prepare_get("r", ids(1))
    node.submit_get(2, empties(1), token)
    node.on_request_finished("r")
    assert node.store.buffer.pin_count(ids(1)[0]) == 1  # never released under a transfer
    assert node.wait([2])[0].success


def test_untokened_store_gets_keys_only_tokens(tmp_path):
    node = StoreAssembler(posix_node(tmp_path)).root
    register(node)
    token = node.prepare_put("r", ids(1, 2))
    assert token.keys == tuple(ids(1, 2)) and token.payload == b""
    node.submit_put(1, payloads([1, 2]), token)
    assert node.wait([1])[0].success
    node.complete_put("r")
    assert node.lookup("r", ids(1, 2, 3)) == [True, True, False]
    with pytest.raises(InvalidParam, match="untokened"):
        node.submit_get(2, empties(1), AddressedToken(tuple(ids(1)), b"x"))


def test_non_prefetchable_store_synthesizes_prefetch_completion():
    node = StoreAssembler(CACHE).root
    register(node)
    plan = node.prepare_prefetch("r")
    node.submit_prefetch(5, plan)
    assert node.wait([5])[0].success
    with pytest.raises(NotFound):
        node.wait([5])
    node.complete_prefetch("r")


def test_entry_validates_submits():
    node = StoreAssembler(CACHE).root
    register(node)
    token = node.prepare_put("r", ids(1, 2))
    with pytest.raises(InvalidParam, match="1 payloads for a token of 2 keys"):
        node.submit_put(1, payloads([1]), token)
    node.submit_prefetch(3, AddressedToken(()))
    with pytest.raises(InvalidParam, match="job id 3 is already in flight"):
        node.submit_put(3, payloads([1, 2]), token)
    with pytest.raises(NotFound):
        node.wait([77])
    assert [r.job_id for r in node.get_finished()] == [3]


def test_prefetch_signal_and_error_are_separate_channels(tmp_path):
    node = StoreAssembler({"type": "pipe", "stores": [
        {"store": "cache", "config": {"capacity": 1, "block_bytes": BLOCK_BYTES}},
        posix_node(tmp_path)]}).root
    register(node, "w")
    put(node, "w", [1], 1)
    put(node, "w", [2], 2)
    register(node, "r")
    assert node.lookup("r", ids(1)) is None
    assert node.lookup_on_prefix("r", ids(1)) is None
    assert node.lookup_on_reverse("r", ids(1)) is None
    assert node.lookup("r", ids(7)) == [False]
    with pytest.raises(InvalidParam):
        node.lookup("r", b"short")


def test_lookup_on_prefix_and_reverse():
    node = StoreAssembler(CACHE).root
    register(node)
    put(node, "r", [1, 2, 4], 1)
    assert node.lookup_on_prefix("r", ids(1, 2, 3, 4)) == 1
    assert node.lookup_on_reverse("r", ids(1, 2, 3, 4)) == 3
    assert node.lookup_on_prefix("r", ids(3, 1)) == -1
    assert node.lookup_on_reverse("r", ids(5, 6)) == -1


def test_touch_extends_by_the_request_ttl():
    from ninfer_jax.store.memory import CacheStore
    from tests.store.helpers import FakeClock

    clock = FakeClock()
    store = CacheStore(clock)
    store.setup({"capacity": 2, "block_bytes": BLOCK_BYTES})
    node = StoreEntry(store)
    register(node, "a", ttl=1000)
    put(node, "a", [1], 1)
    register(node, "b", ttl=5000)
    clock.advance(0.9)
    node.touch("b", ids(1))
    clock.advance(3)
    assert node.lookup("b", ids(1)) == [True]


class _Recorder(Store):
    events: list = []

    def setup(self, config):
        self.lower = config.get("piped_lower_store")
        self.label = config["label"]
        _Recorder.events.append(("setup", self.label, getattr(self.lower, "label", None)))

    def lookup(self, ids_):
        return [False] * len(ids_)

    def load(self, job_id, job):
        raise NotImplementedError

    dump = load

    def get_finished(self):
        return []

    def wait(self, job_ids):
        return []

    def close(self):
        _Recorder.events.append(("close", self.label))


def test_pipe_sets_up_bottom_up_and_tears_down_head_first():
    _Recorder.events = []
    path = f"{__name__}:_Recorder"
    assembler = StoreAssembler({"type": "pipe", "stores": [
        {"store": path, "config": {"label": "head"}},
        {"store": path, "config": {"label": "mid"}},
        {"store": path, "config": {"label": "tail"}}]})
    assembler.close()
    assert _Recorder.events == [("setup", "tail", None), ("setup", "mid", "tail"),
                                ("setup", "head", "mid"), ("close", "head"), ("close", "mid"),
                                ("close", "tail")]


def test_frames_round_trip_and_bad_frames_are_rejected():
    token = AddressedToken(tuple(ids(1)), b"inner")
    framed = frame_token(2, token)
    assert framed.payload[:4] == b"UCP1" and framed.payload[4:12] == (2).to_bytes(8, "little")
    assert unframe_token(framed, 3) == (2, token)
    for payload, message in [(b"", "not framed"), (b"XXXX" + bytes(8), "not framed"),
                             (b"UCP1\x02", "truncated"), (b"UC", "truncated")]:
        with pytest.raises(InvalidParam, match=message):
            unframe_token(AddressedToken((), payload), 3)
    with pytest.raises(InvalidParam, match="branch 2, the peer has 2"):
        unframe_token(framed, 2)


def peer(tmp_path, strategy="ttl", thresholds=(60000, 10000)):
    return StoreAssembler({"type": "peer",
                           "routing": {"strategy": strategy,
                                       "config": {"thresholds": list(thresholds)}},
                           "branches": [CACHE, {"type": "pipe", "stores": [
                               {"store": "cache", "config": {"capacity": 4,
                                                             "block_bytes": BLOCK_BYTES}},
                               posix_node(tmp_path / "a")]}, posix_node(tmp_path / "b")]}).root


@pytest.mark.parametrize("ttl,branch", [(90000, 0), (60001, 0), (60000, 1), (10001, 1),
                                        (10000, 2), (5, 2), (None, 2)])
def test_ttl_routing(tmp_path, ttl, branch):
    node = peer(tmp_path)
    register(node, ttl=ttl)
    assert node.branch_of("r") == branch


@pytest.mark.parametrize("count,branch", [(1, 0), (8, 0), (9, 1), (64, 1), (65, 2), (None, 2)])
def test_length_routing(tmp_path, count, branch):
    node = peer(tmp_path, "length", (8, 64))
    register(node, count=count)
    assert node.branch_of("r") == branch


@pytest.mark.parametrize("name,config,message", [
    ("ttl", {"thresholds": [10, 60]}, "strictly decreasing"),
    ("length", {"thresholds": [64, 8]}, "strictly increasing"),
    ("ttl", {"thresholds": [10]}, "need 2 branches, the peer has 3"),
    ("ttl", {}, "thresholds"),
    ("ttl", {"thresholds": [3, 2], "x": 1}, "unknown"),
    ("weighted", {}, "unknown routing strategy 'weighted'")])
def test_routing_config_errors(name, config, message):
    with pytest.raises(InvalidParam, match=message):
        create_strategy(name, config, 3)


def test_peer_routes_every_window_of_a_request_to_its_branch(tmp_path):
    node = peer(tmp_path)
    register(node, "hot", ttl=90000)
    register(node, "cold")
    put(node, "hot", [1], 1)
    put(node, "cold", [2], 2)
    assert node.branches[0].lookup("hot", ids(1, 2)) == [True, False]
    assert node.lookup("cold", ids(1, 2)) == [False, True]
    token = node.prepare_get("cold", ids(2))
    assert unframe_token(token, 3)[0] == 2
    outs = empties(1)
    node.submit_get(3, outs, token)
    assert node.wait([3])[0].success
    node.complete_get("cold")
    np.testing.assert_array_equal(outs[0].buffers[0], block_data(2))


def test_peer_job_ids_unique_across_branches_and_completions_aggregate(tmp_path):
    node = peer(tmp_path)
    register(node, "hot", ttl=90000)
    register(node, "cold")
    t_hot = node.prepare_put("hot", ids(1))
    t_cold = node.prepare_put("cold", ids(2))
    node.submit_put(1, payloads([1]), t_hot)
    with pytest.raises(InvalidParam, match="job id 1 is already in flight"):
        node.submit_put(1, payloads([2]), t_cold)
    node.submit_put(2, payloads([2]), t_cold)
    results = node.wait([2, 1])
    assert [r.job_id for r in results] == [2, 1] and all(r.success for r in results)
    with pytest.raises(NotFound):
        node.wait([1])
    with pytest.raises(InvalidParam, match="not framed"):
        node.submit_get(4, empties(1), AddressedToken(tuple(ids(1))))


@pytest.mark.parametrize("config,message", [
    ({"type": "tree"}, "unknown node type 'tree'"),
    ({"type": "pipe", "stores": []}, "non-empty 'stores'"),
    ({"type": "pipe", "stores": [{"type": "pipe", "stores": []}]}, "pipe tiers must be stores"),
    ({"type": "peer", "branches": [{"type": "peer"}], "routing": {"strategy": "ttl"}},
     "flatten it into a wider peer"),
    ({"type": "store", "store": "memcached"},
     # the built-ins, and whatever other tests registered
     r"unknown store 'memcached'; known: \['cache', (.*, )?'posix', (.*, )?'redis'"),
    ({"type": "store", "store": "no_such_module:X"}, "cannot be found"),
    ({"type": "store", "store": "ninfer_jax.store.types:Nope"}, "has no class 'Nope'"),
    ({"type": "store", "store": "ninfer_jax.store.types:BlockId"}, "not a Store subclass"),
    ({"type": "store", "store": "cache", "config": {"capacity": 0, "block_bytes": 1}},
     "capacity"),
    ({"type": "store", "store": "cache", "cfg": {}}, "unknown field"),
    ([], "must be a dict"),
])
def test_assembler_errors(config, message):
    with pytest.raises(Exception, match=message) as info:
        StoreAssembler(config)
    assert info.value.code.value in ("InvalidParam", "NotFound")


def test_loader_creates_fresh_instances():
    a, b = load_store("cache"), load_store("ninfer_jax.store.memory:CacheStore")
    assert a is not b and type(a) is type(b)


def test_block_ids_may_be_given_packed_or_listed(tmp_path):
    node = StoreAssembler(CACHE).root
    register(node)
    put(node, "r", [1], 1)
    packed = b"".join(b.to_bytes() for b in ids(1))
    assert node.lookup("r", packed) == node.lookup("r", [BlockId(packed)]) == [True]


def test_a_module_path_naming_no_class_is_refused_without_importing_it():
    """#41: 'this:X' ran `this` (printing the Zen of Python) before refusing the path."""
    import sys

    from ninfer_jax.store.proxy.loader import load_store

    sys.modules.pop("this", None)
    with pytest.raises(NotFound, match="has no class 'X'"):
        load_store("this:X")
    assert "this" not in sys.modules
    with pytest.raises(NotFound, match="cannot be found"):
        load_store("no_such_module_anywhere:Store")
    assert type(load_store("ninfer_jax.store.memory:CacheStore")).__name__ == "CacheStore"
