"""Images and videos -> the vision tower's patches (host side: Pillow and numpy).

Owns the Qwen VL preprocessing (DESIGN §14): an image is converted to RGB (transparency
composited onto white), resized with Pillow's bicubic filter to `smart_resize`'s size (both sides
multiples of patch_size x merge_size, the pixel count within [min_pixels, max_pixels], the aspect
ratio kept as closely as possible), scaled to [0, 1], normalised by the mean and std, and cut into
patches of C x temporal_patch x patch x patch values in spatial-merge-block order; an image is one
temporal patch (its frame repeated). A video is a list of frames (decoded by the caller or by
`sample_frames`), all resized to the first frame's size, its frame count padded to a multiple of
temporal_patch_size by repeating the last frame. The arithmetic is transformers'
`Qwen2VLImageProcessorPil` step for step (float64 scale, float32 normalisation), so the patches are
bit-identical to its `pixel_values`.

Bad media raise `MediaError` naming the part and the limit.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pathlib
from typing import Any

import numpy as np

from ninfer_jax.errors import NinferError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


class MediaError(NinferError, ValueError):
    """An image or video that cannot be used (unreadable, wrong type, too large)."""


@dataclasses.dataclass(frozen=True)
class VisionProcessorConfig:
    """The preprocessing settings (`preprocessor_config.json` / `video_preprocessor_config.json`
    of a Qwen VL checkpoint). A field the files leave out takes transformers' default for it
    (`Qwen2VLImageProcessorPil`, `Qwen3VLVideoProcessor`), so the same files give the same
    pixels; `check_model` refuses settings that do not fit the model's vision tower."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    video_min_pixels: int = 128 * 32 * 32
    video_max_pixels: int = 768 * 32 * 32
    max_frames: int = 768

    def __post_init__(self):
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                     "max_pixels", "video_min_pixels", "video_max_pixels", "max_frames"):
            if getattr(self, name) <= 0:
                raise MediaError(f"vision preprocessing: {name} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.min_pixels > self.max_pixels:
            raise MediaError(f"vision preprocessing: min_pixels ({self.min_pixels}) exceeds "
                             f"max_pixels ({self.max_pixels})")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, d: dict[str, Any], video: dict[str, Any] | None = None
                  ) -> VisionProcessorConfig:
        """From a preprocessor_config.json dict (and a video_preprocessor_config.json one)."""
        size = d.get("size") or {}
        kw: dict[str, Any] = {
            "patch_size": int(d.get("patch_size", 14)),
            "temporal_patch_size": int(d.get("temporal_patch_size", 2)),
            "merge_size": int(d.get("merge_size", 2)),
            "min_pixels": int(d.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            "max_pixels": int(d.get("max_pixels") or size.get("longest_edge")
                              or 28 * 28 * 1280),
            "image_mean": tuple(float(x) for x in d.get("image_mean", OPENAI_CLIP_MEAN)),
            "image_std": tuple(float(x) for x in d.get("image_std", OPENAI_CLIP_STD)),
        }
        if video:
            vsize = video.get("size") or {}
            kw["video_min_pixels"] = int(video.get("min_pixels") or vsize.get("shortest_edge")
                                         or cls.video_min_pixels)
            kw["video_max_pixels"] = int(video.get("max_pixels") or vsize.get("longest_edge")
                                         or cls.video_max_pixels)
            kw["max_frames"] = int(video.get("max_frames", cls.max_frames))
        return cls(**kw)

    def check_model(self, vision) -> None:
        """Raises MediaError unless these patches fit `vision` (a VisionConfig)."""
        for mine, theirs in (("patch_size", "patch_size"),
                             ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if getattr(self, mine) != getattr(vision, theirs):
                raise MediaError(f"preprocessor {mine} ({getattr(self, mine)}) does not match "
                                 f"the vision tower's {theirs} ({getattr(vision, theirs)})")

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> VisionProcessorConfig:
        path = pathlib.Path(path)
        d = json.loads((path / "preprocessor_config.json").read_text()) \
            if (path / "preprocessor_config.json").is_file() else {}
        v = path / "video_preprocessor_config.json"
        return cls.from_dict(d, json.loads(v.read_text()) if v.is_file() else None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class VisionInput:
    """One image or video ready for the tower: patches [t * h * w, patch_dim] float32, its grid
    (t, h, w) in patches, and the sha256 of the source bytes (the prefix identity)."""

    kind: str  # "image" | "video"
    patches: np.ndarray
    grid: tuple[int, int, int]
    merge_size: int
    digest: str = ""

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens in the prompt: the merged patches (a video's in one run per
        temporal patch)."""
        t, h, w = self.grid
        return t * h * w // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The resized (height, width): multiples of `factor`, pixels within [min, max], the aspect
    ratio as close as possible (transformers' `smart_resize`)."""
    if min(height, width) <= 0:
        raise MediaError(f"image has no pixels ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"image aspect ratio {max(height, width) / min(height, width):.0f} "
                         f"exceeds {MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image):
    """A PIL image in RGB, transparency composited onto white (as transformers does)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _normalised(rgb, size: tuple[int, int], cfg: VisionProcessorConfig) -> np.ndarray:
    """[3, H, W] float32 of an RGB PIL image resized to size (height, width)."""
    from PIL import Image

    height, width = size
    resized = rgb.resize((width, height), resample=Image.BICUBIC)
    chw = np.moveaxis(np.asarray(resized), -1, 0)
    scaled = (chw.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(cfg.image_mean, np.float32)
    std = np.asarray(cfg.image_std, np.float32)
    return ((scaled.T - mean) / std).T


def patchify(frames: np.ndarray, cfg: VisionProcessorConfig) -> tuple[np.ndarray, tuple]:
    """frames [T, C, H, W] (T a multiple of temporal_patch_size) -> patches [t * h * w, C * tp *
    p * p] in (t, block row, block col, row in block, col in block) order, and (t, h, w)."""
    n, c, height, width = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gt, gh, gw = n // tp, height // p, width // p
    x = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p)), (gt, gh, gw)


def open_image(data: bytes, part: str = "image"):
    """A PIL image from encoded bytes; MediaError naming `part` when it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise MediaError(f"{part}: not a readable image ({e})") from e
    return image


def process_image(image, cfg: VisionProcessorConfig, digest: str = "",
                  part: str = "image") -> VisionInput:
    """A PIL image -> its VisionInput (one temporal patch: the frame repeated)."""
    rgb = to_rgb(image)
    width, height = rgb.size
    try:
        size = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except MediaError as e:
        raise MediaError(f"{part}: {e}") from None
    frame = _normalised(rgb, size, cfg)
    frames = np.broadcast_to(frame, (cfg.temporal_patch_size, *frame.shape))
    patches, grid = patchify(frames, cfg)
    return VisionInput("image", patches, grid, cfg.merge_size, digest)


def video_smart_resize(num_frames: int, height: int, width: int, factor: int,
                       temporal_factor: int, min_pixels: int, max_pixels: int
                       ) -> tuple[int, int]:
    """The frames' resized (height, width): as `smart_resize`, but the pixel limits bound all
    frames together (the frame count rounded to temporal patches), and a side shorter than
    `factor` is first scaled up to it (transformers' Qwen3-VL video `smart_resize`)."""
    if min(height, width) <= 0:
        raise MediaError(f"video frames have no pixels ({width}x{height})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(f"video aspect ratio {max(height, width) / min(height, width):.0f} "
                         f"exceeds {MAX_ASPECT_RATIO} ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = max(round(num_frames / temporal_factor), 1) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def sample_frames(total_frames: int, video_fps: float | None, fps: float = 2.0,
                  min_frames: int = 4, max_frames: int = 768) -> np.ndarray:
    """Indices of the frames to keep: `fps` a second of a `video_fps` video (24 when unknown),
    at least min_frames and at most max_frames (and the video's), evenly spaced (transformers'
    `Qwen3VLVideoProcessor.sample_frames`)."""
    if total_frames <= 0:
        raise MediaError("video has no frames")
    rate = video_fps if video_fps and video_fps > 0 else 24.0
    n = int(total_frames / rate * fps)
    n = min(max(n, min_frames), max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int)


def process_video(frames: list, cfg: VisionProcessorConfig, digest: str = "",
                  part: str = "video") -> VisionInput:
    """Video frames (PIL images, in order, already sampled) -> its VisionInput. Every frame is
    resized to `video_smart_resize`'s size for the first frame's size and the frame count; the
    count is padded to a multiple of temporal_patch_size with the last frame. The resize and the
    normalisation are the image path's (Pillow bicubic); transformers' video processor runs
    torchvision's instead, so a video's pixels agree with it in layout and grid, not bit for
    bit."""
    if not frames:
        raise MediaError(f"{part}: a video needs at least one frame")
    if len(frames) > cfg.max_frames:
        raise MediaError(f"{part}: {len(frames)} frames exceed max_frames {cfg.max_frames}")
    rgb = [to_rgb(f) for f in frames]
    width, height = rgb[0].size
    try:
        size = video_smart_resize(len(rgb), height, width, cfg.factor, cfg.temporal_patch_size,
                                  cfg.video_min_pixels, cfg.video_max_pixels)
    except MediaError as e:
        raise MediaError(f"{part}: {e}") from None
    arrays = [_normalised(f, size, cfg) for f in rgb]
    arrays += [arrays[-1]] * (-len(arrays) % cfg.temporal_patch_size)
    patches, grid = patchify(np.stack(arrays), cfg)
    return VisionInput("video", patches, grid, cfg.merge_size, digest)
