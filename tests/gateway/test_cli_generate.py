"""`ninfer generate` and `ninfer chat` on the embedded demo model, as a user runs them; the
JSONL window (queue capacity, one answer per line, in order) over the FakeProgram Engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ninfer_jax.gateway import generate
from ninfer_jax.gateway.files import iter_lines
from tests.conftest import REPO
from tests.gateway.conftest import assert_fully_free, make_engine

COMMON = ["--max_new_tokens=12", "--temperature=0", "--max_concurrency=2", "--max_seq_len=256"]


def _ninfer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", *args], check=False,
                          capture_output=True, text=True, input=stdin, cwd=REPO, timeout=600)


def test_generate_streams_answers_and_reports_throughput(tmp_path):
    out = _ninfer("generate", "--prompt=Once upon a time", "--prompt=Tom had a dog", *COMMON)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("--- [") == 2 and len(out.stdout.split()) > 10
    assert "tok/s" in out.stderr and "prefix-hit tokens" in out.stderr
    assert ("(cpu: dtype float32, attention reference, GDN reference, max_concurrency"
            in out.stderr)  # auto
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "Tell a story"}]})
                     + "\n")
    out = _ninfer("generate", f"--input_jsonl={jsonl}", *COMMON)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1] and all(r["text"] for r in rows)
    bad = _ninfer("generate", "--prompt=x", "--top_p=1.5", *COMMON)
    assert bad.returncode != 0 and "top_p must be" in bad.stderr


def test_chat_keeps_history_and_reuses_it():
    out = _ninfer("chat", *COMMON, stdin="Tell me a story\nAnd then?\n/exit\n")
    assert out.returncode == 0, out.stderr
    turns = [line for line in out.stderr.splitlines() if "TTFT" in line]
    assert len(turns) == 2
    assert "cached 0" in turns[0] and "cached 0" not in turns[1]  # the second turn hit


@pytest.mark.slow  # ~35 s; the Engine's and the HTTP API's image tests stay in the default run
def test_generate_and_chat_take_images_on_a_vision_model():
    from ninfer_jax.api import Engine
    from ninfer_jax.sampling_params import SamplingParams
    from tests.conftest import FIXTURES

    model, image = FIXTURES / "vision", FIXTURES / "vision" / "images" / "grad_64x48.png"
    args = (f"--model={model}", "--max_new_tokens=6", "--temperature=0", "--max_seq_len=256",
            "--max_concurrency=1", "--enable_thinking=false")
    out = _ninfer("generate", f"--image={image}", "--prompt=What is it?", *args)
    assert out.returncode == 0, out.stderr
    with Engine.open(model, max_concurrency=1, max_seq_len=256) as e:
        want = e.generate(messages=[{"role": "user", "content": [
            {"type": "image", "image": str(image)}, {"type": "text", "text": "What is it?"}]}],
            enable_thinking=False, sampling=SamplingParams(max_new_tokens=6, temperature=0))
    assert out.stdout.rstrip("\n") == want.text
    chat = _ninfer("chat", *args, stdin=f"/image {image}\nWhat is it?\n/image /no/such.png\n"
                                        "And now?\nok\n/exit\n")
    assert chat.returncode != 0  # the turn naming a missing file failed, the others ran
    assert "messages[2].content[0].image: no such file '/no/such.png'" in chat.stderr
    assert sum("TTFT" in line for line in chat.stderr.splitlines()) == 2
    assert chat.stdout.splitlines()[0] == want.text


# One of every kind of JSONL line that cannot run, each of which must get its own error line.
BAD_LINES = [
    b"",  # blank
    b"not json",
    b"\xff\xfe not UTF-8",
    b'{"prompt": "\\ud800 lone surrogate"}',
    b'{"prompt": 5}',
    b'{"messages": [{"role": "user", "content": 5}]}',  # the Frontend refuses it at submit
    b'{"prompt": "a", "messages": []}',
    b"[" * 100_000,  # deeper than the JSON parser's recursion limit
    b'["a list"]',
]


def _jsonl(path, n: int) -> list[bool]:
    """Writes n lines, every 7th a bad one; returns which lines are good."""
    lines, good = [], []
    for i in range(n):
        if i % 7 == 3:
            lines.append(BAD_LINES[(i // 7) % len(BAD_LINES)])
        else:
            lines.append(json.dumps({"prompt": f"story {i}"}).encode())
        good.append(i % 7 != 3)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return good


def test_jsonl_keeps_at_most_the_queue_capacity_outstanding(tmp_path):
    engine = make_engine(max_concurrency=2, max_queue=3, step_seconds=0.001)
    good = _jsonl(tmp_path / "in.jsonl", 40)
    submitted = consumed = most = 0

    def submit(req):
        nonlocal submitted, most
        handle = engine.submit(req.get("prompt"), messages=req.get("messages"),
                               sampling={"max_new_tokens": 3})
        submitted += 1
        most = max(most, submitted - consumed)
        return handle

    try:
        capacity = engine.stats().capacity
        requests = generate._jsonl_requests(iter_lines("input_jsonl", tmp_path / "in.jsonl"))
        answers = []
        for index, outcome in generate.submit_windowed(capacity, requests, submit):
            line, result = generate._answer_line(index, outcome)
            consumed += result is not None
            answers.append(json.loads(line))
        assert [a["index"] for a in answers] == list(range(40))
        for a, ok in zip(answers, good):
            assert (a["error"] is None) if ok else (set(a) == {"index", "error"} and a["error"])
        assert capacity == 3 and most == capacity
        assert_fully_free(engine)
    finally:
        engine.close()


def test_jsonl_longer_than_the_queue_gets_one_answer_per_line(tmp_path):
    path = tmp_path / "in.jsonl"
    good = _jsonl(path, 70)  # the Engine's queue holds 64
    out = _ninfer("generate", f"--input_jsonl={path}", *COMMON[1:], "--max_new_tokens=2")
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in rows] == list(range(70)), out.stderr
    assert [r["error"] is None for r in rows] == good
    assert "not UTF-8" in rows[17]["error"] and "lone surrogate" in rows[24]["error"]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and errors == ["error: 10 of 70 requests failed"]


@pytest.mark.slow  # ~8 s: a process; the jsonl job's bad lines are tested above
def test_chat_skips_a_line_that_is_not_utf8():
    out = subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", "chat", *COMMON],
                         check=False, capture_output=True, cwd=REPO, timeout=600,
                         input=b"Tell me a story\n\xff\xfe\n/exit\n")
    err = out.stderr.decode()
    assert "Traceback" not in err and err.count("TTFT") == 1
    assert "not UTF-8" in err and out.returncode == 1
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: 1 chat turn(s) failed"]
