"""The posix store under hostile files: non-regular entries at block paths, permissions, bad
checksums, and several stores (threads, processes) sharing one root. Every call is time-bounded:
a hang fails the test."""

import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

from ninfer_jax.store import JobDescriptor, OsApiError
from ninfer_jax.store import posix as posix_module
from ninfer_jax.store.posix import PosixStore
from ninfer_jax.store.posix_files import TempOwner, identity, quarantine
from tests.store.helpers import block_data, empties, ids, payloads, within

BOUND_S = 5.0
REPO = pathlib.Path(__file__).resolve().parents[2]


def posix_store(root, num_threads=4):
    store = PosixStore()
    store.setup({"root": str(root), "num_threads": num_threads})
    return store


def load_ok(store, job, numbers, nbytes=64):
    outs = empties(len(numbers), nbytes)
    store.load(job, JobDescriptor(ids(*numbers), outs))
    ok = within(BOUND_S, store.wait, [job])[0].success
    return ok, [out.buffers[0] for out in outs]


def dump_ok(store, job, numbers, nbytes=64):
    store.dump(job, JobDescriptor(ids(*numbers), payloads(numbers, nbytes)))
    return within(BOUND_S, store.wait, [job])[0].success


def _fifo(path, elsewhere):
    os.mkfifo(path)


def _directory(path, elsewhere):
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _symlink_to_a_valid_copy(path, elsewhere):
    # The link's target is a complete, valid file for this very block: following it would
    # "work", and that is exactly what the store must not do.
    os.symlink(elsewhere, path)


def _dangling_symlink(path, elsewhere):
    os.symlink(path.parent / "nowhere", path)


def _socket(path, elsewhere):
    short = pathlib.Path(tempfile.mkdtemp(dir="/tmp")) / "s"  # AF_UNIX paths are <= 107 bytes
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(short))
    sock.close()
    os.rename(short, path)
    short.parent.rmdir()


def _char_device(path, elsewhere):
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")


FOREIGN = {"fifo": _fifo, "directory": _directory, "symlink": _symlink_to_a_valid_copy,
           "dangling symlink": _dangling_symlink, "socket": _socket,
           "character device": _char_device}


