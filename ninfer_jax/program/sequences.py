"""The host record of one live sequence of the Program.

Owns the `SeqRecord` fields and the `SeqState` a sequence moves through (PREFILL -> ACTIVE).
`HostProgram` (`host.py`) creates, mutates and drops the records; its subclasses read them in
their `_run_*` steps. Imports no jax.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from ninfer_jax.program.pending import SequenceHandle
from ninfer_jax.sampling_params import SamplingParams


class SeqState(enum.Enum):
    PREFILL = "prefill"  # consuming its prompt in chunks
    ACTIVE = "active"  # decode-ready: its last token is committed output not yet in the state


@dataclasses.dataclass
class SeqRecord:
    handle: SequenceHandle
    slot: int
    tokens: list[int]  # committed tokens: prompt, then generated
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    reserved: int  # pages still reserved (not yet allocated) for this sequence
    stop_ids: tuple[int, ...] = ()  # not sampled before sampling.min_tokens generated tokens
    pages: list[int] = dataclasses.field(default_factory=list)
    frontier: int = 0  # positions whose K/V and GDN effect are committed
    state: SeqState = SeqState.PREFILL
    # The allowed-token bitmask of the next sampled token ([mask_words] uint32, None: any
    # token): set by each prefill / decode / control call from its caller's masks.
    mask: np.ndarray | None = None
    # The prompt's images and videos (frontend.vision.VisionInput, in prompt order), what they
    # give the model (`_prepare_media`: the MRoPE RopeIndex, the prompt positions of the
    # placeholders [M], where each medium's run starts), and their embeddings [M, H] once the
    # vision encoder has run (before the first prefill chunk holding a placeholder).
    media: tuple = ()
    rope: Any = None
    vision_at: np.ndarray | None = None
    media_starts: tuple[int, ...] = ()
    vision_embeds: Any = None
    # Generated tokens committed by a round whose tokens the host has not read yet (a chained
    # decode round took them on the device; `HostProgram._resolve` appends them to `tokens`).
    unread: int = 0
    # The position after the last one a bare decode round left out of the drafter's context
    # (0: none since the sequence's start): a DFlash block reads the ring only from here on
    # (`DecodeInputs.context_from`), a checkpoint keeps it from here on; `context_stale`.
    context_from: int = 0
    # Its last committed step was a decode round (not a prefill chunk or forced control), so
    # with MTP the head's K/V at frontier - 1 holds the token at the frontier (the Program's
    # lean rounds of 0 write only their own position's).
    after_decode: bool = False

    def media_before(self, frontier: int) -> tuple[str, ...]:
        """Digests of the media whose placeholders start before `frontier`."""
        return tuple(m.digest for m, at in zip(self.media, self.media_starts) if at < frontier)

    @property
    def generated(self) -> int:
        return len(self.tokens) + self.unread - self.prompt_len
