"""FakeProgram: the Program's host bookkeeping with a hand-computable "model" (no jax).

The fake model's state is a 32-bit rolling hash of every token it has consumed, and the next
token is a function of (state, position, seed): `expected_tokens` predicts any output without
running a network. The state lives where the real one does (committed per slot, provisional per
batch row until commit, checkpoint slots), so a wrong reuse, a lost commit or a leaked
provisional state changes the tokens. Admission, reservations, pages, slots, checkpoints,
revisions and PendingBatch rules are the real ones (`HostProgram`). Failures can be injected.

Hook points let a test act at an exact moment of the worker instead of after a sleep. Each runs
on the worker thread, in the middle of the Engine's iteration, with the sequences concerned:

    after_materialize  a sequence was created: its request is Materializing in the Engine
    after_prefill      a prefill chunk ran (after the last chunk, its PendingBatch is pending)
    after_decode       a decode round ran: its PendingBatch is pending
    after_control      a forced-control step ran: its PendingBatch is pending
    before_commit      the Engine decided the pending batch's rows and is committing them
    after_commit       Program state is committed; the Engine has not published it yet

`on(point, fn)` calls `fn(seqs)` there every time; `pause(point, when)` returns a `Gate` that
holds the worker the first time `when(seqs)` holds, until the test releases it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ninfer_jax.program.checkpoints import CheckpointImage, CheckpointRecord
from ninfer_jax.program.host import GREEDY, HostProgram, ResourcePlan
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.program.pending import PendingBatch, SequenceHandle
from ninfer_jax.program.sequences import SeqRecord
from ninfer_jax.sampling_params import MAX_LOGPROBS, SamplingParams

HOOK_POINTS = ("after_materialize", "after_prefill", "after_decode", "after_control",
               "before_commit", "after_commit")
Hook = Callable[[list[SeqRecord]], None]


def mix(state: int, token: int) -> int:
    """The fake model's state after consuming `token`."""
    x = (state * 1_000_003 + token * 7_919 + 12_345) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 15)


def next_token(state: int, position: int, seed: int, vocab_size: int, eos_id: int | None) -> int:
    """A lowercase letter, a space or (rarely) EOS for the token at absolute `position`."""
    h = mix(mix(state, position), seed) % 997
    if eos_id is not None and h < 4:
        return eos_id
    if h % 6 == 0:
        return min(32, vocab_size - 1)
    return 97 + h % 26 if vocab_size > 122 else h % vocab_size


