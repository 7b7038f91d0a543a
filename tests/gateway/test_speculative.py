"""Speculative decoding at the gateway: `ninfer generate --speculative=mtp` and
`--speculative=dflash` (the shipped drafter, found without a flag) on the demo model print
exactly what they print without speculation, and `--stats` reports the acceptance; a model
without MTP weights refuses `--speculative=mtp`, and one without a drafter
`--speculative=dflash`, each with one `error:` line; `/metrics` exposes the
Engine's speculative statistics (an Engine over the FakeProgram with rounds of up to 3 tokens).
The flag usage errors are in test_cli_errors.py's table."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from ninfer_jax.artifact.export import export_hf
from ninfer_jax.gateway import cli
from ninfer_jax.loader import DEFAULT_MODEL, load_model
from tests.conftest import REPO
from tests.gateway.conftest import MODEL, make_engine, served, wait_idle
from tests.gateway.test_cli_generate import COMMON

# test_cli_generate's first command: its executables are in the compilation cache already.
PROMPTS = ["--prompt=Once upon a time", "--prompt=Tom had a dog"]
STATS = re.compile(r"^\[ninfer\] stats: generated (\d+) tokens, finished 2 requests, .*; "
                   r"speculative mtp K=2: (\d+) verify rows, mean accepted tokens ([\d.]+), "
                   r"acceptance by position \[([\d.]+), ([\d.]+)\](?:, rounds by K \{[\d:, ]*\}, "
                   r"estimated gain [\d.]+x)?; context store cache: \d+ "
                   r"checkpoints written \(\d+ bytes\), \d+ reloaded \[.*\]$", re.MULTILINE)


def _ninfer(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", *args], check=False,
                          capture_output=True, text=True, cwd=REPO, timeout=600)


DFLASH_STATS = re.compile(r"; speculative dflash K=6: (\d+) verify rows, mean accepted tokens "
                          r"([\d.]+), acceptance by position \[([\d., ]+)\]")


@pytest.mark.slow  # ~70 s (three CLI runs); the engines' greedy tests stay in the default run
def test_generate_with_mtp_and_dflash_prints_the_same_text_and_the_stats():
    off = _ninfer("generate", *PROMPTS, *COMMON, "--stats")
    mtp = _ninfer("generate", *PROMPTS, *COMMON, "--stats", "--speculative=mtp",
                  "--num_speculative_tokens=2")
    dflash = _ninfer("generate", *PROMPTS, *COMMON, "--stats", "--speculative=dflash",
                     "--num_speculative_tokens=6")
    for run in (off, mtp, dflash):
        assert run.returncode == 0, run.stderr
    assert mtp.stdout == off.stdout == dflash.stdout and off.stdout.count("--- [") == 2
    assert "; speculative off" in off.stderr
    found = STATS.search(mtp.stderr)
    assert found, mtp.stderr
    generated, rows, mean, *rates = found.groups()
    assert int(generated) == 24 and int(rows) > 0
    assert 1 <= float(mean) <= 3 and all(0 <= float(r) <= 1 for r in rates)
    assert "speculative dflash K=6)" in dflash.stderr  # the ready line
    found = DFLASH_STATS.search(dflash.stderr)
    assert found, dflash.stderr
    rows, mean, rates = found.groups()
    assert int(rows) > 0 and 1.5 <= float(mean) <= 7 and len(rates.split(", ")) == 6


@pytest.fixture(scope="module")
def model_without_mtp(tmp_path_factory):
    """The demo model and its tokenizer, without the MTP head's weights."""
    m = load_model()
    params = {name: tree for name, tree in m.params.items() if name != "mtp"}
    return export_hf(m.config, params, tmp_path_factory.mktemp("no_mtp") / "model",
                     frontend_dir=DEFAULT_MODEL)


def test_mtp_on_a_model_without_mtp_weights_is_one_error_line(model_without_mtp, capsys):
    argv = ["ninfer", "generate", "--prompt=x", "--speculative=mtp", f"--model={model_without_mtp}"]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert "speculative" in errors[0] and "MTP weights" in errors[0]


def test_dflash_on_a_model_without_a_drafter_is_one_error_line(model_without_mtp, capsys):
    argv = ["ninfer", "generate", "--prompt=x", "--speculative=dflash",
            f"--model={model_without_mtp}"]
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert "needs a DFlash drafter" in errors[0] and "--drafter" in errors[0]


def _metrics(url: str) -> dict[str, float]:
    """name{labels} -> value of every ninfer_speculative_* sample."""
    text = httpx.get(f"{url}/metrics").text
    return {key: float(value) for key, value in
            (line.rsplit(" ", 1) for line in text.splitlines()
             if line.startswith("ninfer_speculative_"))}


def test_metrics_expose_the_speculative_statistics():
    """An Engine whose rounds may draft 0, 1 or 2 tokens (the adaptive policy); one request
    asks for no speculation with the `speculative` extension field."""
    with served(make_engine(verify_width=3, eos=False, round_drafts=(0, 1, 2))) as server:
        for i in range(4):
            r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"story {i}", "max_tokens": 24, "temperature": 0,
                **({"speculative": False} if i == 3 else {})})
            assert r.status_code == 200, r.text
        r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "x", "speculative": "no"})
        assert r.status_code == 400 and "speculative" in r.text, r.text
        spec = wait_idle(server.server.config.app.state.server.engine).speculative
        assert spec.verify_rows > 0 and spec.mean_accepted_tokens > 1
        assert spec.policy == "adaptive" and len(spec.rounds_by_drafts) >= 2
        rounds = {f'ninfer_speculative_rounds_total{{drafts="{k}"}}': float(n)
                  for k, n in spec.rounds_by_drafts}
        assert spec.bare_rounds == 0  # a Program without a drafter's window runs none
        assert _metrics(server.url) == {**rounds,
            "ninfer_speculative_bare_rounds_total": 0.0,
            "ninfer_speculative_estimated_gain": spec.estimated_gain,
            f'ninfer_speculative_method{{method="{spec.method}"}}': 1.0,
            "ninfer_speculative_tokens": 2.0,
            "ninfer_speculative_verify_rows_total": spec.verify_rows,
            "ninfer_speculative_mean_accepted_tokens": spec.mean_accepted_tokens,
            'ninfer_speculative_acceptance{position="0"}': spec.acceptance_by_position[0],
            'ninfer_speculative_acceptance{position="1"}': spec.acceptance_by_position[1],
        }


def test_metrics_without_speculation(server):
    assert _metrics(server.url) == {'ninfer_speculative_method{method="off"}': 1.0,
                                    "ninfer_speculative_bare_rounds_total": 0.0,
                                    "ninfer_speculative_estimated_gain": 0.0,
                                    "ninfer_speculative_tokens": 0.0,
                                    "ninfer_speculative_verify_rows_total": 0.0,
                                    "ninfer_speculative_mean_accepted_tokens": 0.0}
