"""Image and video preprocessing: bit-identical to transformers' Qwen VL image processor on the
test images of `tests/fixtures/vision/images` (sizes 20-1000 pixels a side, aspect ratios up to
50, RGB / RGBA / L / P, PNG and JPEG) under three settings, and clear errors for bad media.

`preprocess.json` holds transformers' grid and the sha256 of its float32 pixel values for each
(settings, image), written by `scripts/make_vision_reference.py`; the dev-tier test reruns
transformers' processor itself on extra random sizes."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from ninfer_jax.frontend.vision import (
    MediaError,
    VisionProcessorConfig,
    open_image,
    process_image,
    process_video,
    sample_frames,
    smart_resize,
)
from tests.conftest import FIXTURES

DIR = FIXTURES / "vision"
REFERENCE = json.loads((DIR / "preprocess.json").read_text())
CASES = [(k, name) for k, v in REFERENCE.items() for name in v["images"]]


def _image(name: str) -> Image.Image:
    return open_image((DIR / "images" / name).read_bytes(), part=name)


@pytest.mark.parametrize("settings,name", CASES)
def test_pixels_and_grid_equal_transformers(settings, name):
    cfg = VisionProcessorConfig.from_dict(REFERENCE[settings]["settings"])
    want = REFERENCE[settings]["images"][name]
    got = process_image(_image(name), cfg)
    assert list(got.grid) == want["grid"]
    assert list(got.patches.shape) == want["shape"] and got.patches.dtype == np.float32
    assert hashlib.sha256(got.patches.tobytes()).hexdigest() == want["sha256"]
    t, h, w = got.grid
    assert got.num_tokens == t * h * w // cfg.merge_size ** 2


def test_smart_resize_keeps_multiples_and_pixel_limits():
    rng = np.random.default_rng(0)
    for _ in range(300):
        h, w = (int(x) for x in rng.integers(1, 3000, 2))
        if max(h, w) / min(h, w) > 200:
            continue
        rh, rw = smart_resize(h, w, 32, 32 * 32 * 4, 32 * 32 * 400)
        assert rh % 32 == 0 and rw % 32 == 0 and rh >= 32 and rw >= 32
        assert rh * rw <= 32 * 32 * 400
        assert rh * rw >= 32 * 32 * 4 or min(rh, rw) == 32


def test_video_frames_pad_to_whole_temporal_patches():
    cfg = VisionProcessorConfig.from_dir(DIR)
    frames = [_image(f"frame{i}_64x48.png") for i in range(3)]
    v = process_video(frames, cfg)
    four = process_video(frames + frames[-1:], cfg)
    assert v.grid == four.grid == (2, 6, 8)
    np.testing.assert_array_equal(v.patches, four.patches)  # the last frame repeated


def test_frame_sampling_follows_fps():
    idx = sample_frames(100, 25.0, fps=2.0)  # 4 s of video at 2 frames a second
    assert idx[0] == 0 and idx[-1] == 99 and len(idx) == 8 and np.all(np.diff(idx) > 0)
    assert len(sample_frames(3, 30.0)) == 3  # never more frames than the video has
    assert len(sample_frames(1000, None, fps=2.0)) == 83  # unknown rate: 24 a second
    with pytest.raises(MediaError, match="no frames"):
        sample_frames(0, 30.0)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_bad_media_raise_errors_naming_the_part():
    good = _png(Image.new("RGB", (40, 30), (10, 20, 30)))
    with pytest.raises(MediaError, match="messages\\[0\\].content\\[1\\]: not a readable image"):
        open_image(good[: len(good) // 2], part="messages[0].content[1]")
    with pytest.raises(MediaError, match="photo: not a readable image"):
        open_image(b"%PDF-1.4 not an image", part="photo")
    cfg = VisionProcessorConfig.from_dir(DIR)
    with pytest.raises(MediaError, match="img: image aspect ratio 400 exceeds 200"):
        process_image(Image.new("RGB", (4000, 10)), cfg, part="img")
    with pytest.raises(MediaError, match="clip: a video needs at least one frame"):
        process_video([], cfg, part="clip")
    with pytest.raises(MediaError, match="clip: 769 frames exceed max_frames 768"):
        process_video([Image.new("RGB", (8, 8))] * 769, cfg, part="clip")
    with pytest.raises(MediaError, match="min_pixels .* exceeds max_pixels"):
        VisionProcessorConfig(min_pixels=100, max_pixels=10)


def test_settings_must_fit_the_vision_tower():
    from ninfer_jax import load_model

    vision = load_model(DIR).config.vision
    VisionProcessorConfig.from_dir(DIR).check_model(vision)
    with pytest.raises(MediaError, match="patch_size \\(14\\) does not match .* \\(8\\)"):
        VisionProcessorConfig().check_model(vision)


@pytest.mark.dev
def test_random_sizes_equal_transformers_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rng = np.random.default_rng(3)
    settings = REFERENCE["model"]["settings"]
    theirs = Qwen2VLImageProcessorPil(**settings)
    cfg = VisionProcessorConfig.from_dict(settings)
    for _ in range(20):
        w, h = (int(x) for x in rng.integers(8, 400, 2))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        r = theirs(images=[image], return_tensors="np")
        ours = process_image(image, cfg)
        assert list(ours.grid) == r["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.patches, r["pixel_values"])
