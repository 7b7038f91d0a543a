"""MRoPE position ids of a prompt with images and videos (host side, numpy).

A prompt's tokens fall into runs of text and runs of vision placeholders. Text tokens count up
in all three rows (temporal, height, width). A run of placeholders is one image, or one frame
of a video (a video's frames are separated by their timestamps' text), laid out as its merged
grid: every token of the run takes the position where the run starts in the temporal row, plus
its grid row in the height row and its grid column in the width row; the text after it starts
at that position plus the larger of the grid's height and width. This is transformers'
`Qwen3_5Model.get_rope_index`. The delta `max(position) + 1 - len(prompt)` carries into decode:
token n after the prompt has rope position n + delta in every row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ninfer_jax.models.qwen3_6.config import ModelConfig

TEXT, IMAGE, VIDEO = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class RopeIndex:
    positions: np.ndarray  # [3, T] int32
    delta: int


def _runs(types: np.ndarray) -> list[tuple[int, int, int]]:
    """(type, start, end) of each maximal run of equal token types."""
    if types.size == 0:
        return []
    cut = np.flatnonzero(np.diff(types)) + 1
    starts = np.concatenate([[0], cut])
    ends = np.concatenate([cut, [types.size]])
    return [(int(types[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def rope_index(token_ids, cfg: ModelConfig, image_grids=(), video_grids=()) -> RopeIndex:
    """Positions [3, T] and the decode delta for one prompt. image_grids / video_grids: (t, h, w)
    in patches of each image / video, in prompt order. Raises ValueError when a placeholder run
    does not have its grid's merged token count or the grids and runs do not pair up."""
    ids = np.asarray(token_ids, np.int64)
    types = np.where(ids == cfg.image_token_id, IMAGE,
                     np.where(ids == cfg.video_token_id, VIDEO, TEXT))
    m = cfg.vision.spatial_merge_size if cfg.vision is not None else 1
    frames = {IMAGE: [tuple(int(x) for x in g) for g in image_grids], VIDEO: []}
    for t, h, w in video_grids:  # one run per frame: the timestamps separate them
        frames[VIDEO] += [(1, int(h), int(w))] * int(t)
    queues = {k: list(reversed(v)) for k, v in frames.items()}
    pieces, pos = [], 0
    for kind, start, end in _runs(types):
        n = end - start
        if kind == TEXT:
            pieces.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
            continue
        name = "image" if kind == IMAGE else "video frame"
        if not queues[kind]:
            raise ValueError(f"the prompt has more {name} placeholder runs than {name}s given")
        t, h, w = queues[kind].pop()
        gh, gw = h // m, w // m
        if n != t * gh * gw:
            raise ValueError(f"a {name} run of {n} placeholder tokens does not match its grid "
                             f"{(t, h, w)} ({t * gh * gw} merged tokens)")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
        pos += max(gh, gw)
    left = {k: len(q) for k, q in queues.items() if q}
    if left:
        raise ValueError(f"{sum(left.values())} image/video grids have no placeholder run in "
                         f"the prompt")
    positions = (np.concatenate(pieces, axis=1) if pieces
                 else np.zeros((3, 0), np.int64)).astype(np.int32)
    delta = int(positions.max()) + 1 - ids.size if ids.size else 0
    return RopeIndex(positions=np.ascontiguousarray(positions), delta=delta)
