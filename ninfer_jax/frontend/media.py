"""Images and videos inside chat messages: from message parts to the prompt's media and tokens.

Owns (DESIGN §2, Frontend) what a vision prompt is beyond its text: each image or video part of
a message becomes a `VisionInput` (Pillow preprocessing, `frontend/vision.py`) with the sha256 of
its source, the part itself becomes the template's `{"type": "image"}` / `{"type": "video"}`
(the chat template writes `<|vision_start|><|image_pad|><|vision_end|>`), and after tokenizing,
each pad the template wrote is expanded as transformers' Qwen3-VL processor does: an image's pad
into one pad per merged patch; a video's into, for each temporal patch, its timestamp text
`<t seconds>` (the mean time of the patch's frames, one decimal) then `<|vision_start|>`, one
video pad per merged patch of a frame, `<|vision_end|>`.

The prompt's identity (prefix reuse): the same token ids with every placeholder replaced by an
id derived from its medium's digest and its index in the medium (ids in [2^30, 2^31), never
a real token), so two prompts with the same text and other images share no prefix past the first
image, and a follow-up turn with the same image reuses it.

A part may hold: a PIL image; a path (str, `file://` URL or pathlib.Path; see
`VisionTokens.local_media`); encoded bytes; a data URL (`data:image/png;base64,...`). A video:
a file in any of those forms, decoded with PyAV and sampled at `fps` frames a second (default
2, 4..768 frames), or a list of frames (any image form), `fps` then being their rate.
Errors are `PromptError`s naming the part (`messages[1].content[0]`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.frontend.vision import (
    MediaError,
    VisionInput,
    VisionProcessorConfig,
    open_image,
    process_image,
    process_video,
    sample_frames,
)

IDENTITY_BASE = 1 << 30  # identity ids are in [2^30, 2^31): int32 like every token id
IMAGE_KEYS = ("image", "image_url")
MAX_MEDIA_BYTES = 64 << 20  # one encoded image


@dataclasses.dataclass(frozen=True)
class VisionTokens:
    """The model's vision token ids and processor settings (a model with a vision tower)."""

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    processor: VisionProcessorConfig
    # Local paths: True any, False none (a server without --allowed_media_dir), or a directory
    # they must be inside.
    local_media: bool | pathlib.Path = True
    # http(s) URLs: fetched within this many seconds (0: never fetched), at most
    # MAX_MEDIA_BYTES each.
    fetch_timeout_s: float = 0.0


