"""Every store, facet and proxy node has a defined life (lifecycle.py): before setup and after
close every entry point raises InvalidParam at once, close is idempotent, and jobs in flight at
close complete (failed) instead of hanging `wait`, `get_finished` or a second `close`."""

import abc
import inspect
import threading
import time

import pytest

from ninfer_jax.store import (
    AddressedToken,
    InvalidParam,
    IoContext,
    IoResult,
    JobDescriptor,
    NotFound,
    Prefetchable,
    RequestContext,
    Store,
    StoreAssembler,
    TokenAddressed,
)
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import State
from ninfer_jax.store.memory import CacheStore
from ninfer_jax.store.posix import PosixStore
from ninfer_jax.store.proxy.api import StoreNode
from ninfer_jax.store.proxy.peer import frame_token
from ninfer_jax.store.transfer import TransferPool
from tests.store.helpers import BLOCK_BYTES, cache_store, empties, ids, payloads, within

BOUND_S = 5.0  # no call may take longer, whatever state it meets
B = ids(1)
CACHE = {"type": "store", "store": "cache", "config": {"capacity": 4, "block_bytes": BLOCK_BYTES}}
# Stay callable after close, so completions of jobs in flight at close can be consumed.
AFTER_CLOSE = {"close", "wait", "get_finished"}
# CacheStore's public helpers are called only by its facets, which check the life first.
CACHE_HELPERS = {"check_sizes", "copy_out", "copy_in", "lower_transfer", "track",
                 "require_idle", "mark_written", "is_written", "forget_written", "admit",
                 "conclude", "drop_overflow"}


def posix_node(root):
    return {"type": "store", "store": "posix", "config": {"root": str(root)}}


def store_calls(config):
    return {
        "setup": lambda s: s.setup(config),
        "lookup": lambda s: s.lookup(B),
        "touch": lambda s: s.touch(B, 10),
        "load": lambda s: s.load(90, JobDescriptor(B, empties(1))),
        "dump": lambda s: s.dump(91, JobDescriptor(B, payloads([1]))),
        "as_token_addressed": lambda s: s.as_token_addressed(),
        "as_prefetchable": lambda s: s.as_prefetchable(),
    }


TOKEN_CALLS = {
    "pin": lambda f: f.pin(B),
    "unpin": lambda f: f.unpin(B),
    "alloc": lambda f: f.alloc(B, None),
    "commit": lambda f: f.commit(B, True),
    "load": lambda f: f.load(92, JobDescriptor(B, empties(1)), AddressedToken(tuple(B))),
    "dump": lambda f: f.dump(93, JobDescriptor(B, payloads([1])), AddressedToken(tuple(B))),
}
PREFETCH_CALLS = {
    "lookup": lambda f: f.lookup("r", B),
    "prepare_prefetch": lambda f: f.prepare_prefetch("r", RequestContext("r")),
    "prefetch": lambda f: f.prefetch(94, AddressedToken(tuple(B), bytes(8))),
    "complete_prefetch": lambda f: f.complete_prefetch(AddressedToken(tuple(B), bytes(8)), True),
    "forget": lambda f: f.forget("r"),
}


def node_calls(token):
    return {
        "on_new_request": lambda n: n.on_new_request(RequestContext("r2")),
        "on_request_finished": lambda n: n.on_request_finished("r"),
        "lookup": lambda n: n.lookup("r", B),
        "lookup_on_prefix": lambda n: n.lookup_on_prefix("r", B),
        "lookup_on_reverse": lambda n: n.lookup_on_reverse("r", B),
        "touch": lambda n: n.touch("r", B),
        "prepare_get": lambda n: n.prepare_get("r", B),
        "prepare_put": lambda n: n.prepare_put("r", B),
        "prepare_prefetch": lambda n: n.prepare_prefetch("r"),
        "complete_get": lambda n: n.complete_get("r"),
        "complete_put": lambda n: n.complete_put("r"),
        "complete_prefetch": lambda n: n.complete_prefetch("r"),
        "submit_get": lambda n: n.submit_get(95, empties(1), token),
        "submit_put": lambda n: n.submit_put(96, payloads([1]), token),
        "submit_prefetch": lambda n: n.submit_prefetch(97, token),
    }


def _posix(root):
    store = PosixStore()
    store.setup({"root": str(root)})
    return store


def _cache_with_lower(tmp_path):
    return cache_store(lower=_posix(tmp_path))


def _posix_with_lower(tmp_path):
    store = PosixStore()
    store.setup({"root": str(tmp_path), "block_bytes": BLOCK_BYTES,
                 "piped_lower_store": cache_store()})
    return store


def _store(make):
    def build(tmp_path):
        store = make(tmp_path)
        return store, store.close
    return build


def _facet(make, which):
    def build(tmp_path):
        store = make(tmp_path)
        return getattr(store, which)(), store.close  # a facet lives and dies with its store
    return build


