"""Checkpoint layouts, the artifact round trip, and clear errors for bad input."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ninfer_jax import load_model
from ninfer_jax.artifact.convert import convert
from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.models.qwen3_6.vision import hf_vision_tensors
from ninfer_jax.models.qwen3_6.weights import VISION_PREFIX
from tests.conftest import FIXTURES, REPO
from tests.models.conftest import loaded, reference


def _assert_same_params(a: dict, b: dict):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_multimodal_sharded_checkpoint_loads_text_model_vision_tower_and_mtp():
    vl = loaded("dense_vl")
    assert (FIXTURES / "dense_vl" / "model.safetensors.index.json").is_file()
    assert vl.config.vision is not None and vl.config.vision.depth == 1
    assert vl.params["mtp"]["layers"]["mixer"]["q"].shape[0] == 1
    text = {k: v for k, v in vl.params.items() if k not in ("mtp", "vision")}
    _assert_same_params(text, loaded("dense").params)
    # every model.visual.* tensor lands in params["vision"] unchanged (the conv kernel flattened)
    tensors = {}
    for file in sorted((FIXTURES / "dense_vl").glob("model-0*.safetensors")):
        tensors.update(load_file(file))
    ours = hf_vision_tensors(vl.params["vision"], vl.config.vision)
    visual = {k[len(VISION_PREFIX):]: v for k, v in tensors.items() if k.startswith(VISION_PREFIX)}
    assert set(ours) == set(visual)
    for name, value in visual.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)


@pytest.mark.parametrize("name", ["dense_vl", "moe"])
def test_artifact_round_trip_is_identical(tmp_path, name):
    out, _ = convert(FIXTURES / name, tmp_path / "art")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == "qwen3_6" and manifest["variant"] == loaded(name).config.variant
    assert set(manifest["sources"]) >= {"config.json"}
    art = load_model(out)
    assert art.config == loaded(name).config
    _assert_same_params(art.params, loaded(name).params)
    ref = reference(name)
    np.testing.assert_array_equal(art.logits(ref["token_ids"]), loaded(name).logits(ref["token_ids"]))


def test_bf16_artifact_round_trip(tmp_path):
    out, _ = convert(FIXTURES / "dense", tmp_path / "art", dtype="bfloat16")
    art = load_model(out, dtype="bfloat16")
    _assert_same_params(art.params, loaded("dense", "bfloat16").params)


def test_fused_expert_tensors_load_like_split_ones(tmp_path):
    src = FIXTURES / "moe"
    dst = tmp_path / "fused"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(str(src / "model.safetensors"))
    cfg = loaded("moe").config
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        per = [[tensors.pop(f"{pre}{e}.{n}_proj.weight") for e in range(cfg.num_experts)]
               for n in ("gate", "up", "down")]
        tensors[f"{pre}gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(*per[:2])])
        tensors[f"{pre}down_proj"] = np.stack(per[2])
    save_file(tensors, str(dst / "model.safetensors"))
    _assert_same_params(load_model(dst).params, loaded("moe").params)


def _copy_with(tmp_path, name, *, config=None, drop=(), reshape=None):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    tensors = load_file(str(FIXTURES / name / "model.safetensors"))
    for key in drop:
        del tensors[key]
    for key, shape in (reshape or {}).items():
        tensors[key] = np.zeros(shape, np.float32)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.3.linear_attn.A_log"
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        load_model(_copy_with(tmp_path, "dense", drop=[name]))


def test_shape_mismatch_names_tensor_expected_and_got(tmp_path):
    name = "model.layers.2.self_attn.k_proj.weight"
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \(64, 60\), expected \(64, 64\)"):
        load_model(_copy_with(tmp_path, "dense", reshape={name: (64, 60)}))


def test_unknown_tensor_is_refused(tmp_path):
    dst = _copy_with(tmp_path, "dense", reshape={"model.layers.0.mystery.weight": (3,)})
    with pytest.raises(CheckpointError, match="mystery"):
        load_model(dst)


def test_untied_checkpoint_without_lm_head_is_refused(tmp_path):
    def untie(c):
        return {**c, "tie_word_embeddings": False}

    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        load_model(_copy_with(tmp_path, "dense", config=untie))


@pytest.mark.parametrize("edit,match", [
    (lambda c: {**c, "model_type": "llama"}, "unknown model_type 'llama'"),
    (lambda c: {**c, "hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    (lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_type": "yarn"}},
     "unsupported rope_type 'yarn'"),
    (lambda c: {**c, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
    (lambda c: {**c, "layer_types": c["layer_types"][:2]}, "layer_types has 2 entries"),
    (lambda c: {**c, "layer_types": ["mamba"] * 5}, "unsupported entries"),
    (lambda c: {k: v for k, v in c.items() if k != "vocab_size"}, "missing 'vocab_size'"),
])
def test_bad_config_values_are_named(tmp_path, edit, match):
    with pytest.raises(ConfigError, match=match):
        load_model(_copy_with(tmp_path, "dense", config=edit))


def test_absent_unreadable_and_wrong_directories(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_model(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither an artifact"):
        load_model(tmp_path / "empty")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(bad)
    corrupt = _copy_with(tmp_path, "dense")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad header}")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(corrupt)


def test_bad_logits_input_is_refused():
    model = loaded("dense")
    with pytest.raises(ValueError, match=r"token_ids must be a non-empty int array \[B, T\]"):
        model.logits(np.zeros((3,), np.int32))
    with pytest.raises(ValueError, match=r"in \[0, vocab_size=384\)"):
        model.logits(np.array([[1, 384]]))


@pytest.mark.slow  # ~15 s: two processes; jax's cache serving a second process is also
# tests/program/test_executable_cache.py's (its damaged entries come from jax's cache)
def test_a_second_process_reuses_compiled_code(tmp_path):
    """The persistent compilation cache serves a second run of the same config."""
    script = textwrap.dedent(f"""
        import jax, numpy as np
        from ninfer_jax.compile_cache import enable_persistent_cache
        enable_persistent_cache({str(tmp_path / 'cache')!r})
        hits = []
        jax.monitoring.register_event_listener(
            lambda e, **kw: hits.append(e) if e == '/jax/compilation_cache/cache_hits' else None)
        from ninfer_jax import load_model
        load_model({str(FIXTURES / 'dense')!r}).logits(np.ones((1, 5), np.int32))
        print('HITS', len(hits))
    """)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=REPO, check=True) for _ in range(2)]
    hits = [int(r.stdout.split("HITS")[1]) for r in runs]
    assert hits[0] == 0 and hits[1] >= 1, hits
    assert any(pathlib.Path(tmp_path / "cache").iterdir())


def test_tiny_configs_match_the_fixtures_and_init_params_fits_the_schema():
    from ninfer_jax.models.qwen3_6.weights import check_param_shapes, init_params
    from ninfer_jax.testing import tiny_dense, tiny_moe

    for name, cfg in (("dense", tiny_dense()), ("moe", tiny_moe())):
        fixture = loaded(name).config
        assert cfg == type(fixture)(**{**fixture.__dict__, "max_position_embeddings": 4096})
        params = init_params(cfg, jax.random.key(0), num_mtp_layers=1)
        check_param_shapes(cfg, params)


def test_real_presets_are_valid():
    from configs.models import MEDIUM, QWEN3_6_27B, QWEN3_6_35B_A3B

    assert QWEN3_6_27B.layer_period == 4 and QWEN3_6_27B.num_attention_layers == 16
    assert QWEN3_6_35B_A3B.conv_dim == 2 * 16 * 128 + 32 * 128
    from ninfer_jax.models.qwen3_6.weights import param_shapes

    count = sum(int(np.prod(s)) for s in jax.tree.leaves(
        param_shapes(MEDIUM), is_leaf=lambda x: isinstance(x, tuple)))
    assert 400e6 <= count <= 600e6, count
