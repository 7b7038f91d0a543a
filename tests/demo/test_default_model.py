"""The embedded default model: shipped as package data, loads with no path, fast, and is trained."""

from __future__ import annotations

import glob
import pathlib
import time
import tomllib

import numpy as np

from ninfer_jax import load_model
from ninfer_jax.frontend import Frontend
from ninfer_jax.loader import DEFAULT_MODEL
from tests.conftest import REPO


def test_load_model_without_a_path_loads_the_embedded_demo_in_under_5s():
    start = time.perf_counter()
    model = load_model()
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"loading the embedded default took {elapsed:.1f}s"
    assert model.path == DEFAULT_MODEL
    cfg = model.config
    assert cfg.variant == "dense" and cfg.mtp_num_layers == 1
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}
    assert model.params["mtp"]["layers"]["input_norm"].shape[0] == 1
    size = sum(f.stat().st_size for f in DEFAULT_MODEL.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"the demo artifact is {size / 2**20:.1f} MiB"


def test_demo_frontend_is_a_chatml_sentencepiece_tokenizer_matching_the_model():
    frontend = Frontend.load(DEFAULT_MODEL)
    tok = frontend.tokenizer
    assert tok.vocab_size == load_model().config.vocab_size
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        assert tok.special_id(special) is not None
    assert {tok.special_id("<|im_end|>"), tok.special_id("<|endoftext|>")} <= tok.eos_ids
    assert set(load_model().config.eos_token_ids) == set(tok.eos_ids)
    prompt = frontend.prepare(messages=[{"role": "user", "content": "Tell me a story."}])
    assert prompt.text == "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(prompt.token_ids) == prompt.text
    assert prompt.token_ids[0] == tok.special_id("<|im_start|>")


def test_demo_model_predicts_held_out_tinystories_text(shared_data):
    """Per-token perplexity on held-out text is story-model-like (random weights give ~4096)."""
    model = load_model()
    tok = Frontend.load(DEFAULT_MODEL).tokenizer
    text = (shared_data / "tinystories" / "valid_head_cased.txt").read_text()[-4000:]
    ids = np.asarray(tok.encode(text)[:257])
    logits = model.logits(ids[None, :-1])[0]
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -logp[np.arange(len(ids) - 1), ids[1:]].mean()
    assert np.exp(nll) < 30, f"perplexity {np.exp(nll):.1f}"


def test_pyproject_ships_every_file_of_the_demo_artifact():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["ninfer_jax"]
    package = REPO / "ninfer_jax"
    shipped = {pathlib.Path(p) for pattern in patterns
               for p in glob.glob(pattern, root_dir=package, recursive=True)
               if (package / p).is_file()}
    present = {f.relative_to(package) for f in DEFAULT_MODEL.rglob("*") if f.is_file()}
    assert present and present <= shipped
    assert any(p.parts[:3] == ("assets", "demo", "weights") for p in present)
