"""Our DFlash2 drafter against the public reference implementation (z-lab/dflash).

`tests/fixtures/dflash2/` holds a tiny random drafter in the public checkpoint layout and the
reference's outputs on it (`scripts/make_dflash_reference.py` ran z-lab's `DFlash2DraftModel`
from commit 10129599 on CPU in fp32). Two contexts: 5 positions (inside the sliding window of 12)
and 20 (past it). Checked: the block's hidden states and the full proposal's logits (1e-4), the
selector's greedy path (exact), and the selector's q rows along the reference's sampled path.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.artifact.hf import SafetensorsSource, read_config
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.dflash.model import (
    block_hidden,
    block_logits,
    context_kv,
    greedy,
    select,
    selector_scores,
)
from ninfer_jax.models.dflash.weights import param_shapes, params_from_hf, params_to_hf

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "dflash2"
TOL = 1e-4


@pytest.fixture(scope="module")
def drafter():
    cfg = DFlashConfig.from_hf_dict(read_config(FIXTURE))
    params = jax.tree.map(jnp.asarray, params_from_hf(cfg, SafetensorsSource(FIXTURE)))
    return cfg, params, dict(np.load(FIXTURE / "reference.npz"))


def _forward(cfg, params, ref, case):
    features = jnp.asarray(ref[f"features_{case}"])
    n = features.shape[1]
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    ctx_k, ctx_v = context_kv(params, cfg, features, positions)
    block = np.full((1, cfg.block_size), cfg.mask_token_id, np.int32)
    block[0, 0] = ref[f"anchor_{case}"][0]
    embeds = jnp.asarray(ref["embed"])[block] * cfg.input_embedding_scale
    block_pos = n + jnp.arange(cfg.block_size, dtype=jnp.int32)[None]
    return block_hidden(params, cfg, embeds, block_pos, ctx_k, ctx_v, positions,
                        jnp.ones((1, n), bool))


def test_config_reads_the_dflash2_fields(drafter):
    cfg, _, _ = drafter
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (8, 95, (0, 2))
    assert cfg.has_conv and cfg.has_selector and cfg.selector_top_k == 6
    assert cfg.causal == (False, False) and cfg.layer_types[1] == "full_attention"
    assert cfg.bounded_window is None  # a full-attention layer sees the whole context


@pytest.mark.parametrize("case", [0, 1])
def test_block_hidden_and_logits_match_the_reference(drafter, case):
    cfg, params, ref = drafter
    hidden = _forward(cfg, params, ref, case)
    np.testing.assert_allclose(np.asarray(hidden), ref[f"hidden_{case}"], atol=TOL, rtol=TOL)
    logits = block_logits(cfg, hidden[:, 1:], jnp.asarray(ref["head"]))
    np.testing.assert_allclose(np.asarray(logits), ref[f"logits_{case}"], atol=TOL, rtol=TOL)
    assert float(jnp.max(jnp.abs(logits))) < cfg.final_logit_softcapping


@pytest.mark.parametrize("case", [0, 1])
def test_selector_greedy_path_and_sampled_q_match_the_reference(drafter, case):
    cfg, params, ref = drafter
    hidden = _forward(cfg, params, ref, case)[:, 1:]
    logits = block_logits(cfg, hidden, jnp.asarray(ref["head"]))
    anchor = jnp.asarray(ref[f"anchor_{case}"], jnp.int32)
    path, _, _ = select(params, cfg, hidden, logits, anchor, greedy)
    np.testing.assert_array_equal(np.asarray(path), ref[f"greedy_path_{case}"])
    # q rows along the reference's sampled path: softmax(scores / T) over the candidates,
    # compared as token -> probability (top-k's candidate order is unspecified).
    sampled = ref[f"sampled_path_{case}"][0]
    unary, candidates = jax.lax.top_k(logits, cfg.selector_top_k)
    temperature = float(ref["temperature"])
    predecessor = int(anchor[0])
    for j in range(hidden.shape[1]):
        scores = selector_scores(params, cfg, hidden[:, j], jnp.array([predecessor]),
                                 unary[:, j], candidates[:, j].astype(jnp.int32))
        q = np.asarray(jax.nn.softmax(scores / temperature))[0]
        ours = dict(zip(np.asarray(candidates)[0, j].tolist(), q))
        theirs = dict(zip(ref[f"sampled_candidates_{case}"][0, j].tolist(),
                          ref[f"sampled_q_{case}"][0, j]))
        assert ours.keys() == theirs.keys()
        for token, p in theirs.items():
            assert abs(ours[token] - p) < TOL, (j, token)
        predecessor = int(sampled[j])


def test_weights_round_trip_in_the_official_layout(drafter):
    cfg, params, _ = drafter
    names = params_to_hf(cfg, params)
    assert set(names) == set(SafetensorsSource(FIXTURE).keys())
    assert "candidate_selector.predecessor_codebook" in names  # no ".weight" in the layout
    shapes = jax.tree.map(lambda a: a.shape, params)
    assert shapes == param_shapes(cfg)


def test_bad_checkpoints_are_refused_by_name():
    config = read_config(FIXTURE)
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        DFlashConfig.from_hf_dict({**config, "dflash_config": {
            k: v for k, v in config["dflash_config"].items() if k != "target_layer_ids"}})
    with pytest.raises(CheckpointError, match="architectures"):
        DFlashConfig.from_hf_dict({**config, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(CheckpointError, match="mask_token_id"):
        DFlashConfig.from_hf_dict({**config, "dflash_config": {
            **config["dflash_config"], "mask_token_id": 384}})
    cfg = DFlashConfig.from_hf_dict(config)

    class Missing:
        def __init__(self, drop):
            self.source, self.drop = SafetensorsSource(FIXTURE), drop

        def keys(self):
            return [k for k in self.source.keys() if k != self.drop]

        def get(self, name):
            return self.source.get(name)

    with pytest.raises(CheckpointError, match="layers.1.mlp_conv.base_kernel"):
        params_from_hf(cfg, Missing("layers.1.mlp_conv.base_kernel"))
    with pytest.raises(CheckpointError, match="hidden_size 64 must equal the target's"):
        cfg.check_target(4, 128, 384)
    with pytest.raises(CheckpointError, match="below the target's 2 layers"):
        cfg.check_target(2, 64, 384)
