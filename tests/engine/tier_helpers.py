"""Engine tests with a context store: a FakeProgram behind a real EngineCore whose checkpoints go
to a real `cache` -> `posix` pipe (or any registered store below the head), and the checks that
hold once everything is quiet (Program pages explained by the catalog, no pin, reservation, job
or request left in the store, every block identical in every tier)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
import zlib

from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.engine.blocks import TAG_BYTES, BlockLayout
from ninfer_jax.engine.tiers import ContextTiers, StoredPrefix
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.store import BlockId, StoreAssembler
from ninfer_jax.store.posix_files import HEADER, MAGIC, VERSION
from ninfer_jax.store.redis_store import HEADER as REDIS_HEADER
from ninfer_jax.testing.fake_program import FakeProgram, expected_tokens
from tests.engine.conftest import EOS, FRONTEND, TOKENIZER, limits, settle

PAGE_BYTES = 128
STATE_BYTES = 40  # + the 72-byte envelope: one block
BLOCK_BYTES = PAGE_BYTES + TAG_BYTES  # what the store holds per block: a page and its tag
IDENTITY = b"fake-model"


class RecordingTiers(ContextTiers):
    """ContextTiers that records, in worker order, what it was asked to offload and what it
    found, each with its cache scope."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.events: list[tuple[str, str | None, tuple[int, ...]]] = []

    def offload(self, program, ckpt, tokens, scope) -> None:
        self.events.append(("offload", scope, tuple(tokens)))
        super().offload(program, ckpt, tokens, scope)

    def find(self, tokens, scope, above=0) -> StoredPrefix | None:
        found = super().find(tokens, scope, above)
        if found is not None:
            self.events.append(("found", scope, found.tokens))
        return found


def topology(root: pathlib.Path, capacity: int, policy: str = "lru",
             lower: str = "posix", redis_url: str | None = None) -> dict:
    """A cache head over `lower`: a posix-like store in `root`, or Redis at `redis_url`."""
    config = {"url": redis_url} if lower == "redis" else {"root": str(root)}
    return {"type": "pipe", "stores": [
        {"store": "cache", "config": {"capacity": capacity, "block_bytes": BLOCK_BYTES,
                                      "policy": policy}},
        {"store": lower, "config": config}]}


def tier_limits(max_concurrency: int, **kw) -> ProgramLimits:
    return limits(max_concurrency, **{"page_bytes": PAGE_BYTES,
                                      "checkpoint_state_bytes": STATE_BYTES,
                                      "total_checkpoint_slots": 3, **kw})


@dataclasses.dataclass
class Tiered:
    core: EngineCore
    program: FakeProgram
    asm: StoreAssembler
    tiers: RecordingTiers
    root: pathlib.Path

    @property
    def head(self):
        return self.asm.root.tiers[0]

    @property
    def layout(self) -> BlockLayout:
        return self.tiers.layout


@contextlib.contextmanager
def tiered_engine(root: pathlib.Path, max_concurrency: int = 2, *, capacity: int = 64,
                  policy: str = "lru", lower: str = "posix", idle_wait_s: float = 0.005,
                  program_kw=None, redis_url: str | None = None,
                  tiers_cls: type = RecordingTiers, **limit_kw):
    lim = tier_limits(max_concurrency, **limit_kw)
    program = FakeProgram(lim, eos_id=EOS, **(program_kw or {}))
    asm = StoreAssembler(topology(root, capacity, policy, lower, redis_url))
    layout = BlockLayout(IDENTITY, lim.page_size, lim.rewrites_below_frontier, PAGE_BYTES,
                         STATE_BYTES)
    tiers = tiers_cls(asm.get_scheduler(), layout, asm.root.tiers)
    core = EngineCore(program, FRONTEND, EngineCoreConfig(max_queue=64, idle_wait_s=idle_wait_s),
                      tiers)
    try:
        yield Tiered(core, program, asm, tiers, root)
    finally:
        core.close()


def sampling(budget: int, seed: int = 0) -> SamplingParams:
    return SamplingParams(temperature=0.7 if seed else 0.0, seed=seed or None,
                          max_new_tokens=budget)


