"""The vision-language path equals transformers on the `vision` fixture
(`scripts/make_vision_reference.py`: a tiny `Qwen3_5ForConditionalGeneration`, fp32).

For one image, two images of different sizes and a four-frame video: our preprocessing gives the
pixel values the model was given bit for bit, the vision tower's merged embeddings and the full
logits agree within 1e-4, the MRoPE position ids and the decode delta are equal, and greedy
continuations are identical, both by re-running the whole prompt (as the reference did) and by
prefill + decode on a KV cache with the delta carried."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from ninfer_jax import load_model
from ninfer_jax.frontend.vision import VisionProcessorConfig, process_image, process_video
from ninfer_jax.models.qwen3_6 import ContiguousKV, GDNState, forward, step
from ninfer_jax.models.qwen3_6.mrope import rope_index
from ninfer_jax.models.qwen3_6.vision import encode, vision_layout
from tests.conftest import FIXTURES

DIR = FIXTURES / "vision"
PROMPTS = {"one_image": ("image", ["grad_64x48.png"]),
           "two_images": ("image", ["shapes_200x120.png", "noise_53x37.png"]),
           "video": ("video", [f"frame{i}_64x48.png" for i in range(4)])}


@functools.cache
def model():
    return load_model(DIR)


@functools.cache
def ref() -> dict:
    with np.load(DIR / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def image(name: str) -> Image.Image:
    with Image.open(DIR / "images" / name) as f:
        f.load()
        return f.copy()


def inputs(name: str):
    """Our preprocessing of the prompt's media: (patches, grids, kind)."""
    kind, files = PROMPTS[name]
    pcfg = VisionProcessorConfig.from_dir(DIR)
    if kind == "image":
        items = [process_image(image(f), pcfg) for f in files]
    else:
        items = [process_video([image(f) for f in files], pcfg)]
    return np.concatenate([i.patches for i in items]), [i.grid for i in items], kind


def embeds(name: str, padded: int | None = None) -> np.ndarray:
    m = model()
    patches, grids, _ = inputs(name)
    layout = vision_layout(grids, m.config.vision, padded)
    if padded is not None:
        patches = np.concatenate([patches, np.zeros((padded - len(patches), patches.shape[1]),
                                                     np.float32)])
    out = jax.jit(encode, static_argnums=1)(m.params["vision"], m.config.vision, patches,
                                            *layout.arrays())
    return np.asarray(out)[:layout.num_patches // m.config.vision.merge_unit]


@pytest.mark.parametrize("name", PROMPTS)
def test_preprocessing_gives_the_reference_pixels_bit_for_bit(name):
    patches, grids, _ = inputs(name)
    r = ref()
    assert [list(g) for g in grids] == r[f"{name}/grids"].tolist()
    assert patches.dtype == np.float32
    np.testing.assert_array_equal(patches, r[f"{name}/pixels"])


@pytest.mark.parametrize("name", PROMPTS)
def test_vision_embeddings_equal_transformers(name):
    np.testing.assert_allclose(embeds(name), ref()[f"{name}/embeds"], rtol=0, atol=1e-4)


def test_padding_patches_change_no_real_embedding():
    # padding sits in a segment of its own: the real patches' outputs are unchanged
    np.testing.assert_allclose(embeds("two_images", padded=64 * 5), embeds("two_images"),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", PROMPTS)
def test_mrope_positions_and_delta_equal_transformers(name):
    cfg, r = model().config, ref()
    _, grids, kind = inputs(name)
    idx = rope_index(r[f"{name}/ids"], cfg, **{f"{kind}_grids": grids})
    np.testing.assert_array_equal(idx.positions, r[f"{name}/positions"])
    assert idx.delta == int(r[f"{name}/delta"])


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, ids, positions, vision):
    return forward(params, cfg, ids[None], rope_positions=positions[:, None],
                   vision_embeds=vision)[0]


def _logits(name: str, ids: np.ndarray) -> np.ndarray:
    m = model()
    _, grids, kind = inputs(name)
    idx = rope_index(ids, m.config, **{f"{kind}_grids": grids})
    return np.asarray(_forward(m.params, m.config, jnp.asarray(ids),
                               jnp.asarray(idx.positions), jnp.asarray(embeds(name))))


@pytest.mark.parametrize("name", PROMPTS)
def test_logits_equal_transformers(name):
    r = ref()
    np.testing.assert_allclose(_logits(name, r[f"{name}/ids"]), r[f"{name}/logits"],
                               rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_continuation_equals_transformers_by_full_forward(name):
    # the prompt and its continuation so far, with text filler after it: causal, so the logits
    # up to the last real token are those of the shorter sequence, and one shape compiles once
    r = ref()
    ids, n_new = r[f"{name}/ids"], len(r[f"{name}/greedy"])
    seq = np.zeros(len(ids) + n_new, np.int32)
    seq[:len(ids)] = ids
    for n in range(len(ids), len(ids) + n_new):
        seq[n] = int(np.argmax(_logits(name, seq)[n - 1]))
    assert seq[len(ids):].tolist() == r[f"{name}/greedy"].tolist()


@pytest.mark.parametrize("name", PROMPTS)
def test_greedy_decode_on_a_kv_cache_carries_the_rope_delta(name):
    m, r = model(), ref()
    cfg, ids = m.config, r[f"{name}/ids"]
    _, grids, kind = inputs(name)
    idx = rope_index(ids, cfg, **{f"{kind}_grids": grids})
    mask = (ids == cfg.image_token_id) | (ids == cfg.video_token_id)
    placed = np.zeros((len(ids), cfg.hidden_size), np.float32)
    placed[mask] = embeds(name)
    n_new = len(r[f"{name}/greedy"])
    run = jax.jit(functools.partial(step, cfg=cfg))
    gdn, kv = GDNState.zeros(cfg, 1), ContiguousKV.zeros(cfg, 1, max_len=len(ids) + n_new)
    out = run(m.params, token_ids=jnp.asarray(ids)[None], start_pos=jnp.zeros((1,), jnp.int32),
              gdn=gdn, kv=kv, rope_positions=jnp.asarray(idx.positions)[:, None],
              vision_embeds=jnp.asarray(placed)[None], vision_mask=jnp.asarray(mask)[None])
    np.testing.assert_allclose(np.asarray(out.logits[0]), r[f"{name}/logits"], rtol=0, atol=1e-4)
    tokens = [int(np.argmax(out.logits[0, -1]))]
    gdn, kv = out.gdn, out.kv.advance(jnp.asarray([len(ids)], jnp.int32))
    for n in range(len(ids), len(ids) + n_new - 1):
        rope = jnp.full((3, 1, 1), n + idx.delta, jnp.int32)
        out = run(m.params, token_ids=jnp.asarray([[tokens[-1]]], jnp.int32),
                  start_pos=jnp.asarray([n], jnp.int32), gdn=gdn, kv=kv, rope_positions=rope)
        tokens.append(int(np.argmax(out.logits[0, -1])))
        gdn, kv = out.gdn, out.kv.advance(jnp.ones((1,), jnp.int32))
    assert tokens == r[f"{name}/greedy"].tolist()
