"""A DFlash drafter in the public checkpoint layout travels with its target: `convert(...,
drafter=DIR)` checks it against the target and copies it under `drafter/`, and an Engine opened
on the artifact with speculative="dflash" finds it there and answers exactly as without it."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.artifact.convert import convert
from ninfer_jax.errors import CheckpointError
from ninfer_jax.loader import DEFAULT_MODEL
from ninfer_jax.sampling_params import SamplingParams
from tests.program.conftest import reference_greedy

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures"
SETTINGS = dict(max_concurrency=1, max_seq_len=64, page_size=8, prefill_chunk=16,
                num_checkpoint_slots=0, prefix_reuse=False, context_store="off")


def test_convert_carries_the_drafter_and_the_engine_finds_it(tmp_path):
    hf = tmp_path / "hf"  # the dense fixture with a tokenizer (the demo's: decoding only)
    shutil.copytree(FIXTURES / "dense", hf)
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy2(DEFAULT_MODEL / name, hf / name)
    out, _ = convert(hf, tmp_path / "artifact", drafter=FIXTURES / "dflash2")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["drafter_files"] == ["drafter/config.json", "drafter/model.safetensors"]
    assert {"drafter/config.json", "drafter/model.safetensors"} <= set(manifest["files"])
    assert (out / "drafter" / "model.safetensors").read_bytes() == (
        FIXTURES / "dflash2" / "model.safetensors").read_bytes()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    ids = [5, 17, 42, 99, 3, 250, 7]
    with Engine.open(out, **SETTINGS, speculative="dflash", num_speculative_tokens=3) as e:
        got = e.generate(prompt_token_ids=ids, sampling=greedy).token_ids
        assert e.stats().speculative.verify_rows > 0
        assert "speculative dflash K=3" in e.describe()
    assert list(got) == reference_greedy("dense", ids, 20)


def test_a_drafter_that_does_not_fit_the_target_is_refused_before_writing(tmp_path):
    with pytest.raises(CheckpointError, match="vocab_size 384 must equal the target's"):
        convert(FIXTURES / "moe", tmp_path / "artifact", drafter=FIXTURES / "dflash2")
    assert not (tmp_path / "artifact").exists()
