"""The Program with INT8 K/V pages (`ProgramConfig.kv_dtype="int8"`): pools and page bytes;
greedy tokens at every B through chunked prefill and decode with zero compilations after
start-up; decode and prefill reading a position's K/V the same; the steps write the int8
pools in place (donated, no copy, never dequantized whole); prefix checkpoints and page images
(also in the context store's one-buffer form) continue exactly as a cold run; bad settings."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from ninfer_jax.errors import ConfigError
from ninfer_jax.program.checkpoints import CheckpointImage
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.program.plan import memory_plan
from ninfer_jax.program.pools import Pools
from ninfer_jax.sampling_params import SamplingParams
from tests.models.conftest import reference
from tests.program.conftest import program, reference_greedy, run_to_completion
from tests.program.test_program import COUNTER

B = 2  # decode executables for B = 1, 2 (each more costs a compile)
GREEDY_LP = SamplingParams(temperature=0.0, logprobs=1)


def _prog():
    return program(kv_dtype="int8", max_concurrency=B)


def _admit(prog, prompt, max_new, sampling=None, source=None):
    kwargs = {} if sampling is None else {"sampling": sampling}
    return prog.materialize(prog.plan_admission(len(prompt), max_new, source), prompt, **kwargs)


def _assert_all_free(prog):
    s = prog.stats()
    assert (s.free_pages, s.free_slots, s.num_sequences) == (s.total_pages, s.total_slots, 0)


@pytest.mark.parametrize("value", ["int4", "foo", "bfloat16", None])
def test_kv_dtype_is_validated(value):
    with pytest.raises(ConfigError, match=r"kv_dtype must be one of \('auto', 'int8'\)"):
        ProgramConfig(kv_dtype=value)
    assert ProgramConfig().page_dtype == "float32"  # auto: the program dtype (CPU: fp32)
    assert ProgramConfig(kv_dtype="int8", dtype="bfloat16").page_dtype == "int8"


def test_pools_hold_int8_pages_with_float32_scales():
    prog = _prog()
    pools, cfg, pcfg = prog.pools, prog.cfg, prog.pcfg
    flat = cfg.num_attention_layers * (pcfg.num_pages + 1)
    shape = (flat, pcfg.page_size, cfg.num_kv_heads, cfg.head_dim)
    assert [(a.shape, a.dtype) for a in pools.kv] == [(shape, np.int8)] * 2 + [
        (shape[:3], np.float32)] * 2
    per_position = cfg.num_kv_heads * (2 * cfg.head_dim + 2 * 4)  # K, V and their scales
    assert prog.limits.page_bytes == cfg.num_attention_layers * pcfg.page_size * per_position
    assert memory_plan(cfg, pcfg, 0).regions["kv_pages"] == sum(a.nbytes for a in pools.kv)
    floats = jax.eval_shape(lambda: Pools.allocate(cfg, dataclasses.replace(pcfg,
                                                                             kv_dtype="auto")))
    assert floats.k.dtype == np.float32 and floats.k_scale is None and len(floats.kv) == 2


def test_greedy_tokens_at_every_batch_size_with_zero_compilations():
    """Prompts of 9 and 14 tokens (8-token chunks over 4-token pages: a second chunk after two
    cached pages), alone and together: the same tokens, which on this fixture are also the
    float model's greedy tokens (int8 K/V noise flips none of its choices here)."""
    prog = _prog()
    ids = reference("dense")["token_ids"]
    prompts = [ids[0, :9].tolist(), ids[1, :14].tolist()]
    prog.wait_compiled()
    COUNTER.active = True
    try:
        alone = []
        for p in prompts:
            h = _admit(prog, p, 8)
            run_to_completion(prog, {h: 8})
            alone.append(prog.tokens(h)[len(p):])
            prog.release(h)
        handles = {_admit(prog, p, 8): 8 for p in prompts}
        run_to_completion(prog, handles)
        together = [prog.tokens(h)[len(p):] for h, p in zip(handles, prompts)]
        for h in handles:
            prog.release(h)
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0, f"{COUNTER.count} compilations after start-up"
    assert together == alone
    assert alone == [reference_greedy("dense", p, 8) for p in prompts]
    _assert_all_free(prog)


def test_decode_and_prefill_read_a_position_the_same():
    """The log-prob of generated token j from the decode step that proposed it equals the one a
    prefill of prompt + tokens[:j] gives: a chunk attends to its own K/V quantized and
    dequantized, i.e. what its pages hold (an unquantized chunk differs by ~1e-3 here)."""
    prog = _prog()
    prompt = reference("dense")["token_ids"][2, :9].tolist()
    a = _admit(prog, prompt, 7, GREEDY_LP)
    seen = []
    while (pb := prog.prefill(a)) is None:
        pass
    seen += [lp for lp, _ in pb.row_logprobs(0)]
    prog.commit(pb, [1])
    for _ in range(6):
        pb = prog.decode([a])
        seen += [lp for lp, _ in pb.row_logprobs(0)]
        prog.commit(pb, [1])
    generated = prog.tokens(a)[len(prompt):]
    prog.release(a)
    for j in (3, 6):
        b = _admit(prog, prompt + generated[:j], 1, GREEDY_LP)
        while (pb := prog.prefill(b)) is None:
            pass
        assert pb.row_tokens(0) == [generated[j]]
        np.testing.assert_allclose(pb.row_logprobs(0)[0][0], seen[j], atol=2e-5)
        prog.abort_pending(pb)
        prog.release(b)
    _assert_all_free(prog)


