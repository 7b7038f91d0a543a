"""Quantized weights: the formats' arithmetic, the official FP8 layout against transformers,
quantized artifacts, and the Program's guarantees (exact-B greedy, zero recompiles, donation)
with quantized weights."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ninfer_jax import load_model, quant
from ninfer_jax.artifact.convert import convert
from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.models.qwen3_6 import forward
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from tests.conftest import FIXTURES
from tests.models.conftest import loaded, reference, rel_err
from tests.program.conftest import PCFG, run_to_completion
from tests.program.test_program import COUNTER, _admit, _assert_all_free

_forward = jax.jit(forward, static_argnums=1)


@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 192), (4, 96)])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_group_quantization_is_within_half_a_step_and_packs_channel_pairs(shape, method):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    q = quant.quantize_int(w, method)
    g = quant.group_size(shape[-1])
    assert q.block == (1, g) and q.shape == shape and q.scale.shape == (*shape[:-1],
                                                                       shape[-1] // g)
    deq = np.asarray(q.dequantize())
    step = np.repeat(q.scale, g, axis=-1)
    assert np.all(np.abs(deq - w) <= step / 2 + 1e-6)
    top = 127 if method == "int8" else 7
    np.testing.assert_allclose(np.abs(w).reshape(*shape[:-1], -1, g).max(-1), q.scale * top,
                               rtol=1e-6)
    if method == "int4":  # byte j of a row: channel 2j low, channel 2j + 1 high, value + 8
        u = np.asarray(q.q)
        v = np.rint(w / step).astype(int)
        np.testing.assert_array_equal(u & 15, v[..., 0::2] + 8)
        np.testing.assert_array_equal(u >> 4, v[..., 1::2] + 8)
        assert q.q.dtype == np.uint8 and q.q.shape[-1] == shape[-1] // 2


def test_group_size_is_128_or_the_largest_even_divisor_below():
    assert [quant.group_size(n) for n in (128, 512, 192, 96, 100)] == [128, 128, 96, 96, 100]
    with pytest.raises(ConfigError, match="no even group size"):
        quant.group_size(127)


def test_fp8_blocks_cover_partial_edge_blocks():
    """Official layout: one scale per 128x128 block, ceil(out/128) x ceil(in/128) of them."""
    w = np.random.default_rng(1).normal(size=(300, 200)).astype(np.float32)
    w[:128, :128] *= 50  # blocks with different ranges
    q = quant.fp8_blocks(w)
    assert q.q.dtype == ml_dtypes.float8_e4m3fn and q.scale.shape == (3, 2)
    deq = np.asarray(q.dequantize())
    want = q.q.astype(np.float32) * np.repeat(np.repeat(q.scale, 128, 0), 128, 1)[:300, :200]
    np.testing.assert_array_equal(deq, want)
    assert rel_err(deq, w) < 0.07  # e4m3 keeps 3 mantissa bits


@pytest.mark.parametrize("name", ["fp8_dense", "fp8_moe"])
def test_official_fp8_checkpoint_matches_transformers_and_own_dequantized_forward(name):
    m = load_model(FIXTURES / name)
    ref = reference(name)
    assert quant.method_of(m.params) == "fp8"
    q = m.params["attention"]["mixer"]["q"]
    assert q.q.dtype == jnp.float8_e4m3fn and q.block == (128, 128)
    assert isinstance(m.params["attention"]["mixer"]["q_norm"], jax.Array)
    got = m.logits(ref["token_ids"])
    assert rel_err(got, ref["logits"]) < 1e-3
    dequantized = quant.cast_params(quant.dequantize_params(m.params), jnp.float32)
    own = np.asarray(_forward(dequantized, m.config, jnp.asarray(ref["token_ids"])))
    assert rel_err(got, own) < 1e-5


def test_fp8_checkpoint_converts_to_an_fp8_artifact_with_equal_logits(tmp_path):
    path, _ = convert(FIXTURES / "fp8_moe", tmp_path / "a")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["quantization"]["method"] == "fp8"
    assert manifest["tensors"]["linear.mlp.experts.gate.q"]["dtype"] == "float8_e4m3fn"
    assert manifest["tensors"]["linear.mlp.experts.gate.scale"]["shape"] == [2, 4, 1, 1]
    ref = reference("fp8_moe")
    np.testing.assert_array_equal(load_model(path).logits(ref["token_ids"]),
                                  load_model(FIXTURES / "fp8_moe").logits(ref["token_ids"]))
    with pytest.raises(CheckpointError, match="fp8 already"):
        convert(FIXTURES / "fp8_moe", tmp_path / "b", quantize="int8")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_convert_quantize_writes_what_load_time_quantization_computes(tmp_path, method):
    path, _ = convert(FIXTURES / "moe", tmp_path / method, quantize=method)
    manifest = json.loads((path / "manifest.json").read_text())
    blocks = manifest["quantization"]["blocks"]
    assert blocks["attention.mixer.q"] == [1, 64] and "attention.mlp.router" not in blocks
    assert "embed" not in blocks and "linear.mixer.in_b" not in blocks
    a, b = load_model(path), load_model(FIXTURES / "moe", quantize=method)
    for (pa, x), (pb, y) in zip(jax.tree_util.tree_flatten_with_path(a.params)[0],
                                jax.tree_util.tree_flatten_with_path(b.params)[0]):
        assert pa == pb and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    stored = sum(f.stat().st_size for f in (path / "weights").iterdir())
    full = sum(np.asarray(x).nbytes for x in jax.tree.leaves(loaded("moe").params))
    assert stored < full * (0.45 if method == "int8" else 0.35)


def test_a_damaged_quantization_record_is_refused(tmp_path):
    path, _ = convert(FIXTURES / "dense", tmp_path / "a", quantize="int8")
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["quantization"]["blocks"]["attention.mixer.q"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="attention.mixer.q"):
        load_model(path)
    manifest["quantization"] = {"method": "int3", "blocks": {}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="method is one of"):
        load_model(path)


def test_bad_quantize_settings_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="quantize must be one of"):
        load_model(FIXTURES / "dense", quantize="int3")
    with pytest.raises(ConfigError, match="quantize must be one of"):
        convert(FIXTURES / "dense", tmp_path / "a", quantize="fp8")
    with pytest.raises(ConfigError, match="quantized already"):
        quant.quantize_params(load_model(FIXTURES / "fp8_dense").params, "int8")
    hf = tmp_path / "gptq"
    shutil.copytree(FIXTURES / "dense", hf)
    config = json.loads((hf / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'gptq'"):
        load_model(hf)


def _greedy(params, cfg, prompt, n, width=48):
    seq = list(prompt)
    for _ in range(n):
        ids = np.zeros((1, width), np.int32)
        ids[0, : len(seq)] = seq
        seq.append(int(np.asarray(_forward(params, cfg, jnp.asarray(ids)))[0, len(seq) - 1]
                       .argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("name,method", [
    ("dense", "int4"), pytest.param("moe", "int8", marks=pytest.mark.slow)])
def test_program_with_quantized_weights_gives_forward_greedy_at_every_b(name, method):
    """Exact-B decode (B = 1, 2 as sequences finish), chunked prefill over pages,
    zero compilations after warm-up, pools donated to every step."""
    m = load_model(FIXTURES / name, quantize=method)
    prog = Program(m.config, m.params,
                   ProgramConfig(**{**PCFG.__dict__, "max_concurrency": 2}))
    prog.wait_compiled()
    ids = reference(name)["token_ids"]
    prompts, budgets = [ids[0, :11].tolist(), ids[2, :17].tolist()], [6, 3]
    old = prog.pools
    COUNTER.active = True
    try:
        handles = {_admit(prog, p, n): n for p, n in zip(prompts, budgets)}
        run_to_completion(prog, handles)
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    for (h, n), p in zip(handles.items(), prompts):
        assert prog.tokens(h)[len(p):] == _greedy(m.params, m.config, p, n)
        prog.release(h)
    _assert_all_free(prog)


@pytest.mark.slow  # ~35 s cold; the int4 Program test stays in the default run
def test_engine_with_int4_weights_mtp_speculation_and_prefix_reuse_keeps_the_greedy_tokens():
    """The embedded model with int4 weights and MTP drafts: greedy tokens equal the full
    forward's on the same quantized weights, for a first turn and for a second turn that
    resumes from the first one's checkpoint."""
    from ninfer_jax import Engine, SamplingParams

    m = load_model(None, quantize="int4")
    ids = np.random.default_rng(5).integers(10, m.config.vocab_size, 21).tolist()
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with Engine.open(None, quantize="int4", speculative="mtp", max_concurrency=1,
                     max_seq_len=64, context_store="off") as engine:
        assert "int4 weights" in engine.describe()
        first = engine.generate(prompt_token_ids=ids, sampling=sampling, session="s")
        history = ids + list(first.token_ids) + ids[:3]
        second = engine.generate(prompt_token_ids=history, sampling=sampling, session="s")
    assert list(first.token_ids) == _greedy(m.params, m.config, ids, 8, width=48)
    assert list(second.token_ids) == _greedy(m.params, m.config, history, 8, width=48)
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens > 0


