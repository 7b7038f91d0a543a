"""`export_hf` is the exact inverse of the weight schema; transformers reads what it writes."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from ninfer_jax import load_model
from ninfer_jax.artifact.export import export_hf
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.testing.configs import tiny_dense, tiny_moe


def _assert_same_params(a: dict, b: dict):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("make_cfg, tied", [(tiny_dense, True), (tiny_dense, False),
                                            (tiny_moe, False)])
def test_export_then_load_round_trips_params_exactly(tmp_path, make_cfg, tied):
    cfg = make_cfg(tie_word_embeddings=tied, eos_token_ids=(3, 7), mtp_num_layers=1)
    params = init_params(cfg, jax.random.key(1), num_mtp_layers=1, std=0.5)
    # Non-trivial norms, so a dropped or swapped norm cannot pass.
    params = jax.tree.map(lambda a: a + 0.25 if a.ndim == 1 else a, params)
    export_hf(cfg, params, tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    _assert_same_params(loaded.params, params)
    assert loaded.config == cfg  # gdn_chunk_size is not an HF field; the tiny configs use 64
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["eos_token_id"] == [3, 7]


def test_export_refuses_a_non_empty_directory(tmp_path):
    cfg = tiny_dense()
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="is not empty and is not a checkpoint written by "
                       r"`ninfer export-hf` \(it holds 'keep.txt'"):
        export_hf(cfg, init_params(cfg, jax.random.key(0)), tmp_path)


@pytest.mark.dev
def test_exported_demo_model_gives_transformers_the_same_logits(tmp_path):
    """`ninfer export-hf` of the embedded default; transformers' logits equal ours within 1e-4
    (max abs difference relative to the largest logit, as in tests/models)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()",
                    "export-hf", f"--out={out}"], check=True, timeout=300)
    ours = load_model()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (2, 80))
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    got = ours.logits(ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99
