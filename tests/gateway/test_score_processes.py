"""`ninfer score --num_processes=2`: two local processes joined by jax.distributed score one job
on the demo model (short texts packed, shared contexts scored once); the output is
byte-identical to a one-process run's, also after one process is SIGKILLed and both are
restarted; bad process flags are usage errors.

Every subprocess runs under a timeout, so a hang fails the test. Processes other than 0 compile
their window executable on every start (jax keys the CPU cache by device and writes it from
process 0 only), which is most of each two-process run's time here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

CLI = [sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()", "score"]
FLAGS = ["--max_len=64", "--max_batch_tokens=256", "--chunk_records=4", "--context_field=ctx"]
NUM_RECORDS = 48
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def job(shared_data, tmp_path_factory):
    """(input, the one-process output's bytes): 48 short TinyStories sentences, three of every
    four after a context they share (a longer sentence): every chunk packs short texts and
    scores a shared context once."""
    text = (shared_data / "tinystories" / "valid_head_cased.txt").read_text(encoding="utf-8")
    split = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    sentences = [s for s in split if 10 < len(s) < 100]
    contexts = [s for s in split if 120 < len(s) < 150]
    directory = tmp_path_factory.mktemp("score_processes")
    src = directory / "in.jsonl"
    records = [{"text": s} if i % 4 == 3 else {"text": " " + s, "ctx": contexts[i // 4]}
               for i, s in enumerate(sentences[:NUM_RECORDS])]
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = directory / "one.jsonl"
    done = subprocess.run([*CLI, *FLAGS, f"--input={src}", f"--output={out}"], check=False,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"window fill \d+%, \d+ continuations of \d+ shared contexts",
                     done.stderr), done.stderr[-2000:]
    assert out.read_bytes().count(b"\n") == NUM_RECORDS
    return src, out.read_bytes()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(src, out) -> list[subprocess.Popen]:
    """Both processes of a two-process run, on a fresh coordinator port."""
    port = free_port()
    return [subprocess.Popen([*CLI, *FLAGS, f"--input={src}", f"--output={out}",
                              "--num_processes=2", f"--process_id={pid}",
                              f"--coordinator=127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for pid in range(2)]


def finish(procs: list[subprocess.Popen]) -> list[str]:
    """Waits for every process (TIMEOUT_S in all; then all are killed and the test fails);
    returns their stderr. Each must exit 0."""
    deadline = time.monotonic() + TIMEOUT_S
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[1])
    except subprocess.TimeoutExpired:
        pytest.fail("a scoring process did not finish in time (hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    return errs


def scored(errs: list[str]) -> int:
    """Records the processes scored in their run, from their report lines."""
    return sum(int(m) for err in errs for m in re.findall(r"process \d of 2: (\d+) records", err))


@pytest.mark.slow  # ~50 s: three processes; one process's job is tests/scoring/test_cli.py's
def test_two_processes_equal_one(job, tmp_path):
    src, one = job
    out = tmp_path / "two.jsonl"
    errs = finish(start(src, out))
    assert out.read_bytes() == one
    assert scored(errs) == NUM_RECORDS and "merged 2 parts" in errs[0]
    assert not (tmp_path / "two.jsonl.parts").exists()
    recorded = json.loads((tmp_path / "two.jsonl.job.json").read_bytes())["settings"]
    assert recorded["num_processes"] == 2
    # Resuming it with another process count is refused, naming the flag; the output stays.
    done = subprocess.run([*CLI, *FLAGS, f"--input={src}", f"--output={out}"], check=False,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1 and "--num_processes differs" in done.stderr, done.stderr
    assert "--num_processes=2" in done.stderr and out.read_bytes() == one


@pytest.mark.slow  # ~25 s; two processes equal one stays in the default run
def test_sigkill_then_restart_equals_one_process(job, tmp_path):
    src, one = job
    out = tmp_path / "two.jsonl"
    parts = tmp_path / "two.jsonl.parts"
    procs = start(src, out)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        victim = None
        while victim is None and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), "a process ended before the kill"
            for pid in range(2):
                part = parts / f"part-{pid}-of-2.jsonl"
                if part.exists() and part.read_bytes().count(b"\n") >= 4:  # one chunk
                    victim = pid
            time.sleep(0.005)
        assert victim is not None, "no part was written in time"
        procs[victim].send_signal(signal.SIGKILL)
        procs[1 - victim].send_signal(signal.SIGKILL)
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert not out.exists(), "the job finished before it was killed"
    held = sum(path.read_bytes().count(b"\n") for path in parts.iterdir())
    assert 4 <= held < NUM_RECORDS
    part = parts / f"part-{victim}-of-2.jsonl"
    with open(part, "ab") as f:  # a torn line, as a kill inside a chunk's write leaves
        f.write(b'{"index": 99999, "num_tok')
    errs = finish(start(src, out))
    assert out.read_bytes() == one
    assert scored(errs) == NUM_RECORDS - held  # the chunks in the parts were not rescored
    again = finish(start(src, out))
    assert all("is complete" in err for err in again) and out.read_bytes() == one


@pytest.mark.parametrize("flags, names", [
    (["--num_processes=2", "--process_id=2", "--coordinator=127.0.0.1:1234"], "--process_id"),
    (["--num_processes=2", "--process_id=1"], "--coordinator"),
    (["--num_processes=2", "--coordinator=localhost"], "--coordinator"),
    (["--coordinator=127.0.0.1:1234"], "--coordinator"),
    (["--process_id=1"], "--process_id"),
])
def test_bad_process_flags_are_usage_errors(tmp_path, capsys, flags, names):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "Once upon a time"}\n')
    out = tmp_path / "out.jsonl"
    from ninfer_jax.gateway import cli

    start = time.monotonic()
    status = cli.main(["ninfer", "score", f"--input={src}", f"--output={out}", *flags])
    err = capsys.readouterr().err
    assert status == 2 and names in err and err.startswith("error:"), err
    assert time.monotonic() - start < 10 and not out.exists()
    assert not os.path.exists(str(out) + ".job.json")
