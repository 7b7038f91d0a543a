"""`ninfer score` end to end in subprocesses: results, error lines, SIGKILL + resume, perplexity.

The model directory (`model_dir`) is the dense fixture with a byte-level tokenizer, so the
in-process reference is a Scorer with `ByteTokenizer`.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.scoring.conftest import WIDTH, scorer

CLI = [sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()", "score"]
COMMON = [f"--max_len={WIDTH}", f"--max_batch_tokens={3 * WIDTH}", "--chunk_records=4"]


def records(n: int, seed: int = 0) -> list[str]:
    """n input lines: texts, token-id lists, contexts, and every kind of bad record."""
    rng = np.random.default_rng(seed)
    bad = ['{"text": ""}', '{"other": "x"}', "not json", '{"text": "' + "y" * (WIDTH + 5) + '"}',
           '{"text": [1, 2, 900]}', "", '["a list"]']
    lines = []
    for i in range(n):
        kind = i % 5
        if kind == 4:
            lines.append(bad[(i // 5) % len(bad)])
        elif kind == 3:
            lines.append(json.dumps({"text": rng.integers(0, 384, int(rng.integers(2, 41))).tolist()}))
        else:
            words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"], int(rng.integers(1, 8))))
            rec = {"text": words, "id": i}
            if kind == 2:
                rec["ctx"] = "Once upon a time, "
            lines.append(json.dumps(rec))
    return lines


def write_input(path: pathlib.Path, n: int) -> pathlib.Path:
    path.write_text("\n".join(records(n)) + "\n")
    return path


def run_cli(model_dir, *args, check=True, **popen):
    cmd = [*CLI, f"--model={model_dir}", *COMMON, *args]
    if popen:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_results_and_error_lines(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out.jsonl"
    done = run_cli(model_dir, f"--input={src}", f"--output={out}", "--context_field=ctx")
    assert "rec" in done.stderr and "tok_s" in done.stderr  # the progress bar
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    inputs = src.read_text().splitlines()
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
        np.testing.assert_array_equal(np.float32(line["token_logprobs"]), want.token_logprobs)
        assert line["sum_logprob"] == pytest.approx(want.sum_logprob, rel=1e-12)
        assert line["is_greedy"] == want.is_greedy
    errors = [lines[i]["error"] for i in range(4, 40, 5)]
    for reason in ("empty 'text'", "missing field 'text'", "not JSON", "too long",
                   r"must be in [0, 384)", "not JSON", "must be a JSON object"):
        assert any(reason in e for e in errors), (reason, errors)


def test_sigkill_then_resume_equals_an_uninterrupted_run(model_dir, tmp_path):
    src = write_input(tmp_path / "in.jsonl", 600)
    total = len(src.read_text().splitlines())
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