def submit(core: EngineCore, ids, budget: int, seed: int = 0, scope: str | None = None):
    return core.submit(FRONTEND.prepare(prompt_token_ids=list(ids)), sampling(budget, seed),
                       cache_scope=scope)


def want_ids(ids, budget: int, seed: int = 0) -> list[int]:
    """What the FakeProgram generates for the prompt `ids` alone."""
    return expected_tokens(list(ids), budget, seed=seed, vocab_size=TOKENIZER.vocab_size,
                           eos_id=EOS)


def wait_writes(core: EngineCore, timeout_s: float = 20.0):
    """Stats once the worker is idle (every retained checkpoint sent to the store) and no write
    or read of the context store is pending (a revoked read holds its blocks until it ends)."""
    settle(core)
    deadline = time.monotonic() + timeout_s
    while (s := core.stats()).tiers.pending_writes or s.tiers.pending_reads:
        assert s.available, s
        if time.monotonic() > deadline:
            raise AssertionError(f"writes or reads still pending after {timeout_s} s: {s.tiers}")
        time.sleep(0.002)
    return s


def block_files(root: pathlib.Path) -> list[pathlib.Path]:
    return sorted((root / "blocks").glob("*/*.blk"))


def block_path(root: pathlib.Path, block_id: bytes) -> pathlib.Path:
    return root / "blocks" / block_id.hex()[:2] / f"{block_id.hex()}.blk"


def forge(path: pathlib.Path, data: bytes) -> None:
    """Rewrites a block file with other data under a valid header and checksum: the posix tier
    serves it, and only the Engine's own checks can refuse it."""
    block_id = bytes.fromhex(path.name.split(".")[0])
    header = HEADER.pack(MAGIC, VERSION, 0, len(data), zlib.crc32(data), block_id)
    path.write_bytes(header + data)


def assert_program_explained(t: Tiered) -> None:
    """Quiet Program: no sequence, reservation or lane; every page not free is a checkpoint's."""
    p, (ckpt_pages, _) = t.program.stats(), t.program.checkpoint_footprint()
    assert p.num_sequences == 0 and p.reserved_pages == 0, p
    assert p.free_slots == p.total_slots, p
    assert p.free_pages == p.total_pages - ckpt_pages, (p, ckpt_pages)
    assert p.num_checkpoints == len(t.core.catalog), (p, len(t.core.catalog))
    held: dict[int, int] = {}
    for ckpt in t.program.checkpoints.records():
        for page in ckpt.pages:
            held[page] = held.get(page, 0) + 1
    assert all(t.program.pages.refcount(page) == held.get(page, 0)
               for page in range(p.total_pages))


def assert_store_quiet(t: Tiered, forged: frozenset[bytes] = frozenset()) -> None:
    """No window, pin, reservation, job or request left anywhere in the topology, and every
    block the head holds has the same bytes in the tier below (G1, G4, G5, G11), but those a
    test `forged` there."""
    head, entry = t.head, t.asm.root
    buf = head.buffer
    assert not buf.pending_ids(), buf.pending_ids()
    committed = buf.committed_ids()
    assert all(buf.pin_count(b) == 0 and buf.alloc_refs(b) == 0 for b in committed)
    assert buf.num_free_slots() + len(committed) == buf.capacity
    assert head.jobs.num_unconsumed() == 0 and not head._busy
    assert not entry._requests and not entry._in_flight
    lower = t.asm.root.tiers[1]
    assert lower._jobs.num_unconsumed() == 0
    ids = sorted(committed)
    for block_id, hit in zip(ids, lower.lookup(ids)):
        if hit and block_id.bytes not in forged:
            if lower.name == "redis":
                raw = (lower._client.get(lower.key_of(block_id)) or b"")[REDIS_HEADER.size:]
            else:
                raw = block_path(t.root, block_id.bytes).read_bytes()[HEADER.size:]
            assert raw == head.slab[buf.slot_of(block_id)].tobytes(), block_id


def stored_blocks(t: Tiered) -> set[BlockId]:
    return {BlockId(bytes.fromhex(p.name.split(".")[0])) for p in block_files(t.root)}


def frontiers_of(events, scope: str | None) -> set[tuple[int, ...]]:
    return {tokens for kind, s, tokens in events if kind == "offload" and s == scope}
