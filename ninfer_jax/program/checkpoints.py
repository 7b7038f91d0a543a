"""The Program's checkpoints: immutable images of sequences that later sequences restore from.

A checkpoint at frontier F (DESIGN §7) holds one reference on each of the ceil(F / page_size)
KV pages holding positions [0, F), and a checkpoint slot with the GDN state after them. A
sequence restored from it shares the pages wholly below the first position it rewrites and
copies the next one (copy on write).

`Checkpoints` owns the checkpoint records, the checkpoint-slot allocator (with the publication
slots reserved in it for sequences' terminal captures) and the page references checkpoints
hold. `CheckpointCopies` is the execution side's part: the device copies a capture, restore,
export or import runs, supplied by the Program's subclasses (the device Program,
`ninfer_jax.testing.FakeProgram`). Neither owns sequences, their pages and reservations, or
`resource_revision`: `HostProgram` (`host.py`, a `CheckpointCopies`) checks the sequence side,
hands over what a record holds, passes the copies in and bumps the revision. Worker-owned;
imports no jax.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ninfer_jax.program.allocator import PageAllocator, SlotAllocator
from ninfer_jax.program.errors import ResourceError
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.program.pending import SequenceHandle
from ninfer_jax.program.sequences import SeqRecord


@dataclasses.dataclass(frozen=True)
class CheckpointId:
    ckpt_id: int


@dataclasses.dataclass
class CheckpointRecord:
    """An immutable image of a sequence at frontier F: the GDN state (in a checkpoint slot) and
    shared references to the KV pages holding positions [0, F)."""

    ckpt: CheckpointId
    tokens: tuple[int, ...]  # the F tokens whose effect the image holds
    slot: int  # checkpoint state slot
    pages: list[int]  # ceil(F / page_size) pages, one reference each
    # The digests of the images/videos whose placeholders start before F: two prompts with the
    # same tokens but other media share no checkpoint.
    media: tuple[str, ...] = ()

    @property
    def frontier(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class CheckpointImage:
    """A checkpoint's contents on the host, the form the context store holds: one list of
    buffers per K/V page (`page_bytes` in all; the last page holds nothing beyond what the
    tokens determine, see `engine/blocks.py`) and the state image (`checkpoint_state_bytes`)."""

    tokens: tuple[int, ...]
    pages: list[list[np.ndarray]]
    state: np.ndarray
    media: tuple[str, ...] = ()  # as CheckpointRecord.media

    @property
    def frontier(self) -> int:
        return len(self.tokens)


class CheckpointCopies(abc.ABC):
    """The device copies of checkpoints, supplied by the Program's execution side (the device
    Program, `ninfer_jax.testing.FakeProgram`) through `HostProgram`."""

    @abc.abstractmethod
    def _run_capture(self, seq: SeqRecord, ckpt_slot: int) -> None:
        """Copies the sequence's committed state into checkpoint slot `ckpt_slot`."""

    @abc.abstractmethod
    def _run_restore(self, ckpt: CheckpointRecord, seq: SeqRecord,
                     copy_page: tuple[int, int] | None) -> None:
        """Loads `ckpt`'s state into the sequence's slot (fresh penalty state, the checkpoint's
        tokens marked as prompt) and copies page copy_page[0] to copy_page[1] when given."""

    @abc.abstractmethod
    def _run_export(self, ckpt: CheckpointRecord, pages: Sequence[int]) -> CheckpointImage:
        """Copies the checkpoint's pages `pages` (indices into ckpt.pages; the others come back
        as empty lists) and its state image to the host."""

    @abc.abstractmethod
    def _run_import(self, ckpt: CheckpointRecord, image: CheckpointImage) -> None:
        """Writes `image` into the checkpoint's (fresh) pages and checkpoint slot."""


