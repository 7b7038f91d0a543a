"""`ninfer generate` and `ninfer chat` on the embedded demo model, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

COMMON = ["--max_new_tokens=12", "--temperature=0", "--max_concurrency=2", "--max_seq_len=256"]


def _ninfer(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", *args],
                          capture_output=True, text=True, input=stdin, cwd=REPO, timeout=600)


def test_generate_streams_answers_and_reports_throughput(tmp_path):
    out = _ninfer("generate", "--prompt=Once upon a time", "--prompt=Tom had a dog", *COMMON)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("--- [") == 2 and len(out.stdout.split()) > 10
    assert "tok/s" in out.stderr and "prefix-hit tokens" in out.stderr
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