def _plant(store, tmp_path, kind):
    """Puts a `kind` entry at block 1's path; returns the valid copy a symlink points at."""
    path = store.path_of(ids(1)[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere.blk"
    if not elsewhere.exists():
        donor = posix_store(tmp_path / "donor")
        assert dump_ok(donor, 0, [1])
        shutil.copyfile(donor.path_of(ids(1)[0]), elsewhere)
        donor.close()
    FOREIGN[kind](path, elsewhere)
    return path, elsewhere


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_foreign_entry_at_a_block_path_is_a_miss_a_failed_load_and_replaceable(tmp_path, kind):
    store = posix_store(tmp_path / "root")
    path, elsewhere = _plant(store, tmp_path, kind)
    assert within(BOUND_S, store.lookup, ids(1)) == [False]
    assert not os.path.lexists(path), "the foreign entry was left in place"
    assert len(store.quarantined()) == store.quarantine_count == 1

    _plant(store, tmp_path, kind)
    ok, _ = load_ok(store, 1, [1])
    assert ok is False
    assert not os.path.lexists(path) and len(store.quarantined()) == store.quarantine_count == 2

    _plant(store, tmp_path, kind)
    assert dump_ok(store, 2, [1])
    assert within(BOUND_S, store.lookup, ids(1)) == [True]
    ok, (data,) = load_ok(store, 3, [1])
    assert ok and np.array_equal(data, block_data(1))
    assert elsewhere.read_bytes()[-64:] == block_data(1).tobytes(), "a link target was touched"
    store.close()


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_foreign_fanout_directory_is_an_os_api_error_naming_it(tmp_path, kind):
    store = posix_store(tmp_path / "root")
    fanout = store.path_of(ids(1)[0]).parent
    if kind == "symlink":
        real = posix_store(tmp_path / "real")
        assert dump_ok(real, 0, [1])  # a valid block the link would lead to
        os.symlink(real.path_of(ids(1)[0]).parent, fanout)
    else:
        fanout.write_bytes(b"")
    with pytest.raises(OsApiError, match=str(fanout)):
        within(BOUND_S, store.lookup, ids(1))
    assert load_ok(store, 1, [1])[0] is False
    assert dump_ok(store, 2, [1]) is False
    store.close()


PERMISSION_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from ninfer_jax.store import JobDescriptor, OsApiError
    from ninfer_jax.store.posix import PosixStore
    from tests.store.helpers import empties, ids
    store = PosixStore()
    store.setup({{"root": {root!r}}})
    try:
        store.lookup(ids(1))
        print("lookup: no error")
    except OsApiError as e:
        print("lookup:", e)
    store.load(1, JobDescriptor(ids(1), empties(1)))
    print("load ok:", store.wait([1])[0].success)
    store.close()
""")


def test_unreadable_block_is_an_os_api_error_naming_the_path(tmp_path):
    store = posix_store(tmp_path)
    assert dump_ok(store, 1, [1])
    path = store.path_of(ids(1)[0])
    store.close()
    os.chmod(path, 0)
    command = [sys.executable, "-c", PERMISSION_CHILD.format(repo=str(REPO), root=str(tmp_path))]
    if os.geteuid() == 0:  # root reads anything unless it gives up the DAC capabilities
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_DAC_OVERRIDE")
        command = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", *command]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert f"lookup: OsApiError: posix: cannot open block file {path}" in out.stdout
    assert "load ok: False" in out.stdout
    os.chmod(path, 0o644)
    assert posix_store(tmp_path).lookup(ids(1)) == [True], "a permission problem is not rot"


def test_lookup_of_a_wrong_checksum_is_a_miss_and_never_served(tmp_path, caplog):
    store = posix_store(tmp_path)
    assert dump_ok(store, 1, [1, 2])
    path = store.path_of(ids(1)[0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # same size, same header: only the checksum can tell
    path.write_bytes(raw)
    assert within(BOUND_S, store.lookup, ids(1, 2)) == [False, True]
    assert len(store.quarantined()) == store.quarantine_count == 1 and not path.exists()
    assert f"block file {path} failed verification; moved to" in caplog.text  # counted, said
    assert load_ok(store, 2, [1])[0] is False


def test_load_of_a_wrong_checksum_fails_and_quarantines(tmp_path):
    store = posix_store(tmp_path)
    assert dump_ok(store, 1, [1])
    path = store.path_of(ids(1)[0])
    raw = bytearray(path.read_bytes())
    raw[40] ^= 0x01
    path.write_bytes(raw)
    assert load_ok(store, 2, [1])[0] is False
    assert store.lookup(ids(1)) == [False]
    assert len(store.quarantined()) == store.quarantine_count == 1


def test_a_remembered_verification_is_dropped_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(posix_module, "SETTLE_NS", 50_000_000)
    store = posix_store(tmp_path)
    assert dump_ok(store, 1, [1])
    block = ids(1)[0]
    assert store.lookup([block]) == [True]
    assert block not in store._verified, "a file changed just now was remembered (racy)"
    time.sleep(0.1)
    assert store.lookup([block]) == [True]
    assert block in store._verified
    path = store.path_of(block)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(raw)  # in place: same inode, same size, new mtime/ctime
    assert store.lookup([block]) == [False]
    assert len(store.quarantined()) == 1


# -- several stores on one root -----------------------------------------------------------------
def test_quarantine_never_moves_a_file_another_store_renamed_in_meanwhile(tmp_path):
    reader, writer = posix_store(tmp_path), posix_store(tmp_path)
    assert dump_ok(writer, 1, [1])
    path = reader.path_of(ids(1)[0])
    path.write_bytes(b"rot")  # the reader examines this corrupt file ...
    examined = identity(os.stat(path))
    assert dump_ok(writer, 2, [1])  # ... while the writer renames a good copy over it
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        quarantine(dir_fd, path.name, path, examined, tmp_path / "quarantine" / "x")
    finally:
        os.close(dir_fd)
    assert reader.lookup(ids(1)) == [True] and reader.quarantined() == []
    assert reader.quarantine_count == 0


def test_setup_keeps_live_writers_temps_and_clears_dead_ones(tmp_path):
    first = posix_store(tmp_path)
    tmp = tmp_path / "tmp"
    live = TempOwner(tmp)
    in_flight = live.temp_path()
    in_flight.write_bytes(b"half a block")  # as a write in progress would leave it
    second = posix_store(tmp_path)
    assert in_flight.exists(), "setup deleted a live writer's temp file"
    live.release()  # the owner is gone (a clean close never leaves temps; a crash does)
    third = posix_store(tmp_path)
    assert not in_flight.exists()
    for store in (first, second, third):
        store.close()
    assert list(tmp.iterdir()) == []


DEAD_OWNER_CHILD = textwrap.dedent("""
    import pathlib, sys, time
    sys.path.insert(0, {repo!r})
    from ninfer_jax.store.posix_files import TempOwner, identity, quarantine
    owner = TempOwner(pathlib.Path({tmp!r}))
    owner.temp_path().write_bytes(b"half")
    print("ready", flush=True)
    time.sleep(60)
""")


def test_a_killed_writers_temps_are_cleared_and_a_live_ones_kept(tmp_path):
    store = posix_store(tmp_path)
    tmp = tmp_path / "tmp"
    child = subprocess.Popen([sys.executable, "-c",
                              DEAD_OWNER_CHILD.format(repo=str(REPO), tmp=str(tmp))],
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"ready"
        posix_store(tmp_path).close()  # the child is alive: its lock and temp stay
        assert len([p for p in tmp.iterdir() if p.suffix == ".tmp"]) == 1
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    posix_store(tmp_path).close()
    left = [p.name for p in tmp.iterdir()]
    assert len(left) == 1 and left[0].endswith(".lock")  # only `store`'s own lock
    store.close()


def _hammer(root, seed, rounds, failures, stop=None):
    """Dumps shared (0-7) and own (seed*100 + 0-7) blocks, setting up a new store each round."""
    store = posix_store(root, num_threads=2)
    for r in range(rounds):
        if stop is not None and stop.is_set():
            break
        numbers = [r % 8, (r + 3) % 8, seed * 100 + r % 8]
        store.dump(r, JobDescriptor(ids(*numbers), payloads(numbers, 32 * 1024)))
        if not store.wait([r])[0].success:
            failures.append((seed, r))
        posix_store(root).close()  # a newcomer's setup must not touch in-flight writes
    store.close()


def _check_all(root, numbers):
    store = posix_store(root)
    assert store.lookup(ids(*numbers)) == [True] * len(numbers)
    outs = empties(len(numbers), 32 * 1024)
    store.load(999, JobDescriptor(ids(*numbers), outs))
    assert store.wait([999])[0].success
    for i, out in zip(numbers, outs):
        assert np.array_equal(out.buffers[0], block_data(i, 32 * 1024)), f"block {i} damaged"
    assert store.quarantined() == []
    store.close()


def test_two_stores_in_one_process_never_destroy_each_others_writes(tmp_path):
    failures: list = []
    threads = [threading.Thread(target=_hammer, args=(tmp_path, seed, 40, failures))
               for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a writer hung"
    assert failures == [], f"dumps failed: {failures}"
    _check_all(tmp_path, [*range(8), *range(100, 108), *range(200, 208)])


HAMMER_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from tests.store.test_posix_faults import _hammer
    failures = []
    _hammer({root!r}, 3, {rounds}, failures)
    print("failures", failures, flush=True)
""")


def test_two_processes_on_one_root_never_destroy_each_others_writes(tmp_path):
    child = subprocess.Popen([sys.executable, "-c",
                              HAMMER_CHILD.format(repo=str(REPO), root=str(tmp_path),
                                                  rounds=60)],
                             stdout=subprocess.PIPE, text=True)
    failures: list = []
    stop = threading.Event()
    mine = threading.Thread(target=_hammer, args=(tmp_path, 4, 60, failures, stop))
    mine.start()
    try:
        out, _ = child.communicate(timeout=90)
    finally:
        stop.set()
        mine.join(60)
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0 and "failures []" in out, out
    assert failures == [], f"dumps failed in the parent: {failures}"
    _check_all(tmp_path, [*range(8), *range(300, 308), *range(400, 408)])
