"""Images and videos through the Program on the `vision` fixture: the vision encoder runs before
the first prefill chunk that holds a placeholder (a compiled bucket of patches), staged prefill
chunks cut through the images, decode carries each row's MRoPE delta, and greedy tokens equal
transformers' (`tests/fixtures/vision/reference.npz`) alone and two rows together. A checkpoint
remembers its prefix's images: the same image restores it, another one is refused."""

from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np
import pytest

from ninfer_jax import load_model
from ninfer_jax.frontend.vision import (
    VisionProcessorConfig,
    open_image,
    process_image,
    process_video,
)
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.errors import InfeasibleError, ResourceError
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.program.program import Program
from tests.conftest import FIXTURES

DIR = FIXTURES / "vision"
PROMPTS = {"one_image": ("image", ["grad_64x48.png"]),
           "two_images": ("image", ["shapes_200x120.png", "noise_53x37.png"]),
           "video": ("video", [f"frame{i}_64x48.png" for i in range(4)])}


@functools.cache
def ref() -> dict:
    with np.load(DIR / "reference.npz") as f:
        return {k: f[k] for k in f.files}


@functools.cache
def program() -> Program:
    m = load_model(DIR)
    pcfg = ProgramConfig(max_concurrency=2, page_size=8, num_pages=96, max_seq_len=128,
                         prefill_chunk=16, num_checkpoint_slots=2, max_vision_patches=512)
    prog = Program(m.config, m.params, pcfg)
    prog.wait_compiled()
    return prog


def media(name: str):
    kind, files = PROMPTS[name]
    pcfg = VisionProcessorConfig.from_dir(DIR)

    def one(f):
        data = (DIR / "images" / f).read_bytes()
        return open_image(data, f), hashlib.sha256(data).hexdigest()

    loaded = [one(f) for f in files]
    if kind == "image":
        return [process_image(img, pcfg, digest) for img, digest in loaded]
    return [process_video([img for img, _ in loaded], pcfg,
                          hashlib.sha256(b"".join(d.encode() for _, d in loaded)).hexdigest())]


def _start(prog: Program, name: str, plan=None, items=None):
    ids = ref()[f"{name}/ids"].tolist()
    plan = plan or prog.plan_admission(len(ids), len(ref()[f"{name}/greedy"]))
    h = prog.materialize(plan, ids, media=media(name) if items is None else items)
    while (batch := prog.prefill(h)) is None:
        pass
    prog.commit(batch, [1])
    return h


def _decode(prog: Program, handles, steps: int) -> None:
    for _ in range(steps):
        prog.commit(prog.decode(handles), [1] * len(handles))


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_tokens_equal_transformers(name):
    prog, r = program(), ref()
    h = _start(prog, name)
    want = r[f"{name}/greedy"].tolist()
    _decode(prog, [h], len(want) - 1)
    assert prog.tokens(h)[len(r[f"{name}/ids"]):] == want
    prog.release(h)


def test_two_rows_with_different_media_decode_together():
    prog, r = program(), ref()
    handles = [_start(prog, "two_images"), _start(prog, "video")]
    n = len(r["video/greedy"])
    _decode(prog, handles, n - 1)
    for h, name in zip(handles, ("two_images", "video")):
        assert prog.tokens(h)[len(r[f"{name}/ids"]):] == r[f"{name}/greedy"].tolist()[:n]
        prog.release(h)


def test_a_checkpoint_is_reused_only_with_the_same_images():
    prog, r = program(), ref()
    ids = r["two_images/ids"].tolist()
    stop = len(ids) - 3  # inside the text after both images
    first = prog.materialize(prog.plan_admission(len(ids), 4), ids, media=media("two_images"))
    while prog.frontier(first) < stop:
        assert prog.prefill(first, stop_at=stop) is None
    ckpt = prog.capture(first)
    prog.release(first)
    # the same prompt and images: restored at the checkpoint's frontier, the same tokens
    plan = prog.plan_admission(len(ids), len(r["two_images/greedy"]), source=ckpt)
    assert plan.cached_tokens == stop
    again = _start(prog, "two_images", plan=plan)
    _decode(prog, [again], len(r["two_images/greedy"]) - 1)
    assert prog.tokens(again)[len(ids):] == r["two_images/greedy"].tolist()
    prog.release(again)
    # the same tokens and pixels under another image's digest: refused
    other = media("two_images")
    other[0] = type(other[0])(other[0].kind, other[0].patches, other[0].grid,
                              other[0].merge_size, digest="another image")
    plan = prog.plan_admission(len(ids), 4, source=ckpt)
    with pytest.raises(ResourceError, match="images/videos before position .* are not those"):
        prog.materialize(plan, ids, media=other)
    prog.release_checkpoint(ckpt)
    assert not prog.handles()


