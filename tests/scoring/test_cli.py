"""`ninfer score` end to end in subprocesses: results, error lines, SIGKILL + resume, perplexity.

The model directory (`model_dir`) is the dense fixture with a byte-level tokenizer, so the
in-process reference is a Scorer with `ByteTokenizer`.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.scoring import Scorer
from tests.models.conftest import rel_err
from tests.scoring.conftest import WIDTH, core, scorer

CLI = [sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()", "score"]
COMMON = [f"--max_len={WIDTH}", f"--max_batch_tokens={3 * WIDTH}", "--chunk_records=4"]


BAD = [b'{"text": ""}', b'{"other": "x"}', b"not json",
       b'{"text": "' + b"y" * (WIDTH + 5) + b'"}', b'{"text": [1, 2, 900]}', b"", b'["a list"]',
       b'{"text": "\\ud800"}', b"\xff\xfe not UTF-8", b'{"text": [1, 99999999999999999999999]}',
       b'{"text": "the cat", "ctx": 5}', b"[" * 100_000]
REASONS = ("empty 'text'", "missing field 'text'", "not JSON", "too long", r"must be in [0, 384)",
           "not JSON", "must be a JSON object", "lone surrogate '\\ud800'", "not UTF-8: byte 0xff",
           "'text' must hold integer token ids", "'ctx' must be a string or a list",
           "nested too deeply")


def records(n: int, seed: int = 0) -> list[bytes]:
    """n input lines: texts, token-id lists, contexts, and every kind of bad record."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        kind = i % 5
        if kind == 4:
            lines.append(BAD[(i // 5) % len(BAD)])
        elif kind == 3:
            ids = rng.integers(0, 384, int(rng.integers(2, 41))).tolist()
            lines.append(json.dumps({"text": ids}).encode())
        else:
            words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"], int(rng.integers(1, 8))))
            rec = {"text": words, "id": i}
            if kind in (0, 2):  # one context, shared in a chunk when both pairs fit a window
                rec["ctx"] = "Once upon a time there, "
            lines.append(json.dumps(rec).encode())
    return lines


def write_input(path: pathlib.Path, n: int, seed: int = 0) -> pathlib.Path:
    path.write_bytes(b"\n".join(records(n, seed)) + b"\n")
    return path


def run_cli(model_dir, *args, check=True, **popen):
    cmd = [*CLI, f"--model={model_dir}", *COMMON, *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_results_and_error_lines(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", 5 * len(BAD))
    out = tmp_path / "out.jsonl"
    done = run_cli(model_dir, f"--input={src}", f"--output={out}", "--context_field=ctx")
    assert "rec" in done.stderr and "tok_s" in done.stderr  # the progress bar
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    inputs = src.read_bytes().splitlines()
    assert [x["index"] for x in lines] == list(range(len(inputs)))
    sc = scorer("dense")
    for line, rec in zip(lines, inputs):
        if lines.index(line) % 5 == 4:
            assert set(line) == {"index", "error"} and line["error"]
            continue
        assert "error" not in line, line
        rec = json.loads(rec)
        text, ctx = rec["text"], rec.get("ctx")
        if isinstance(text, list):
            [want] = sc.score(token_ids=[text])
        else:
            [want] = sc.score(texts=[text], contexts=[ctx])
        assert line["num_tokens"] == want.num_tokens
        # alone vs packed with the chunk's other records: equal up to rounding
        assert rel_err(np.float32(line["token_logprobs"]), want.token_logprobs) <= 1e-5
        assert line["sum_logprob"] == pytest.approx(want.sum_logprob, rel=1e-5)
        assert line["is_greedy"] == want.is_greedy
    errors = [lines[i]["error"] for i in range(4, len(lines), 5)]
    for reason, error in zip(REASONS, errors, strict=True):
        assert reason in error, (reason, error)


@pytest.mark.slow  # ~25 s; the full-disk test resumes in the default run
def test_sigkill_then_resume_equals_an_uninterrupted_run(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", 600)
    total = len(src.read_bytes().splitlines())
    clean, resumed = tmp_path / "clean.jsonl", tmp_path / "resumed.jsonl"
    run_cli(model_dir, f"--input={src}", f"--output={clean}")
    proc = run_cli(model_dir, f"--input={src}", f"--output={resumed}", env=os.environ.copy())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if resumed.exists() and resumed.read_bytes().count(b"\n") >= 20:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = resumed.read_bytes().count(b"\n")
    assert 20 <= written < total, f"the job was not interrupted mid-run ({written}/{total})"
    # Keep a part of the last chunk and a torn line, as a kill inside a chunk's write leaves.
    kept = resumed.read_bytes().splitlines(keepends=True)[: written - 2]
    resumed.write_bytes(b"".join(kept) + b'{"index": 99999, "num_tok')
    run_cli(model_dir, f"--input={src}", f"--output={resumed}")
    assert resumed.read_bytes() == clean.read_bytes()
    again = run_cli(model_dir, f"--input={src}", f"--output={resumed}")
    assert "is complete" in again.stderr and resumed.read_bytes() == clean.read_bytes()


def score_in_process(model_dir, *args: str) -> int:
    """`ninfer score` through `cli.main`, the console script's own entry, in this process."""
    from ninfer_jax.gateway import cli

    return cli.main(["ninfer", "score", f"--model={model_dir}", *COMMON, *args])


def test_resume_refuses_the_output_of_another_job(model_dir, tmp_path, capsys):
    a, b = write_input(tmp_path / "a.jsonl", 10), write_input(tmp_path / "b.jsonl", 10, seed=1)
    out = tmp_path / "out.jsonl"
    assert score_in_process(model_dir, f"--input={a}", f"--output={out}") == 0
    clean = out.read_bytes()
    other_model = tmp_path / "other_model"
    shutil.copytree(model_dir, other_model)
    weights = bytearray((other_model / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (other_model / "model.safetensors").write_bytes(bytes(weights))
    torn = b"".join(clean.splitlines(keepends=True)[:3]) + b'{"index": 3, "num'
    for content in (clean, torn):  # a complete foreign output, a partial one
        out.write_bytes(content)
        for args, differs in [
            ((f"--input={b}",), "--input differs"),  # same record count, other bytes
            ((f"--input={a}", "--max_batch_tokens=80"), "--max_batch_tokens differs"),
            ((f"--input={a}", "--context_field=ctx"), "--context_field differs"),
            ((f"--input={a}", "--chunk_records=5"), "--chunk_records differs"),
        ]:
            capsys.readouterr()
            assert score_in_process(model_dir, *args, f"--output={out}") == 1
            err = capsys.readouterr().err
            assert differs in err and "refusing to resume" in err and "Traceback" not in err
            assert out.read_bytes() == content  # untouched: no cut, no append
        from ninfer_jax.gateway import cli

        assert cli.main(["ninfer", "score", f"--model={other_model}", *COMMON, f"--input={a}",
                         f"--output={out}"]) == 1
        assert "--model differs" in capsys.readouterr().err and out.read_bytes() == content
    # The input edited in place (same path, same record count, other bytes) is another input.
    saved_a = a.read_bytes()
    a.write_bytes(b.read_bytes())
    assert score_in_process(model_dir, f"--input={a}", f"--output={out}") == 1
    assert "--input differs" in capsys.readouterr().err and out.read_bytes() == torn
    a.write_bytes(saved_a)
    job = out.with_name(out.name + ".job.json")
    saved = job.read_bytes()
    job.unlink()
    assert score_in_process(model_dir, f"--input={a}", f"--output={out}") == 1
    assert "no job file" in capsys.readouterr().err and out.read_bytes() == torn
    job.write_bytes(saved)
    # The same model and input under other paths are the same job: it resumes to the same bytes.
    same_model, same_input = tmp_path / "same_model", tmp_path / "moved.jsonl"
    shutil.copytree(model_dir, same_model)
    shutil.copyfile(a, same_input)
    assert score_in_process(same_model, f"--input={same_input}", f"--output={out}") == 0
    assert out.read_bytes() == clean


# Caps the size of every file the command writes (RLIMIT_FSIZE, SIGXFSZ ignored so a write past
# it fails with EFBIG, as a full disk fails one), then execs it.
_FILE_LIMIT_THEN_EXEC = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
os.execv(sys.argv[2], sys.argv[2:])
"""


def test_a_full_disk_ends_the_job_with_an_error_and_a_resumable_output(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", 30)
    clean, out = tmp_path / "clean.jsonl", tmp_path / "out.jsonl"
    assert score_in_process(model_dir, f"--input={src}", f"--output={clean}") == 0
    limit = 3000
    assert len(clean.read_bytes()) > 2 * limit
    done = subprocess.run([sys.executable, "-c", _FILE_LIMIT_THEN_EXEC, str(limit), *CLI,
                           f"--model={model_dir}", *COMMON, f"--input={src}", f"--output={out}"],
                          check=False, capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(errors) == 1 and "--output" in errors[0] and "File too large" in errors[0]
    assert 0 < out.stat().st_size <= limit
    assert score_in_process(model_dir, f"--input={src}", f"--output={out}") == 0
    assert out.read_bytes() == clean.read_bytes()


@pytest.fixture
def byte_scorer(model_dir):
    """The scorer `ninfer score` opens on `model_dir` (its HF tokenizer), with the job's flags
    parsed as `--context_field=ctx`."""
    from absl import flags

    from ninfer_jax.frontend import load_tokenizer
    from ninfer_jax.gateway import cli  # noqa: F401 - defines the flags

    flags.FLAGS.unparse_flags()
    flags.FLAGS(["ninfer", "--context_field=ctx"])
    try:
        yield Scorer(core("dense"), load_tokenizer(model_dir))
    finally:
        flags.FLAGS.unparse_flags()


ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)
FIELD = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), ANY_TEXT,
                  st.lists(st.integers(min_value=-2**70, max_value=2**70), max_size=6),
                  st.lists(ANY_TEXT | st.floats(), max_size=3), st.dictionaries(ANY_TEXT, ANY_TEXT))


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=40) | st.fixed_dictionaries({}, optional={"text": FIELD, "ctx": FIELD})
       .map(lambda r: json.dumps(r).encode()))
def test_any_record_is_a_request_or_its_error(byte_scorer, line):
    from ninfer_jax.gateway.score import _prepare
    from ninfer_jax.scoring import ScoreRequest

    prepared = _prepare(byte_scorer, line)
    assert isinstance(prepared, ScoreRequest) or (isinstance(prepared, str) and prepared)
    if isinstance(prepared, str):
        assert not prepared.startswith(("TypeError", "RuntimeError", "OverflowError")), prepared


def test_corpus_perplexity(model_dir, tmp_path):
    text = "The cat sat on the mat. " * 9
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    done = run_cli(model_dir, f"--perplexity={path}", f"--window={WIDTH}", "--stride=20")
    report = json.loads(done.stdout)
    assert report["num_tokens"] == len(text) - 1 and (report["window"], report["stride"]) == (40, 20)
    want = scorer("dense", window=WIDTH, stride=20).perplexity(text)
    assert report["perplexity"] == pytest.approx(want, rel=1e-9)


def test_missing_flags_are_a_usage_error(model_dir):
    done = run_cli(model_dir, check=False)
    assert done.returncode != 0 and "--input" in done.stderr