class PartError(Exception):
    """A bad media part; `field` names it (the Frontend raises it as a PromptError)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _kind(part: Mapping[str, Any]) -> str | None:
    t = part.get("type")
    if t in ("image", "image_url") or (t is None and any(k in part for k in IMAGE_KEYS)):
        return "image"
    if t in ("video", "video_url") or (t is None and "video" in part):
        return "video"
    return None


def _fetch(url: str, field: str, timeout_s: float) -> bytes:
    """The body of an http(s) URL: within timeout_s in all, at most MAX_MEDIA_BYTES."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            chunks, size = [], 0
            while chunk := r.read(1 << 16):
                size += len(chunk)
                if size > MAX_MEDIA_BYTES:
                    raise PartError(field, f"{url!r} is larger than {MAX_MEDIA_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise PartError(field, f"fetching {url!r} took over {timeout_s:g} s")
                chunks.append(chunk)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise PartError(field, f"cannot fetch {url!r} ({e})") from None
    return b"".join(chunks)


def _bytes_of(source: Any, field: str, allowed: bool | pathlib.Path,
              fetch_timeout_s: float = 0.0) -> tuple[Any, str]:
    """(a PIL image, the sha256 of its source) from one image form."""
    from PIL import Image

    if isinstance(source, Image.Image):
        h = hashlib.sha256(f"{source.mode}{source.size}".encode())
        h.update(source.tobytes())
        return source, h.hexdigest()
    data = _source_bytes(source, field, allowed, fetch_timeout_s)
    try:
        return open_image(data, field), hashlib.sha256(data).hexdigest()
    except MediaError as e:
        raise PartError(field, str(e).removeprefix(f"{field}: ")) from None


def _source_bytes(source: Any, field: str, allowed: bool | pathlib.Path,
                  fetch_timeout_s: float, kind: str = "image") -> bytes:
    """The encoded bytes of a medium (`kind`: "image" or "video") given as bytes, a data URL
    (of that kind's type, or application/octet-stream), a path / file:// URL or (with fetching
    on) an http(s) URL."""
    if isinstance(source, Mapping) and "url" in source:  # OpenAI's {"url": ...}
        source = source["url"]
    if isinstance(source, str) and source.startswith("data:"):
        head, _, payload = source.partition(",")
        if ";base64" not in head:
            raise PartError(field, f"a data URL must be base64 (data:{kind}/...;base64,...)")
        mime = head.removeprefix("data:").split(";", 1)[0].strip().lower()
        if not (mime.startswith(f"{kind}/") or mime == "application/octet-stream"):
            raise PartError(field, f"a data URL of type {mime or 'text/plain'!r:.60} is not "
                                   f"an {kind} (data:{kind}/...;base64,...)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise PartError(field, f"bad base64 in the data URL ({e})") from None
    elif isinstance(source, (str, pathlib.Path)):
        text = str(source)
        if text.startswith(("http://", "https://")):
            if not fetch_timeout_s:
                raise PartError(field, "fetching media over http(s) is off; pass a data URL, "
                                       "a file or the image itself")
            return _fetch(text, field, fetch_timeout_s)
        if allowed is False:
            raise PartError(field, "local files are off (a server reads them only under its "
                                   "--allowed_media_dir); pass a data URL")
        path = pathlib.Path(text.removeprefix("file://"))
        try:
            path = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise PartError(field, f"no such file {text!r}") from None
        if allowed is not True and not path.is_relative_to(allowed):
            raise PartError(field, f"{text!r} is outside the allowed media directory")
        if not path.is_file():  # a directory, a device, a FIFO: nothing to decode
            raise PartError(field, f"{text!r} is not a regular file")
        try:
            if path.stat().st_size > MAX_MEDIA_BYTES:
                raise PartError(field, f"{text!r} is larger than {MAX_MEDIA_BYTES} bytes")
            data = path.read_bytes()
        except OSError as e:  # unreadable (permissions, removed meanwhile)
            raise PartError(field, f"cannot read {text!r} ({e.strerror or e})") from None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise PartError(field, f"expected a PIL image, a path, bytes or a data URL, got "
                                f"{type(source).__name__}")
    if len(data) > MAX_MEDIA_BYTES:
        raise PartError(field, f"the medium is larger than {MAX_MEDIA_BYTES} bytes")
    return data


def _medium(part: Mapping[str, Any], kind: str, field: str, vt: VisionTokens
            ) -> tuple[VisionInput, list[float]]:
    """The part's VisionInput and (videos) each temporal patch's timestamp in seconds."""
    if kind == "image":
        key = next((k for k in IMAGE_KEYS if k in part), None)
        if key is None:
            raise PartError(field, "an image part needs an 'image' (or 'image_url') field")
        image, digest = _bytes_of(part[key], f"{field}.{key}", vt.local_media,
                                  vt.fetch_timeout_s)
        try:
            return process_image(image, vt.processor, digest, part=field), []
        except MediaError as e:
            raise PartError(field, str(e).removeprefix(f"{field}: ")) from None
    frames = part.get("video")
    fps = part.get("fps", 2.0)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise PartError(f"{field}.fps", f"must be a positive number, got {fps!r}")
    if isinstance(frames, (str, pathlib.Path, bytes, bytearray, Mapping)):  # a video file
        data = _source_bytes(frames, f"{field}.video", vt.local_media, vt.fetch_timeout_s,
                             kind="video")
        images, indices, rate = decode_video(data, f"{field}.video", float(fps))
        digest = hashlib.sha256(data).hexdigest()
    elif isinstance(frames, Sequence):  # the frames themselves, `fps` a second
        loaded = [_bytes_of(f, f"{field}.video[{i}]", vt.local_media, vt.fetch_timeout_s)
                  for i, f in enumerate(frames)]
        images, indices, rate = [img for img, _ in loaded], list(range(len(loaded))), float(fps)
        digest = hashlib.sha256("".join(d for _, d in loaded).encode()).hexdigest()
    else:
        raise PartError(f"{field}.video", "a video is a file (path, bytes, URL) or a list of "
                                          "frames (images)")
    try:
        video = process_video(images, vt.processor, digest, part=field)
    except MediaError as e:
        raise PartError(field, str(e).removeprefix(f"{field}: ")) from None
    return video, timestamps(indices, rate, vt.processor.temporal_patch_size)


MAX_DECODED_FRAMES = 100_000  # frames read from one video file at most


def decode_video(data: bytes, field: str, fps: float) -> tuple[list[Any], list[int], float]:
    """(the sampled frames as PIL images, their indices in the video, the video's frame rate)
    of an encoded video file: `fps` frames a second (`sample_frames`), decoded with PyAV, only
    the sampled frames kept."""
    try:
        import av
    except ImportError:
        raise PartError(field, "decoding video files needs PyAV (pip install "
                               "'ninfer-jax[video]'); or send the frames as images") from None
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate or 0) or None
            total = stream.frames or sum(1 for _ in container.decode(video=0))
        if total > MAX_DECODED_FRAMES:
            raise PartError(field, f"the video has {total} frames, more than "
                                   f"{MAX_DECODED_FRAMES}")
        try:
            indices = [int(i) for i in sample_frames(total, rate, fps=fps)]
        except MediaError as e:
            raise PartError(field, str(e)) from None
        wanted, frames = set(indices), {}
        with av.open(io.BytesIO(data)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    frames[i] = frame.to_image()
                if i >= indices[-1]:
                    break
    except (av.error.FFmpegError, IndexError, ValueError, OSError) as e:
        raise PartError(field, f"not a readable video ({e})") from None
    indices = [i for i in indices if i in frames]  # a container that overstated its frames
    if not indices:
        raise PartError(field, "not a readable video (no frames decoded)")
    return [frames[i] for i in indices], indices, rate or 24.0


def extract_media(messages: list[dict[str, Any]], vt: VisionTokens | None
                  ) -> tuple[list[dict[str, Any]], list[tuple[VisionInput, list[float]]]]:
    """(messages with each media part replaced by the template's bare part, the media in
    order with each video's temporal-patch timestamps). Raises PartError naming the part."""
    out, media = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = _kind(part) if isinstance(part, Mapping) else None
            if kind is None:
                parts.append(part)
                continue
            field = f"messages[{i}].content[{j}]"
            if vt is None:
                raise PartError(field, "this model takes no images or videos")
            if message.get("role") == "system":
                raise PartError(field, f"a system message cannot hold {kind}s")
            media.append(_medium(part, kind, field, vt))
            parts.append({"type": kind})
        out.append({**message, "content": parts})
    return out, media


def timestamps(indices: Sequence[int], fps: float, temporal: int) -> list[float]:
    """Each temporal patch's time: the mean of its first and last frame's (frame i at i / fps,
    the last frame repeated to fill the patch), as transformers' Qwen3-VL processor computes
    it from the sampled frames' indices."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal)
    times = [i / fps for i in idx]
    return [(times[k] + times[k + temporal - 1]) / 2 for k in range(0, len(times), temporal)]


def _identity_ids(digest: str, n: int) -> list[int]:
    """The identity ids of a medium's n placeholders: 30 bits of sha256(digest, index) each,
    above every real token id."""
    seed = bytes.fromhex(digest)
    return [IDENTITY_BASE + (int.from_bytes(hashlib.sha256(
        seed + k.to_bytes(4, "little")).digest()[:4], "little") >> 2) for k in range(n)]


def expand(token_ids: Sequence[int], media: list[tuple[VisionInput, list[float]]],
           vt: VisionTokens, encode_text) -> tuple[list[int], list[int], list[int]]:
    """(the prompt with every pad the template wrote expanded, its identity ids, where each
    medium's first placeholder is). Raises ValueError when the template wrote other pads than
    the media need."""
    pads = [p for p, t in enumerate(token_ids) if t in (vt.image_token_id, vt.video_token_id)]
    if len(pads) != len(media):
        raise ValueError(f"the chat template wrote {len(pads)} image/video placeholders for "
                         f"{len(media)} media")
    ids: list[int] = []
    identity: list[int] = []
    starts: list[int] = []
    last = 0
    for p, (m, stamps) in zip(pads, media):
        want = vt.image_token_id if m.kind == "image" else vt.video_token_id
        if token_ids[p] != want:
            raise ValueError(f"placeholder at {p} is not the {m.kind}'s")
        text = list(token_ids[last:p])
        ids += text
        identity += text
        keys = _identity_ids(m.digest, m.num_tokens)
        if m.kind == "image":
            starts.append(len(ids))
            ids += [want] * m.num_tokens
            identity += keys
        else:
            per_patch = m.num_tokens // m.grid[0]
            for n, stamp in enumerate(stamps):
                head = encode_text(f"<{stamp:.1f} seconds>") + [vt.vision_start_token_id]
                ids += head
                identity += head
                if not n:
                    starts.append(len(ids))
                ids += [want] * per_patch + [vt.vision_end_token_id]
                identity += keys[n * per_patch:(n + 1) * per_patch] + [vt.vision_end_token_id]
        last = p + 1
    ids += token_ids[last:]
    identity += token_ids[last:]
    return ids, identity, starts


def identity_of(ids: Sequence[int], identity: Sequence[int] | None, n: int) -> tuple[int, ...]:
    """The identity of the first n tokens of a sequence whose prompt identity is `identity`
    (None: a text prompt; generated tokens are their own identity)."""
    if identity is None:
        return tuple(ids[:n])
    return tuple(identity[:n]) + tuple(ids[len(identity):n])
