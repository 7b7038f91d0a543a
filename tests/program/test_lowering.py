"""`lower_all`: every executable a Program compiles, lowered for CUDA on this CPU host from
shapes. Decode and prefill hold the Pallas attention kernels' Triton calls (not the
interpreter), a MoE Program's prefill and decode hold the grouped kernels and no dense
all-expert contraction, and the same Program lowered for CPU holds neither."""

from __future__ import annotations

import functools

import pytest

from ninfer_jax.program.aot import lower_all
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.executable_specs import PAGE_GROUP
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.testing import tiny_dense, tiny_moe
from tests.pallas_kernels.test_paged_attention import _triton_custom_call_target

B = 2
PCFG = ProgramConfig(max_concurrency=B, max_seq_len=64, num_pages=16, page_size=8,
                     prefill_chunk=16, attention_impl="pallas", gdn_impl="pallas",
                     num_checkpoint_slots=2)
CONFIGS = {"dense": tiny_dense, "moe": tiny_moe}


@functools.cache
def lowered(variant: str, platform: str) -> dict[StepKey, str]:
    return lower_all(CONFIGS[variant](), PCFG, platform)


# dense in the slow tier (~11 s): the MoE model's attention layers lower as the dense one's
@pytest.mark.parametrize("variant", ["moe", pytest.param("dense", marks=pytest.mark.slow)])
def test_every_executable_is_lowered_for_cuda_with_the_attention_kernel(variant):
    texts = lowered(variant, "cuda")
    expected = {StepKey(StepKind.PREFILL, 1), StepKey(StepKind.COMMIT, B),
                StepKey(StepKind.CAPTURE, 1), StepKey(StepKind.RESTORE, 1),
                StepKey(StepKind.EXPORT_PAGES, PAGE_GROUP), StepKey(StepKind.EXPORT_STATE, 1),
                StepKey(StepKind.IMPORT_PAGES, PAGE_GROUP), StepKey(StepKind.IMPORT_STATE, 1),
                *(StepKey(StepKind.DECODE, b) for b in range(1, B + 1))}
    assert set(texts) == expected
    triton = f"custom_call @{_triton_custom_call_target()}"
    # an attention kernel in every attention layer, a GDN kernel in every GDN layer (and a
    # MoE layer's two grouped kernels)
    layers = len(CONFIGS[variant]().layer_types)
    per_layer = 3 if variant == "moe" else 1
    for key in (StepKey(StepKind.PREFILL, 1), *(StepKey(StepKind.DECODE, b)
                                                 for b in range(1, B + 1))):
        assert texts[key].count(triton) == layers * per_layer, key
        for name in ("gated_delta_chunked" if key.kind == StepKind.PREFILL
                     else "gated_delta_recurrent",
                     "paged_attention_prefill" if key.kind == StepKind.PREFILL
                     else "paged_attention_decode"):
            assert name in texts[key], (key, name)
    for text in texts.values():
        assert "interpret" not in text.lower()
    cpu = lowered(variant, "cpu")
    assert set(cpu) == expected
    assert not any(_triton_custom_call_target() in t for t in cpu.values())


def test_a_moe_program_lowers_grouped_kernels_for_cuda_and_dense_ones_for_cpu():
    """Every MoE layer of a CUDA prefill and decode runs the Pallas grouped kernels (the fused
    SwiGLU, then down) on the stacked experts, with no ragged_dot and no [N, E, I] tensor."""
    cfg = tiny_moe()
    moe_layers = len(cfg.layer_types)
    prefill_rows = PCFG.prefill_chunk
    dense = f"x{cfg.num_experts}x{cfg.moe_intermediate_size}xf32>"  # an [N, E, I] tensor
    cuda, cpu = lowered("moe", "cuda"), lowered("moe", "cpu")
    for key in (StepKey(StepKind.PREFILL, 1), StepKey(StepKind.DECODE, 1),
                StepKey(StepKind.DECODE, B)):
        for kernel in ("grouped_swiglu", "grouped_matmul"):
            assert cuda[key].count(f'name = "{kernel}"') == moe_layers, (key, kernel)
        assert "ragged_dot" not in cuda[key] and dense not in cuda[key], key
        assert "grouped_matmul" not in cpu[key] and "ragged_dot" not in cpu[key], key
    assert f"tensor<{prefill_rows}{dense}" in cpu[StepKey(StepKind.PREFILL, 1)]


def test_platform_defaults_decide_dtype_and_attention_in_one_place():
    from ninfer_jax.errors import ConfigError
    from ninfer_jax.program.config import platform_defaults, resolve_dtype

    gpu, cpu = ("bfloat16", "pallas", "pallas_verify"), ("float32", "reference", "reference")
    loops = {"gpu": "unrolled", "cpu": "unrolled", "tpu": "scan"}
    for platform, want in (("gpu", gpu), ("cpu", cpu), ("tpu", ("bfloat16", "reference",
                                                                  "reference"))):
        assert platform_defaults(platform) == dict(zip(
            ("dtype", "attention_impl", "gdn_impl", "layer_loop"), (*want, loops[platform]),
            strict=True))
    # fp32 on a GPU: the jnp attention (the kernels' IEEE fp32 dots were 12-17x slower there)
    assert platform_defaults("gpu", "float32")["attention_impl"] == "reference"
    assert platform_defaults("gpu", "bfloat16")["attention_impl"] == "pallas"
    default = ProgramConfig()  # "auto", resolved for this CPU host when made
    assert (default.dtype, default.attention_impl, default.gdn_impl) == cpu
    assert resolve_dtype("auto") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    chosen = ProgramConfig(dtype="bfloat16", attention_impl="pallas")
    assert (chosen.dtype, chosen.attention_impl) == ("bfloat16", "pallas")
    with pytest.raises(ConfigError, match=r"dtype must be one of .* or 'auto', got 'fp8'"):
        ProgramConfig(dtype="fp8")