def _node(config_of):
    def build(tmp_path):
        assembler = StoreAssembler(config_of(tmp_path))
        assembler.root.on_new_request(RequestContext("r"))
        return assembler.root, assembler.close
    return build


def _pipe(tmp_path):
    return {"type": "pipe", "stores": [CACHE, posix_node(tmp_path)]}


def _peer(tmp_path):
    return {"type": "peer", "branches": [CACHE, posix_node(tmp_path)],
            "routing": {"strategy": "ttl", "config": {"thresholds": [1000]}}}


UNFRAMED, FRAMED = AddressedToken(tuple(B)), frame_token(1, AddressedToken(tuple(B)))
# name -> (build(tmp_path) -> (object, close), interfaces it implements, its entry points)
CASES = {
    "cache": (_store(lambda tmp: cache_store()), [Store],
              store_calls({"capacity": 2, "block_bytes": BLOCK_BYTES})),
    "posix": (_store(_posix), [Store],
              {**store_calls({"root": "unused"}), "path_of": lambda s: s.path_of(B[0]),
               "lookup_here": lambda s: s.lookup_here(B), "quarantined": lambda s: s.quarantined()}),
    "cache token facet": (_facet(lambda tmp: cache_store(), "as_token_addressed"),
                          [TokenAddressed], TOKEN_CALLS),
    "prefetching cache": (_facet(_cache_with_lower, "as_prefetchable"), [Prefetchable],
                          PREFETCH_CALLS),
    "prefetching posix": (_facet(_posix_with_lower, "as_prefetchable"), [Prefetchable],
                          PREFETCH_CALLS),
    "entry": (_node(lambda tmp: CACHE), [StoreNode],
              {**node_calls(UNFRAMED), "context": lambda n: n.context("r")}),
    "pipe": (_node(_pipe), [StoreNode],
             {**node_calls(UNFRAMED), "context": lambda n: n.context("r")}),
    "peer": (_node(_peer), [StoreNode],
             {**node_calls(FRAMED), "branch_of": lambda n: n.branch_of("r")}),
}