def test_plan_sizes_quantized_weights_exactly_and_the_27b_fits_a_32_gb_gpu():
    from ninfer_jax.models.qwen3_6.weights import init_params, param_shapes
    from ninfer_jax.presets import PRESETS
    from ninfer_jax.program.plan import memory_plan
    from ninfer_jax.testing import tiny_moe

    cfg = tiny_moe()
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(0)))
    for method in ("int8", "int4"):
        assert quant.planned_bytes(param_shapes(cfg), method, "float32") == quant.weight_bytes(
            quant.quantize_params(params, method))
    big = PRESETS["qwen3_6_27b"]
    pcfg = ProgramConfig(max_concurrency=1, max_seq_len=32768, dtype="bfloat16",
                         attention_impl="reference", gdn_impl="reference", num_pages=2048)
    bf16 = memory_plan(big, pcfg).regions["weights"]
    sizes = {m: memory_plan(big, pcfg, quantize=m).regions["weights"] for m in quant.METHODS}
    assert 0.5 < sizes["fp8"] / bf16 < sizes["int8"] / bf16 < 0.6
    assert 0.3 < sizes["int4"] / bf16 < 0.4
    int8_kv = dataclasses.replace(pcfg, kv_dtype="int8")
    assert not memory_plan(big, pcfg, device_bytes=32 * 10**9).fits
    assert memory_plan(big, int8_kv, device_bytes=32 * 10**9, quantize="int4").fits