@pytest.mark.slow  # ~12 s: the default run's 15 minutes (the moe lowering above stays in it)
def test_a_dflash_program_lowers_for_cuda_with_the_kernel_in_its_verify_steps():
    """The DFlash round (drafter block, verify over T = K + 1 positions) and the ring-carrying
    prefill, capture and images lower for CUDA. The verify step attends over T > 1 positions:
    its target attention is the prefill kernel, not the one-token decode kernel."""
    import dataclasses

    from ninfer_jax.testing.configs import tiny_drafter

    cfg = tiny_dense()
    drafter = tiny_drafter(cfg)
    pcfg = dataclasses.replace(PCFG, speculative="dflash", num_speculative_tokens=4)
    texts = lower_all(cfg, pcfg, "cuda", drafter=drafter)
    # every round of fewer drafts too (the adaptive policy's: 0, 1 and 4 drafts), and the
    # bare rounds of 0 (the drafter's window of 16 is shorter than max_seq_len)
    fewer = {StepKey(StepKind.DECODE, b, extra=(k,)) for b in range(1, B + 1) for k in (0, 1)}
    bare = {StepKey(StepKind.DECODE, b, extra=(0, 1)) for b in range(1, B + 1)}
    assert set(texts) == set(lowered("dense", "cuda")) | fewer | bare
    verify = texts[StepKey(StepKind.DECODE, B)]
    # The rings: [S + 1, R + 1, Ld, Hkv, D] with R = window 16 + T 5.
    ring = f"tensor<{B + 1}x22x1x1x32xf32>"
    assert ring in verify and ring in texts[StepKey(StepKind.PREFILL, 1)]
    # the target's attention layers the prefill kernel, its GDN layers the recurrent kernel
    # with every token's state
    assert verify.count(f"custom_call @{_triton_custom_call_target()}") == len(cfg.layer_types)
    assert "paged_attention_prefill" in verify and "gated_delta_recurrent" in verify
    assert "tensor<2x22x1x1x32xf32>" in texts[StepKey(StepKind.EXPORT_STATE, 1)]


def test_an_int8_kv_program_lowers_for_cuda_with_the_kernels_reading_int8_pages():
    """kv_dtype="int8": every layer's Triton call as with float pages; the attention calls take
    the int8 pool and its float32 scales, and no step makes a float copy of the pool."""
    import dataclasses

    cfg = tiny_dense()
    texts = lower_all(cfg, dataclasses.replace(PCFG, kv_dtype="int8"), "cuda")
    assert set(texts) == set(lowered("dense", "cuda"))
    flat = cfg.num_attention_layers * (PCFG.num_pages + 1)
    pool = f"{flat}x{PCFG.page_size}x{cfg.num_kv_heads}x{cfg.head_dim}"
    triton = f"custom_call @{_triton_custom_call_target()}"
    for key in (StepKey(StepKind.PREFILL, 1), StepKey(StepKind.DECODE, B)):
        calls = [line for line in texts[key].splitlines() if triton in line]
        assert len(calls) == len(cfg.layer_types), key
        attention = [c for c in calls if f"tensor<{pool}xi8>" in c]
        assert len(attention) == cfg.num_attention_layers, key
        assert all(f"tensor<{pool[:pool.rindex('x')]}xf32>" in c for c in attention), key
    for key, text in texts.items():
        assert f"tensor<{pool}xf32>" not in text, key


@pytest.mark.parametrize("speculative", ["off", pytest.param("mtp", marks=pytest.mark.slow)])
def test_pallas_verify_runs_the_gdn_kernel_in_verify_windows_only(speculative):
    """gdn_impl="pallas_verify" (the GPU default): the recurrent kernel where a step keeps
    every token's state (an MTP verify window, the decode step of a speculative Program), the
    jnp forms in prefill and plain decode; the attention kernels everywhere."""
    cfg = tiny_dense(mtp_num_layers=1)
    spec = {"speculative": "mtp", "num_speculative_tokens": 1} if speculative == "mtp" else {}
    pcfg = ProgramConfig(max_concurrency=1, max_seq_len=64, num_pages=16, page_size=8,
                         prefill_chunk=16, attention_impl="pallas", gdn_impl="pallas_verify",
                         **spec)
    texts = lower_all(cfg, pcfg, "cuda")
    gdn_layers = cfg.num_linear_layers
    prefill, decode = texts[StepKey(StepKind.PREFILL, 1)], texts[StepKey(StepKind.DECODE, 1)]
    assert "gated_delta" not in prefill and "paged_attention_prefill" in prefill
    if speculative == "mtp":
        assert decode.count('name = "gated_delta_recurrent"') == gdn_layers
    else:
        assert "gated_delta" not in decode and "paged_attention_decode" in decode


def test_the_program_package_exports_its_entry_points_lazily():
    """`ninfer_jax.program.lower_all` and friends import from the package (#41: they lived one
    module down only), and importing the package or its jax-free `host` imports no jax."""
    import subprocess
    import sys

    from ninfer_jax import program
    from ninfer_jax.program import aot, config, plan

    assert program.lower_all is aot.lower_all and program.compile_all is aot.compile_all
    assert program.ProgramConfig is config.ProgramConfig
    assert program.memory_plan is plan.memory_plan
    assert sorted(program.__all__) == sorted(program._EXPORTS)
    assert all(getattr(program, name) is not None for name in program.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = program.nope
    code = ("import sys, ninfer_jax.program, ninfer_jax.program.host; "
            "print('jax' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"