@functools.cache
def mtp_program() -> Program:
    """The fixture with a random one-layer MTP head (`mtp.*` weights), K = 2 and the adaptive
    draft policy's rounds of 0, 1 and 2 drafts."""
    import jax

    from ninfer_jax.models.qwen3_6.weights import init_params

    m = load_model(DIR)
    mtp = init_params(m.config, jax.random.key(5), num_mtp_layers=1)["mtp"]
    pcfg = ProgramConfig(max_concurrency=1, page_size=8, num_pages=48, max_seq_len=128,
                         prefill_chunk=16, max_vision_patches=512, speculative="mtp",
                         num_speculative_tokens=2)
    prog = Program(m.config, {**m.params, "mtp": mtp}, pcfg)
    prog.wait_compiled()
    return prog


@pytest.mark.parametrize("name", PROMPTS)
def test_images_with_mtp_give_the_greedy_tokens_of_transformers(name):
    """Verify rounds carry the row's MRoPE delta (its generated text's positions) like decode
    steps: rounds of 2, 0 and 1 drafts in turn give transformers' greedy tokens, and nothing
    compiles after start-up."""
    from tests.program.test_program import COUNTER

    prog, r = mtp_program(), ref()
    h = _start(prog, name)
    want, rounds = r[f"{name}/greedy"].tolist(), itertools.cycle([2, 0, 1, 2])
    COUNTER.count, COUNTER.active = 0, True
    try:
        while prog.num_generated(h) < len(want):
            batch = prog.decode([h], drafts=next(rounds))
            prog.commit(batch, batch.produced.tolist())
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0
    assert prog.tokens(h)[len(r[f"{name}/ids"]):] == want
    prog.release(h)


def test_encoder_buckets_and_refusals():
    prog, r = program(), ref()
    assert prog.pcfg.vision_buckets == (64, 128, 256, 512)
    keys = {k for k in prog.executables.keys()  # noqa: SIM118 (a table, not a dict)
            if k.kind is StepKind.VISION_ENCODE}
    assert keys == {StepKey(StepKind.VISION_ENCODE, 1, n) for n in (64, 128, 256, 512)}
    ids = r["one_image/ids"].tolist()
    plan = prog.plan_admission(len(ids), 4)
    short = ids[:-6] + ids[-4:]  # one placeholder and the vision end dropped
    with pytest.raises(InfeasibleError, match="11 placeholder tokens does not match its grid"):
        prog.materialize(prog.plan_admission(len(short), 4), short, media=media("one_image"))
    with pytest.raises(InfeasibleError, match="more image placeholder runs than images"):
        prog.materialize(prog.plan_admission(2 * len(ids), 4), ids + ids,
                         media=media("one_image"))
    big = media("two_images") * 2
    with pytest.raises(InfeasibleError, match="528 patches, more than max_vision_patches 512"):
        prog.materialize(plan, ids, media=big)
    assert not prog.handles()
    text = load_model(FIXTURES / "dense")
    plain = Program(text.config, text.params, ProgramConfig(max_concurrency=1, num_pages=16,
                                                            max_seq_len=64, prefill_chunk=16))
    with pytest.raises(InfeasibleError, match="no images or videos: the model has no vision"):
        plain.materialize(plain.plan_admission(len(ids), 4), ids, media=media("one_image"))
    plain.close()


def test_the_vision_region_is_the_encoder_working_memory_at_its_largest_bucket():
    prog = program()
    region = prog.vision_workspace_bytes()
    v = prog.cfg.vision
    n = prog.pcfg.vision_buckets[-1]
    # at least its inputs (patches and layout) and its output, more than the KV pages never
    assert region >= n * v.patch_dim * 4 + n // v.merge_unit * prog.cfg.hidden_size * 4
    text = load_model(FIXTURES / "dense")
    plain = Program(text.config, text.params, ProgramConfig(max_concurrency=1, num_pages=16,
                                                            max_seq_len=64, prefill_chunk=16))
    assert plain.vision_workspace_bytes() == 0
    plain.close()


@pytest.mark.slow  # ~35 s; the fp32 vision tests stay in the default run
def test_bfloat16_images_stay_close_to_float32():
    import jax.numpy as jnp

    m = load_model(DIR)
    pcfg = ProgramConfig(max_concurrency=1, page_size=8, num_pages=32, max_seq_len=128,
                         prefill_chunk=16, max_vision_patches=512, dtype="bfloat16")
    prog = Program(m.config, m.params, pcfg)
    items = media("two_images")
    got = prog.encode_media(items).astype(np.float32)
    want = program().encode_media(items)
    assert prog.params["vision"]["patch_w"].dtype == jnp.bfloat16
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.05 * scale  # bf16 weights and activations
    h = _start(prog, "two_images")  # the bf16 path runs end to end
    _decode(prog, [h], 2)
    assert len(prog.tokens(h)) == len(ref()["two_images/ids"]) + 3
    prog.release(h)
    prog.close()
