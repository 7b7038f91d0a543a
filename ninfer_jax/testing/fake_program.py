"""FakeProgram: the Program's host bookkeeping with a hand-computable "model" (no jax).

The fake model's state is a 32-bit rolling hash of every token it has consumed, and the next
token is a function of (state, position, seed): `expected_tokens` predicts any output without
running a network. The state lives where the real one does (committed per slot, provisional per
batch row until commit, checkpoint slots), so a wrong reuse, a lost commit or a leaked
provisional state changes the tokens. Admission, reservations, pages, slots, checkpoints,
revisions and PendingBatch rules are the real ones (`HostProgram`). Failures can be injected.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ninfer_jax.program.host import CheckpointRecord, HostProgram, ProgramLimits, SeqRecord


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


class FakeProgram(HostProgram):
    """A Program double. `fail_commit_at`: the n-th commit (0-based) raises InjectedFailure;
    `step_seconds`: each prefill/decode sleeps this long (to let cancels land mid-step)."""

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
        self._provisional: list[int] = []  # batch row -> state
        self._ckpt_states: dict[int, int] = {}  # checkpoint slot -> state
        self._worker: threading.Thread | None = None

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
        return next_token(state, position, seq.sampling.seed or 0, self.limits.vocab_size,
                          self.eos_id)

    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> int:
        self._step()
        self.prefilled_tokens += len(chunk)
        state = self._committed.get(seq.slot, 0) if start else 0
        for t in chunk:
            state = mix(state, t)
        self._provisional = [state]
        return self._token(seq, state, start + len(chunk))

    def _run_decode(self, seqs: list[SeqRecord]) -> np.ndarray:
        self._step()
        self._provisional = [mix(self._committed[s.slot], s.tokens[-1]) for s in seqs]
        return np.array([self._token(s, st, s.frontier + 1)
                         for s, st in zip(seqs, self._provisional)], np.int32)

    def _run_commit(self, seqs, accept, tokens, count) -> None:
        self._touch()
        if self.fail_commit_at is not None and self.num_commits == self.fail_commit_at:
            self.num_commits += 1
            raise InjectedFailure(f"injected failure at commit {self.fail_commit_at}")
        self.num_commits += 1
        for seq, ok, state in zip(seqs, accept, self._provisional):
            if ok:
                self._committed[seq.slot] = state

    def _run_capture(self, seq: SeqRecord, ckpt_slot: int) -> None:
        self._touch()
        self._ckpt_states[ckpt_slot] = self._committed[seq.slot]

    def _run_restore(self, ckpt: CheckpointRecord, seq: SeqRecord, copy_page) -> None:
        self._touch()
        self._committed[seq.slot] = self._ckpt_states[ckpt.slot]
