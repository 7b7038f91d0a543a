"""The `tiers` benchmark suite through `scripts/bench.py` (a subprocess) on the tiny config: every
source present in every repetition, in turn; every answer equal to recompute's; reloads served
by the tier they name; the summary agrees with the per-turn numbers. A one-token follow-up
makes the answer depend on the reloaded GDN state as well as the K/V pages: zeroing either in
`Program._run_import` fails the suite test."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from scripts.benchmarks import tiers
from scripts.benchmarks._env import SettingError
from tests.conftest import REPO

SOURCES = ["device", "host", "disk", "redis", "recompute"]
HISTORY = 64
SETTINGS = {"BENCH_TIERS_MODEL": "tiny", "BENCH_TIERS_HISTORY": str(HISTORY),
            "BENCH_TIERS_FOLLOW_UP": "1", "BENCH_TIERS_NEW_TOKENS": "4", "BENCH_TIERS_REPS": "2",
            "BENCH_TIERS_WARMUP": "1", "BENCH_TIERS_PREFILL_CHUNK": "16"}


def _bench(tmp_path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--suite=tiers",
                           f"--out={tmp_path}"], env=full, capture_output=True, text=True,
                          timeout=600, check=False)


@pytest.mark.slow  # about 20 s with a warm compilation cache, 56 s cold at load 5
def test_tiny_tiers_suite(tmp_path):
    proc = _bench(tmp_path, **SETTINGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "tiers.json").read_text())
    assert r["errors"] == [] and r["identical_tokens"] is True
    assert list(r["sources"]) == SOURCES
    assert [x["warmup"] for x in r["repetitions"]] == [True, False, False]
    served = {"host": ["cache"], "disk": ["posix"], "redis": ["redis"]}
    for rep in r["repetitions"]:
        turns = {t["source"]: t for t in rep["turns"]}
        assert [t["source"] for t in rep["turns"]] == SOURCES  # in turn, in this order
        recompute = turns["recompute"]
        assert recompute["cached_tokens"] == 0 and len(recompute["tokens"]) == 4
        for src in SOURCES[:-1]:
            assert turns[src]["tokens"] == recompute["tokens"]
            assert turns[src]["cached_tokens"] == HISTORY
            assert turns[src]["served_by"] == served.get(src, [])
            assert turns[src]["reloads"] == (src in served)
    measured = r["repetitions"][1:]
    for src in SOURCES:
        ttft = [next(t for t in rep["turns"] if t["source"] == src)["ttft_s"] for rep in measured]
        ratios = [t / rep["turns"][-1]["ttft_s"] for t, rep in zip(ttft, measured)]
        s = r["sources"][src]
        assert s["ttft_s"] == {"median": statistics.median(ttft), "min": min(ttft),
                               "max": max(ttft)}
        assert s["ratio_to_recompute"]["median"] == pytest.approx(statistics.median(ratios))
        assert (s["reload_s"] is not None) == (src in served)
    assert r["sources"]["recompute"]["ratio_to_recompute"] == {"median": 1, "min": 1, "max": 1}
    b = r["bytes_per_checkpoint"]
    assert b["kv_blocks"] == HISTORY // 16 and b["state_blocks"] >= 1
    assert b["layout_total_bytes"] == (b["kv_blocks"] + b["state_blocks"]) * b["block_bytes"]
    for written in b["bytes_written_per_history"].values():
        assert written == [b["layout_total_bytes"]] * 2  # a fresh history: every block is new
    assert [(t["source"], t["met"]) for t in r["targets"]] == [
        (t["source"], t["median_ratio"] <= t["max_ratio_to_recompute"]) for t in r["targets"]]
    assert [t["source"] for t in r["targets"]] == ["host", "disk"]
    assert any("page cache" in note for note in r["notes"])
    for src in SOURCES:
        assert any(line.startswith(src) for line in proc.stdout.splitlines()), proc.stdout


@pytest.mark.slow  # as the suite above
def test_tiny_tiers_suite_with_int8_kv_pages(tmp_path):
    """INT8 K/V pages (their scales in every block) reloaded from each tier give recompute's
    tokens; a block is a page's int8 K and V and float32 scales (and a tag)."""
    proc = _bench(tmp_path, **{**SETTINGS, "BENCH_TIERS_KV_DTYPE": "int8", "BENCH_TIERS_REPS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "tiers.json").read_text())
    assert r["errors"] == [] and r["identical_tokens"] is True
    assert r["program_config"]["kv_dtype"] == "int8"
    for rep in r["repetitions"]:
        turns = {t["source"]: t for t in rep["turns"]}
        for src in SOURCES[:-1]:
            assert turns[src]["tokens"] == turns["recompute"]["tokens"]
            assert turns[src]["cached_tokens"] == HISTORY
            assert turns[src]["reloads"] == (src in ("host", "disk", "redis"))
    cfg = tiers._model_config("tiny")
    per_position = cfg.num_kv_heads * (2 * cfg.head_dim + 2 * 4)  # int8 K, V; fp32 scales
    page = cfg.num_attention_layers * 16 * per_position
    assert r["bytes_per_checkpoint"]["block_bytes"] == page + 16  # and the tag


@pytest.mark.parametrize("env, message", [
    ({"BENCH_TIERS_HISTORY": "0"}, "BENCH_TIERS_HISTORY must be >= 1"),
    ({"BENCH_TIERS_REPS": "x"}, "BENCH_TIERS_REPS must be an integer"),
    ({"BENCH_TIERS_MODEL": "huge"}, "BENCH_TIERS_MODEL must be one of"),
    ({"BENCH_TIERS_MODEL": "tiny", "BENCH_TIERS_HISTORY": "4090"},
     "BENCH_TIERS_HISTORY + BENCH_TIERS_FOLLOW_UP + BENCH_TIERS_NEW_TOKENS must be <= 4096"),
    ({"BENCH_TIERS_HISTORY": "8", "BENCH_TIERS_FOLLOW_UP": "4"},
     "BENCH_TIERS_PREFILL_CHUNK must be <= 16"),
    ({"BENCH_TIERS_KV_DTYPE": "int4"}, "BENCH_TIERS_KV_DTYPE must be one of"),
])
def test_bad_setting_names_the_variable(monkeypatch, env, message):
    for name in list(os.environ):
        if name.startswith("BENCH_TIERS_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingError, match=re.escape(message)):
        tiers.Settings.from_env()
