"""The Program's static limits: sizes fixed at start-up that every layer reads.

Owns `ProgramLimits` (what one Program can hold and run: sequence length, pages, slots,
checkpoint slots, batch, chunk, vocabulary, speculation widths) and the token-mask width
derived from the vocabulary. Read by the host bookkeeping (`host.py`, `checkpoints.py`), the
executables and the Engine; frozen, so any thread may read them. Imports no jax.
"""

from __future__ import annotations

import dataclasses


def mask_words(vocab_size: int) -> int:
    """Width of an allowed-token bitmask: ceil(vocab_size / 32) uint32 words."""
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True)
class ProgramLimits:
    """Static limits, safe to read from any thread (they never change after start-up)."""

    max_seq_len: int
    page_size: int
    total_pages: int
    total_slots: int
    max_concurrency: int
    prefill_chunk: int
    vocab_size: int
    total_checkpoint_slots: int = 0
    page_bytes: int = 0  # K/V bytes of one page over all attention layers
    checkpoint_state_bytes: int = 0  # GDN state bytes of one checkpoint image
    verify_width: int = 1  # tokens a decode round may propose per row (drafts + 1)
    # Positions below the frontier that a continuation rewrites: 1 with MTP, whose K/V at the
    # frontier's last position depends on the token after it. A restored sequence owns the page
    # holding them (a copy), never a shared one.
    rewrites_below_frontier: int = 0
    speculative: str = "off"  # what drafts a round's extra tokens: "mtp", "dflash" (or "off")
    # The draft counts a decode round may have (ascending; the last is verify_width - 1): a
    # round of K proposes up to K + 1 tokens a row (`decode(drafts=K)`). None: only the last.
    round_drafts: tuple[int, ...] | None = None
    # W > 0: a round of 0 may be bare (`decode(bare=True)`: the drafter's context entry of its
    # position left empty, the DFlash drafter's or the MTP head's); W rounds of upkeep after a
    # row's last bare one, its drafter context is whole again (DFlash) or whole over its last
    # W positions (MTP, whose head skips the empty entries before) (`HostProgram.
    # context_stale`). 0: no bare rounds.
    context_window: int = 0

    def __post_init__(self):
        drafts = self.round_drafts or (self.verify_width - 1,)
        if list(drafts) != sorted(set(drafts)) or drafts[0] < 0 \
                or drafts[-1] != self.verify_width - 1:
            raise ValueError(f"round_drafts must ascend from >= 0 to verify_width - 1 = "
                             f"{self.verify_width - 1}, got {self.round_drafts}")
        object.__setattr__(self, "round_drafts", tuple(drafts))

    @property
    def mask_words(self) -> int:
        return mask_words(self.vocab_size)