def test_steps_write_the_int8_pools_in_place():
    """Every pool, the scales included, is donated to the steps; the compiled prefill and
    decode hold no copy of a K/V or scale pool and no float pool (pages are dequantized page
    by page inside attention, never whole)."""
    prog = _prog()
    h = _admit(prog, [5, 6, 7], 3)
    old = prog.pools
    run_to_completion(prog, {h: 2})
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    prog.release(h)
    k = prog.pools.k
    pool = ",".join(map(str, k.shape))
    scales = ",".join(map(str, k.shape[:3]))
    for key in (StepKey(StepKind.PREFILL, 1), StepKey(StepKind.DECODE, B),
                StepKey(StepKind.RESTORE, 1)):
        text = prog.executables._get(key).as_text()
        assert f"s8[{pool}]" in text and f"f32[{scales}]" in text, key
        assert not re.search(rf"(s8\[{pool}\]|f32\[{scales}\])\S* copy\(", text), key
        assert f"f32[{pool}]" not in text, key


def _checkpoint(prog, prompt, decode_after: int):
    a = _admit(prog, prompt, decode_after + 1)
    run_to_completion(prog, {a: 1})
    ckpt = prog.capture(a)
    for _ in range(decode_after):  # a keeps writing into the shared last page
        prog.commit(prog.decode([a]), [1])
    prog.release(a)
    return ckpt


def _continue(prog, prompt, source=None, n=6):
    b = _admit(prog, prompt, n, source=source)
    run_to_completion(prog, {b: n})
    out = prog.tokens(b)[len(prompt):]
    prog.release(b)
    return out


def test_checkpoints_and_page_images_continue_as_a_cold_run():
    """A checkpoint at frontier 13 (a partial last page), restored on the device, and its image
    exported and imported back (as buffers, and as the store's one raw buffer a page): each
    continues a longer prompt with the cold run's tokens; the image round-trips byte for byte
    (int8 K and V, then their scales) with nothing past the frontier in its tail page."""
    prog = _prog()
    ids = reference("dense")["token_ids"][1].tolist()
    base, longer = ids[:13], ids[:17]
    cold = _continue(prog, longer)
    ckpt = _checkpoint(prog, base, decode_after=2)
    assert _continue(prog, longer, ckpt) == cold
    image = prog.export_checkpoint(ckpt)
    prog.release_checkpoint(ckpt)
    assert [(b.dtype, b.shape) for b in image.pages[0]] == [
        (np.int8, (2, 4, 2, 32))] * 2 + [(np.float32, (2, 4, 2))] * 2
    assert all(sum(b.nbytes for b in page) == prog.limits.page_bytes for page in image.pages)
    for part in image.pages[-1]:  # position 12 is the frontier's last; 13.. hold nothing
        assert part[:, :1].any() and not part[:, 1:].any()
    raw = CheckpointImage(image.tokens, [[np.concatenate([b.reshape(-1).view(np.uint8)
                                                          for b in page])] for page in image.pages],
                          image.state)
    for img in (image, raw):
        ckpt = prog.import_checkpoint(img)
        again = prog.export_checkpoint(ckpt)
        assert [[b.tobytes() for b in page] for page in again.pages] == [
            [b.tobytes() for b in page] for page in image.pages]
        assert again.state.tobytes() == image.state.tobytes()
        assert _continue(prog, longer, ckpt) == cold
        prog.release_checkpoint(ckpt)
    _assert_all_free(prog)
    assert prog.stats().num_checkpoints == 0


@pytest.mark.slow  # two demo-model Programs: ~60 s
def test_mtp_verify_windows_on_int8_pages_equal_decoding_without_speculation():
    """MTP rounds (K = 2: the verify window attends through the prefill kernel's path, its
    own K/V quantized and dequantized) give the greedy tokens of one-token decode rounds, both
    on int8 pages, with the demo model's trained head accepting drafts."""
    from ninfer_jax.loader import load_model
    from ninfer_jax.program.program import Program
    from tests.program.test_speculative_program import PCFG, _prompts, generate

    demo = load_model()
    outputs = {}
    for k in (0, 2):
        pcfg = ProgramConfig(**{**PCFG, "max_concurrency": B, "num_checkpoint_slots": 0},
                             speculative="mtp" if k else "off", num_speculative_tokens=k,
                             kv_dtype="int8")
        prog = Program(demo.config, demo.params, pcfg)
        prog.wait_compiled()
        outputs[k] = generate(prog, _prompts(3, demo.config.vocab_size))
        prog.close()
    assert outputs[2][0] == outputs[0][0]
    assert np.mean(outputs[2][1]) > 1.3  # rounds proposed several tokens
