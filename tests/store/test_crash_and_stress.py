"""Crash safety of the posix store, concurrency stress, and the no-jax import rule."""

import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from ninfer_jax.store import JobDescriptor
from ninfer_jax.store.posix import PosixStore
from tests.store.helpers import BLOCK_BYTES, block_data, cache_store, empties, ids, payloads

REPO = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 64 * 1024
CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    from tests.store.crash_child import main
    main({root!r}, {seed})
""")


def expected(i: int) -> bytes:
    return block_data(i, BLOCK).tobytes()


@pytest.mark.parametrize("kills", [12, pytest.param(60, marks=pytest.mark.slow)])
def test_sigkill_during_posix_dumps_never_leaves_torn_blocks(tmp_path, kills):
    rng = random.Random(7)
    for round_ in range(kills):
        proc = subprocess.Popen([sys.executable, "-c",
                                 CHILD.format(repo=str(REPO), root=str(tmp_path), seed=round_)],
                                stdout=subprocess.PIPE)
        proc.stdout.readline()  # the child is set up and writing
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        store = PosixStore()
        store.setup({"root": str(tmp_path)})
        keys = list(range(16))
        hits = store.lookup(ids(*keys))
        present = [k for k, hit in zip(keys, hits) if hit]
        outs = empties(len(present), BLOCK)
        store.load(round_, JobDescriptor(ids(*present), outs))
        assert store.wait([round_])[0].success
        for k, out in zip(present, outs):
            assert out.buffers[0].tobytes() == expected(k), f"round {round_}: block {k} torn"
        assert store.quarantined() == []
        store.close()


def test_concurrent_jobs_lose_no_completion_and_never_evict_pinned_blocks():
    store = cache_store(capacity=8)
    facet = store.as_token_addressed()
    lock = threading.Lock()  # control-plane calls are serialized by the caller
    seen: list[int] = []
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        try:
            for step in range(150):
                job = t * 1000 + step
                block = rng.randrange(12)
                with lock:
                    try:
                        token = facet.alloc(ids(block), None)
                    except Exception:
                        continue
                facet.dump(job, JobDescriptor(ids(block), payloads([block])), token)
                result = store.wait([job])
                with lock:
                    facet.commit(ids(block), result[0].success)
                    seen.append(job)
                    try:
                        token = facet.pin(ids(block))
                    except Exception:
                        continue
                out = empties(1)
                facet.load(job + 500, JobDescriptor(ids(block), out), token)
                assert store.buffer.slot_of(ids(block)[0]) is not None
                assert store.wait([job + 500])[0].success
                with lock:
                    assert store.lookup(ids(block)) == [True], "pinned block evicted"
                    facet.unpin(ids(block))
                    seen.append(job + 500)
                np.testing.assert_array_equal(out[0].buffers[0], block_data(block, BLOCK_BYTES))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(seen) == len(set(seen))
    assert store.jobs.num_unconsumed() == 0 and store.get_finished() == []
    store.close()


def test_importing_the_store_imports_no_jax():
    code = textwrap.dedent("""
        import pkgutil, sys
        import ninfer_jax.store as store
        for info in pkgutil.walk_packages(store.__path__, "ninfer_jax.store."):
            __import__(info.name)
        bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