class Checkpoints:
    """Checkpoint records, checkpoint slots (publication slots among them) and the page
    references they hold, on the Program's page allocator."""

    def __init__(self, limits: ProgramLimits, pages: PageAllocator, ids: Iterator[int]):
        self.limits = limits
        self.pages = pages  # the Program's, shared with its sequences
        self.slots = SlotAllocator(max(limits.total_checkpoint_slots, 1))
        self._ids = ids  # the Program's: a checkpoint never has a sequence's id
        self._records: dict[int, CheckpointRecord] = {}
        self._publication: dict[SequenceHandle, int] = {}  # the checkpoint slot kept for each
        self._footprint: tuple[int, int] | None = None  # footprint(), until records change

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[CheckpointRecord]:
        return list(self._records.values())

    def record(self, ckpt_id: CheckpointId) -> CheckpointRecord:
        ckpt = self._records.get(ckpt_id.ckpt_id)
        if ckpt is None:
            raise ResourceError(f"unknown checkpoint {ckpt_id}")
        return ckpt

    @property
    def num_free_slots(self) -> int:
        return self.slots.num_free if self.limits.total_checkpoint_slots else 0

    def can_capture(self) -> bool:
        return self.limits.total_checkpoint_slots > 0 and self.slots.num_free > 0

    # Publication slots ---------------------------------------------------------------------
    def reserve_publication(self, handle: SequenceHandle) -> bool:
        """Keeps a free checkpoint slot for the sequence's terminal checkpoint (DESIGN §7: the
        publication slot, reserved at activation), so that its capture never needs a slot
        freed at the end. Reservations hold at most half the checkpoint slots (the rest serve
        the checkpoints being reused), so False when that half or every slot is taken."""
        if (handle not in self._publication and self.can_capture()
                and len(self._publication) < self.limits.total_checkpoint_slots // 2):
            self._publication[handle] = self.slots.allocate()
        return handle in self._publication

    def has_publication_slot(self, handle: SequenceHandle) -> bool:
        return handle in self._publication

    def drop_publication(self, handle: SequenceHandle) -> None:
        """Returns the sequence's publication slot, if it holds one (it ends uncaptured)."""
        slot = self._publication.pop(handle, None)
        if slot is not None:
            self.slots.release(slot)

    # Capture, export, import, release ------------------------------------------------------
    def capture(self, handle: SequenceHandle, tokens: Sequence[int], pages: Sequence[int],
                media: tuple[str, ...], publication: bool,
                write: Callable[[int], None]) -> CheckpointId:
        """A checkpoint of the F = len(tokens) committed tokens of sequence `handle`, sharing
        its first ceil(F / page_size) `pages`, in a free checkpoint slot or with `publication`
        the one the sequence reserved; `write(slot)` copies the sequence's state there."""
        if publication and handle not in self._publication:
            raise ResourceError(f"{handle} holds no publication slot")
        if not publication and not self.can_capture():
            raise ResourceError("no free checkpoint slot")
        held = list(pages[: -(-len(tokens) // self.limits.page_size)])
        for page in held:
            self.pages.incref(page)
        slot = self._publication.pop(handle) if publication else self.slots.allocate()
        ckpt = CheckpointRecord(CheckpointId(next(self._ids)), tuple(tokens), slot, held,
                                media=media)
        write(ckpt.slot)
        return self._add(ckpt)

    def export(self, ckpt_id: CheckpointId, pages: Sequence[int] | None,
               read: Callable[[CheckpointRecord, list[int]], CheckpointImage]
               ) -> CheckpointImage:
        """`read(record, page indices)`: the checkpoint's pages (all, or the listed indices)
        and state image on the host; the checkpoint stays as it was."""
        ckpt = self.record(ckpt_id)
        wanted = range(len(ckpt.pages)) if pages is None else pages
        if any(not 0 <= i < len(ckpt.pages) for i in wanted):
            raise ResourceError(f"page indices {list(wanted)} out of range for "
                                f"{len(ckpt.pages)} pages")
        return read(ckpt, sorted(set(wanted)))

    def can_import(self, frontier: int) -> bool:
        """Whether a checkpoint at `frontier` can be imported now (a free checkpoint slot and
        its pages among those no sequence was promised)."""
        return (self.can_capture()
                and self.pages.num_available >= -(-frontier // self.limits.page_size))

    def import_image(self, image: CheckpointImage,
                     write: Callable[[CheckpointRecord, CheckpointImage], None]) -> CheckpointId:
        """A new checkpoint holding `image`: fresh pages and a checkpoint slot, each with one
        reference, exactly as `capture` leaves them; `write` copies the image into them (when
        it raises, they are returned and nothing is kept)."""
        lim, f = self.limits, image.frontier
        if not 1 <= f < lim.max_seq_len:
            raise ResourceError(f"image frontier {f} must be in [1, {lim.max_seq_len})")
        if min(image.tokens) < 0 or max(image.tokens) >= lim.vocab_size:
            raise ResourceError(f"image token ids must be in [0, {lim.vocab_size})")
        n = -(-f // lim.page_size)
        sizes = [sum(np.asarray(b).nbytes for b in page) for page in image.pages]
        if len(sizes) != n or any(size != lim.page_bytes for size in sizes):
            raise ResourceError(f"image of frontier {f} needs {n} pages of {lim.page_bytes} "
                                f"bytes, got {sizes}")
        if np.asarray(image.state).nbytes != lim.checkpoint_state_bytes:
            raise ResourceError(f"image state has {np.asarray(image.state).nbytes} bytes, "
                                f"expected {lim.checkpoint_state_bytes}")
        if not self.can_import(f):
            raise ResourceError(f"no room to import a checkpoint of {n} pages: "
                                f"{self.pages.num_available} available pages, "
                                f"{self.slots.num_free} free checkpoint slots")
        self.pages.reserve(n)
        pages = [self.pages.allocate_reserved() for _ in range(n)]
        ckpt = CheckpointRecord(CheckpointId(next(self._ids)), tuple(image.tokens),
                                self.slots.allocate(), pages, media=tuple(image.media))
        try:
            write(ckpt, image)
        except BaseException:
            for page in pages:
                self.pages.decref(page)
            self.slots.release(ckpt.slot)
            raise
        return self._add(ckpt)

    def release(self, ckpt_id: CheckpointId) -> None:
        ckpt = self.record(ckpt_id)
        for page in ckpt.pages:
            self.pages.decref(page)
        self.slots.release(ckpt.slot)
        del self._records[ckpt_id.ckpt_id]
        self._footprint = None

    def _add(self, ckpt: CheckpointRecord) -> CheckpointId:
        self._records[ckpt.ckpt.ckpt_id] = ckpt
        self._footprint = None
        return ckpt.ckpt

    # Restore -------------------------------------------------------------------------------
    def shared_pages(self, frontier: int) -> int:
        """Pages a sequence restored at `frontier` shares with the checkpoint: those wholly
        below the first position it writes."""
        return (frontier - self.limits.rewrites_below_frontier) // self.limits.page_size

    def source(self, ckpt_id: CheckpointId, prompt_ids: Sequence[int], media: Sequence,
               media_starts: Sequence[int]) -> CheckpointRecord:
        """The checkpoint a prompt restores from; refused unless the prompt starts with its
        tokens and has its images/videos (`media`, whose placeholders start at
        `media_starts`) before its frontier."""
        ckpt = self.record(ckpt_id)
        if tuple(prompt_ids[: ckpt.frontier]) != ckpt.tokens:
            raise ResourceError(f"prompt does not start with the tokens of {ckpt_id}")
        digests = tuple(m.digest for m, at in zip(media, media_starts) if at < ckpt.frontier)
        if digests != ckpt.media:
            raise ResourceError(f"prompt's images/videos before position {ckpt.frontier} are "
                                f"not those of {ckpt_id}")
        return ckpt

    def share(self, ckpt: CheckpointRecord) -> list[int]:
        """The pages a sequence restored from `ckpt` shares with it, one reference taken on
        each for the sequence."""
        shared = ckpt.pages[: self.shared_pages(ckpt.frontier)]
        for page in shared:
            self.pages.incref(page)
        return list(shared)

    # Footprint and eviction ----------------------------------------------------------------
    def footprint(self) -> tuple[int, int]:
        """(distinct pages referenced by checkpoints, bytes they and their state images hold).
        Computed when the set of checkpoints changed, not on every call (stats read it every
        worker iteration)."""
        if self._footprint is None:
            pages = {p for ckpt in self._records.values() for p in ckpt.pages}
            self._footprint = (len(pages), len(pages) * self.limits.page_bytes
                               + len(self._records) * self.limits.checkpoint_state_bytes)
        return self._footprint

    def release_to_free(self, num_pages: int, evictable: Sequence[CheckpointId]
                        ) -> tuple[CheckpointId, ...] | None:
        """The fewest checkpoints, a prefix of `evictable`, whose release frees `num_pages`
        pages (pages no sequence or other checkpoint holds), or None."""
        refs: dict[int, int] = {}  # page -> references held by the checkpoints taken so far
        for i, ckpt_id in enumerate(evictable):
            for page in self.record(ckpt_id).pages:
                refs[page] = refs.get(page, 0) + 1
                if refs[page] == self.pages.refcount(page):  # nothing else holds it: freed
                    num_pages -= 1
            if num_pages <= 0:
                return tuple(evictable[: i + 1])
        return None