def fake_logprobs(token: int, vocab_size: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The fake model's log-probs for a token it produced: it was the most likely, at 1/2, and
    token + i (mod vocab) comes next at 2^-(i + 1), for MAX_LOGPROBS alternatives."""
    n = min(MAX_LOGPROBS, vocab_size)
    top = tuple(((token + i) % vocab_size, -(i + 1) * math.log(2)) for i in range(n))
    return top[0][1], top


def _logprob_arrays(tokens: np.ndarray, vocab_size: int) -> tuple[np.ndarray, ...]:
    """(sampled [B, W], top ids [B, W, N], top log-probs [B, W, N]) of `fake_logprobs`."""
    n = min(MAX_LOGPROBS, vocab_size)
    ids = (tokens[..., None] + np.arange(n)) % vocab_size
    lps = np.broadcast_to(-(np.arange(n) + 1) * math.log(2), ids.shape).astype(np.float32)
    return lps[..., 0].copy(), ids.astype(np.int32), lps.copy()


def page_content(tokens, nbytes: int) -> np.ndarray:
    """The fake K/V of a page: a function of every token up to the page's end (or the
    checkpoint's frontier, for its last page), as a real page's K/V are."""
    state = 0
    for t in tokens:
        state = mix(state, t)
    return (np.arange(nbytes, dtype=np.uint32) * 2_654_435_761 + state).astype(np.uint8)


def expected_tokens(prompt: list[int], max_new: int, *, seed: int = 0, vocab_size: int,
                    eos_id: int | None) -> list[int]:
    """What FakeProgram generates for a prompt (up to and including EOS)."""
    state = 0
    for t in prompt:
        state = mix(state, t)
    out, pos = [], len(prompt)
    for _ in range(max_new):
        tok = next_token(state, pos, seed, vocab_size, eos_id)
        out.append(tok)
        if tok == eos_id:
            break
        state, pos = mix(state, tok), pos + 1
    return out


class InjectedFailure(RuntimeError):
    """Raised by FakeProgram where a test asked it to fail."""


class Gate:
    """Holds the worker at a hook point: the test `wait()`s until the worker is there, acts (the
    worker stands still meanwhile), then `release()`s it. A gate never released fails the worker
    after `timeout_s` (the Engine then fails every request) instead of hanging it."""

    def __init__(self, point: str, timeout_s: float):
        self.point, self.timeout_s = point, timeout_s
        self.seqs: list[SeqRecord] = []  # the sequences of the held call
        self._reached = threading.Event()
        self._go = threading.Event()

    @property
    def reached(self) -> bool:
        return self._reached.is_set()

    def hold(self, seqs: list[SeqRecord]) -> None:
        """On the worker: stop here until released."""
        self.seqs = seqs
        self._reached.set()
        if not self._go.wait(self.timeout_s):
            raise AssertionError(f"gate at {self.point} was not released in {self.timeout_s} s")

    def wait(self, timeout: float = 30.0) -> list[SeqRecord]:
        """Blocks until the worker is held here; returns the held sequences."""
        if not self._reached.wait(timeout):
            raise AssertionError(f"the worker did not reach {self.point} in {timeout} s")
        return self.seqs

    def release(self) -> None:
        self._go.set()


class FakeProgram(HostProgram):
    """A Program double. `fail_commit_at`: the n-th commit (0-based) raises InjectedFailure;
    `step_seconds`: each prefill/decode sleeps this long (a stand-in for model time in load
    tests and benchmarks; tests of exact moments use hooks).

    With `limits.verify_width` W > 1 a decode round speculates as the real one does: row b
    proposes 1..min(W, its limit) tokens, how many a hash of its state decides, and they are
    exactly the tokens one-token rounds would produce (speculation changes speed, not output);
    a commit of n adopts the state after the n-th. Like the real verify step it knows no EOS:
    a round goes on past one, and the Engine accepts the prefix up to it."""

    def __init__(self, limits: ProgramLimits, *, eos_id: int | None = None,
                 fail_commit_at: int | None = None, step_seconds: float = 0.0):
        super().__init__(limits)
        self.eos_id = eos_id
        self.fail_commit_at = fail_commit_at
        self.step_seconds = step_seconds
        self.num_commits = 0
        self.num_steps = 0
        self.prefilled_tokens = 0
        self._committed: dict[int, int] = {}  # slot -> state
        self._provisional: list[list[int]] = []  # batch row -> state after each position
        self._ckpt_states: dict[int, int] = {}  # checkpoint slot -> state
        self._worker: threading.Thread | None = None
        self._hooks: dict[str, list[Hook]] = {point: [] for point in HOOK_POINTS}

    # Hooks -------------------------------------------------------------------------------------
    def on(self, point: str, fn: Hook) -> None:
        """Calls `fn(seqs)` on the worker thread every time it reaches `point`."""
        if point not in self._hooks:
            raise ValueError(f"point must be one of {HOOK_POINTS}, got {point!r}")
        self._hooks[point].append(fn)

    def pause(self, point: str, when: Callable[[list[SeqRecord]], bool] | None = None, *,
              timeout_s: float = 30.0) -> Gate:
        """A gate that holds the worker the first time it reaches `point` with `when(seqs)`
        true (any sequences when `when` is None)."""
        gate = Gate(point, timeout_s)

        def hook(seqs: list[SeqRecord]) -> None:
            if not gate.reached and (when is None or when(seqs)):
                gate.hold(seqs)

        self.on(point, hook)
        return gate

    def _at(self, point: str, seqs: list[SeqRecord]) -> None:
        for fn in list(self._hooks[point]):
            fn(seqs)

    def materialize(self, plan: ResourcePlan, prompt_ids: Sequence[int],
                    sampling: SamplingParams = GREEDY,
                    stop_ids: Sequence[int] = ()) -> SequenceHandle:
        handle = super().materialize(plan, prompt_ids, sampling, stop_ids)
        self._at("after_materialize", [self._seq(handle)])
        return handle

    def prefill(self, handle: SequenceHandle, stop_at: int | None = None,
                mask: np.ndarray | None = None) -> PendingBatch | None:
        batch = super().prefill(handle, stop_at, mask)
        self._at("after_prefill", [self._seq(handle)])
        return batch

    def decode(self, handles: Sequence[SequenceHandle],
               caps: Sequence[int | None] | None = None,
               masks: Sequence[np.ndarray | None] | None = None,
               drafts: int | None = None, bare: bool = False) -> PendingBatch:
        batch = super().decode(handles, caps, masks, drafts, bare)
        self._at("after_decode", [self._seq(h) for h in handles])
        return batch

    def control(self, handle: SequenceHandle, forced: Sequence[int],
                mask: np.ndarray | None = None) -> PendingBatch:
        batch = super().control(handle, forced, mask)
        self._at("after_control", [self._seq(handle)])
        return batch

    def commit(self, batch: PendingBatch, accepted: Sequence[int]) -> None:
        if batch is not self.pending:  # the base class refuses it; no hook sees a stray batch
            super().commit(batch, accepted)
            return
        seqs = [self._seq(h) for h in batch.handles]
        self._at("before_commit", seqs)
        super().commit(batch, accepted)
        self._at("after_commit", seqs)

    # Model -------------------------------------------------------------------------------------
    def _touch(self) -> None:
        """Asserts the Engine's rule that only its worker thread drives the Program."""
        me = threading.current_thread()
        if self._worker is None:
            self._worker = me
        elif self._worker is not me:
            raise AssertionError(f"Program driven from {me.name} and {self._worker.name}")

    def _step(self) -> None:
        self._touch()
        self.num_steps += 1
        time.sleep(self.step_seconds)

    def _token(self, seq: SeqRecord, state: int, position: int) -> int:
        """The fake model's token; one of the sequence's stop ids drawn before its min_tokens
        becomes a space instead (the real sampler never draws them then)."""
        token = next_token(state, position, seq.sampling.seed or 0, self.limits.vocab_size,
                           self.eos_id)
        if token in seq.stop_ids and position - seq.prompt_len < seq.sampling.min_tokens:
            return min(32, self.limits.vocab_size - 1)
        return token

    def _allowed(self, seq: SeqRecord, state: int, position: int) -> int:
        """The fake model's token under the sequence's token mask (the one a round's first
        position is sampled under): its own token when allowed, else the allowed id at index
        hash(state, position) mod the number allowed."""
        token = self._token(seq, state, position)
        if seq.mask is None or (int(seq.mask[token // 32]) >> token % 32) & 1:
            return token
        bits = np.unpackbits(seq.mask.view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.limits.vocab_size])
        return int(allowed[mix(state, position) % len(allowed)])

    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> tuple:
        self._step()
        self.prefilled_tokens += len(chunk)
        state = self._committed.get(seq.slot, 0) if start else 0
        for t in chunk:
            state = mix(state, t)
        self._provisional = [[state]]
        token = self._allowed(seq, state, start + len(chunk))
        wanted = seq.sampling.logprobs is not None
        return token, _logprob_arrays(np.array([[token]]), self.limits.vocab_size) if wanted \
            else None

    def _run_decode(self, seqs: list[SeqRecord], limits: np.ndarray, last=None,
                    drafts: int | None = None, bare: bool = False) -> tuple:
        self._step()
        width = self.limits.verify_width
        drafts = width - 1 if drafts is None else drafts
        tokens = np.zeros((len(seqs), width), np.int32)
        produced = np.zeros(len(seqs), np.int32)
        self._provisional = []
        for row, (s, limit) in enumerate(zip(seqs, limits)):
            state, token, states = self._committed[s.slot], s.tokens[-1], []
            n = 1 + mix(state, 0xC0FFEE) % int(limit) if drafts else 1
            for i in range(n):
                state = mix(state, token)
                states.append(state)
                pick = self._allowed if i == 0 else self._token
                token = tokens[row, i] = pick(s, state, s.frontier + 1 + i)
            produced[row] = n
            self._provisional.append(states)
        wanted = any(s.sampling.logprobs is not None for s in seqs)
        return tokens, produced, _logprob_arrays(tokens, self.limits.vocab_size) if wanted \
            else None

    def _run_commit(self, seqs, accepted, tokens, count) -> None:
        self._touch()
        if self.fail_commit_at is not None and self.num_commits == self.fail_commit_at:
            self.num_commits += 1
            raise InjectedFailure(f"injected failure at commit {self.fail_commit_at}")
        self.num_commits += 1
        for seq, n, states in zip(seqs, accepted, self._provisional):
            if n > 0:
                self._committed[seq.slot] = states[n - 1]

    def _run_capture(self, seq: SeqRecord, ckpt_slot: int) -> None:
        self._touch()
        self._ckpt_states[ckpt_slot] = self._committed[seq.slot]

    def _run_restore(self, ckpt: CheckpointRecord, seq: SeqRecord, copy_page) -> None:
        self._touch()
        self._committed[seq.slot] = self._ckpt_states[ckpt.slot]

    def _run_export(self, ckpt: CheckpointRecord, pages) -> CheckpointImage:
        self._touch()
        ps, f = self.limits.page_size, ckpt.frontier
        out = [[page_content(ckpt.tokens[: min((i + 1) * ps, f)], self.limits.page_bytes)]
               if i in pages else [] for i in range(len(ckpt.pages))]
        state = np.zeros(self.limits.checkpoint_state_bytes, np.uint8)
        state[:4] = np.frombuffer(self._ckpt_states[ckpt.slot].to_bytes(4, "little"), np.uint8)
        return CheckpointImage(ckpt.tokens, out, state)

    def _run_import(self, ckpt: CheckpointRecord, image: CheckpointImage) -> None:
        """Adopts the image's state; a page whose bytes are not what its tokens determine is a
        store that served wrong data, which no test may see."""
        self._touch()
        ps, f = self.limits.page_size, ckpt.frontier
        for i, buffers in enumerate(image.pages):
            got = np.concatenate([np.asarray(b).reshape(-1).view(np.uint8) for b in buffers])
            want = page_content(ckpt.tokens[: min((i + 1) * ps, f)], self.limits.page_bytes)
            if not np.array_equal(got, want):
                raise AssertionError(f"imported page {i} of frontier {f} holds wrong K/V")
        state = np.asarray(image.state).reshape(-1).view(np.uint8)
        self._ckpt_states[ckpt.slot] = int.from_bytes(state[:4].tobytes(), "little")