def _public(obj):
    return {name for name, _ in inspect.getmembers(type(obj), callable)
            if not name.startswith("_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_covers_every_public_entry_point(tmp_path, case):
    make, interfaces, calls = CASES[case]
    obj, close = make(tmp_path)
    declared = {name for iface in interfaces for klass in iface.__mro__
                if klass not in (object, abc.ABC)
                for name, member in vars(klass).items()
                if callable(member) and not name.startswith("_")}
    assert declared - AFTER_CLOSE <= set(calls), declared - AFTER_CLOSE - set(calls)
    helpers = CACHE_HELPERS if isinstance(obj, CacheStore) else set()
    assert _public(obj) - AFTER_CLOSE - helpers == set(calls)
    close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_entry_point_raises_at_once_after_close(tmp_path, case):
    make, _, calls = CASES[case]
    obj, close = make(tmp_path)
    within(BOUND_S, close)
    within(BOUND_S, close)  # idempotent, and never hangs
    for name, call in calls.items():
        with pytest.raises(InvalidParam, match=rf"{name} called after close\(\)"):
            within(BOUND_S, call, obj)
    if hasattr(obj, "get_finished"):
        assert within(BOUND_S, obj.get_finished) == []
        with pytest.raises(NotFound):
            within(BOUND_S, obj.wait, [12345])


@pytest.mark.parametrize("cls", [CacheStore, PosixStore])
def test_every_entry_point_raises_before_setup(cls):
    store = cls()
    config = {"capacity": 2, "block_bytes": BLOCK_BYTES} if cls is CacheStore else {"root": "x"}
    for name, call in store_calls(config).items():
        if name == "setup":
            continue
        with pytest.raises(InvalidParam, match=rf"{name} called before setup\(\)"):
            within(BOUND_S, call, store)
    for name, call in [("wait", lambda s: s.wait([1])), ("get_finished", cls.get_finished)]:
        with pytest.raises(InvalidParam, match=rf"{name} called before setup\(\)"):
            within(BOUND_S, call, store)
    within(BOUND_S, store.close)  # nothing to release
    with pytest.raises(InvalidParam, match=r"setup called after close\(\)"):
        store.setup(config)


def test_setup_twice_is_refused(tmp_path):
    store = _posix(tmp_path)
    with pytest.raises(InvalidParam, match="setup called twice"):
        store.setup({"root": str(tmp_path)})
    store.close()


def _submit_store(store, job, gate):
    store.dump(job, JobDescriptor(ids(job), payloads([job]), prerequisite=gate))
    return store


def _submit_token(store, job, gate):
    facet = store.as_token_addressed()
    token = facet.alloc(ids(job), None)
    facet.dump(job, JobDescriptor(ids(job), payloads([job]), prerequisite=gate), token)
    return store


def _submit_node(node, job, gate):
    token = node.prepare_put(f"r{job}", ids(job))
    node.submit_put(job, payloads([job]), token, IoContext(gate))
    return node


def _registered(config):
    node = StoreAssembler(config).root
    for job in (1, 2):
        node.on_new_request(RequestContext(f"r{job}"))
    return node


# name -> (make(tmp_path) -> owner, submit(owner, job id, gate) -> the object to wait on)
IN_FLIGHT = {
    "cache": (lambda tmp: cache_store(), _submit_store),
    "posix": (_posix, _submit_store),
    "cache token facet": (lambda tmp: cache_store(), _submit_token),
    "prefetching cache": (_cache_with_lower, _submit_token),
    "posix over cache": (_posix_with_lower, _submit_store),
    "entry": (lambda tmp: _registered(CACHE), _submit_node),
    "pipe": (lambda tmp: _registered(_pipe(tmp)), _submit_node),
    "peer": (lambda tmp: _registered(_peer(tmp)), _submit_node),
}


@pytest.mark.parametrize("case", sorted(IN_FLIGHT))
def test_jobs_in_flight_at_close_complete_failed(tmp_path, case):
    make, submit = IN_FLIGHT[case]
    owner = make(tmp_path)
    never = threading.Event()  # a prerequisite that never fires (until the test ends)
    try:
        submit(owner, 1, never)
        submit(owner, 2, never)
        waited: list = []
        waiter = threading.Thread(target=lambda: waited.extend(owner.wait([1])), daemon=True)
        waiter.start()
        within(BOUND_S, owner.close)
        waiter.join(BOUND_S)
        assert waited == [IoResult(1, False)], "a wait blocked across close() did not complete"
        assert within(BOUND_S, owner.get_finished) == [IoResult(2, False)]
        within(BOUND_S, owner.close)
    finally:
        never.set()  # if close() did hang, free its pool threads so the process can exit


def test_a_start_racing_close_completes_failed_without_running():
    table, pool = JobTable("t"), TransferPool("t", 1)
    pool.close()  # as if close() won the race after the store's life check passed
    released: list = []
    table.accept(1)
    pool.start(table, 1, None, lambda: pytest.fail("work ran after close"), released.append)
    assert released == [False] and table.wait([1]) == [IoResult(1, False)]


class FiresOnceClosing:
    """A prerequisite that fires only after its store's close() began: its transfer is under way
    when close starts, so close must wait for it and it must keep its real outcome."""

    def __init__(self, life):
        self._life = life
        self.entered = threading.Event()  # its job is parked on it: close() has not begun

    def wait(self, timeout=None):
        self.entered.set()
        deadline = time.monotonic() + BOUND_S
        while self._life.state is not State.CLOSED and time.monotonic() < deadline:
            time.sleep(0.005)
        return True


@pytest.mark.parametrize("kind", ["cache", "cache over posix", "posix", "posix over cache"])
def test_a_transfer_under_way_when_close_begins_keeps_its_outcome(tmp_path, kind):
    store = {"cache": lambda: cache_store(), "cache over posix": lambda: _cache_with_lower(tmp_path),
             "posix": lambda: _posix(tmp_path),
             "posix over cache": lambda: _posix_with_lower(tmp_path)}[kind]()
    store.dump(1, JobDescriptor(B, payloads([1])))
    assert store.wait([1])[0].success
    outs = empties(1)
    gates = [FiresOnceClosing(store.life), FiresOnceClosing(store.life)]
    store.load(2, JobDescriptor(B, outs, prerequisite=gates[0]))
    store.dump(3, JobDescriptor(ids(2), payloads([2]), prerequisite=gates[1]))
    # Both jobs must be waiting on their prerequisites when close begins (a job still queued
    # then is cancelled, by contract): wait for that instead of hoping the threads were quick.
    assert all(gate.entered.wait(BOUND_S) for gate in gates)
    within(BOUND_S, store.close)
    assert store.wait([2, 3]) == [IoResult(2, True), IoResult(3, True)]
    assert outs[0].buffers[0].tobytes() == payloads([1])[0].buffers[0].tobytes()
    if kind != "cache":
        assert _posix(tmp_path).lookup(ids(2)) == [True], "the dump under way was not committed"


def test_jobs_finished_before_close_keep_their_outcome():
    store = cache_store()
    store.dump(1, JobDescriptor(B, payloads([1])))
    store.jobs.wait_all_finished()
    store.close()
    assert store.wait([1]) == [IoResult(1, True)]


def test_a_prerequisite_without_a_timeout_wait_is_refused_at_submit():
    with pytest.raises(InvalidParam, match="JobDescriptor.prerequisite"):
        JobDescriptor(B, payloads([1]), prerequisite=object())
    with pytest.raises(InvalidParam, match="IoContext.prerequisite"):
        IoContext(prerequisite=42)
