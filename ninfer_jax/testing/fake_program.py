"""FakeProgram: the Program's host bookkeeping with a hand-computable "model" (no jax).

Every sequence's next token is `next_token(last_token, position, seed)`, so a test can predict
any output without running a network, while admission, reservations, pages, slots, revisions
and PendingBatch rules are the real ones (`HostProgram`). Failures can be injected.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ninfer_jax.program.host import HostProgram, ProgramLimits, SeqRecord


def next_token(last: int, position: int, seed: int, vocab_size: int, eos_id: int | None) -> int:
    """The fake model: a lowercase letter, a space, or (rarely) EOS, from (last, position, seed).

    position is the absolute position of the token being produced.
    """
    x = (last * 1_000_003 + position * 7_919 + seed * 104_729 + 12_345) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0x5BD1E995) & 0xFFFFFFFF
    h = (x ^ (x >> 15)) % 997
    if eos_id is not None and h < 4:
        return eos_id
    if h % 6 == 0:
        return min(32, vocab_size - 1)
    return 97 + h % 26 if vocab_size > 122 else h % vocab_size


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
        self._worker: threading.Thread | None = None

    def _touch(self) -> None:
        """Asserts the Engine's rule that only its worker thread drives the Program."""
        me = threading.current_thread()
        if self._worker is None:
            self._worker = me
        elif self._worker is not me:
            raise AssertionError(f"Program driven from {me.name} and {self._worker.name}")

    def _token(self, seq: SeqRecord, last: int, position: int) -> int:
        return next_token(last, position, seq.sampling.seed or 0, self.limits.vocab_size,
                          self.eos_id)

    def _run_prefill(self, seq: SeqRecord, start: int, chunk: list[int]) -> int:
        self._touch()
        self.num_steps += 1
        time.sleep(self.step_seconds)
        return self._token(seq, chunk[-1], start + len(chunk))

    def _run_decode(self, seqs: list[SeqRecord]) -> np.ndarray:
        self._touch()
        self.num_steps += 1
        time.sleep(self.step_seconds)
        return np.array([self._token(s, s.tokens[-1], s.frontier + 1) for s in seqs], np.int32)

    def _run_commit(self, seqs, accept, tokens, count) -> None:
        self._touch()
        if self.fail_commit_at is not None and self.num_commits == self.fail_commit_at:
            self.num_commits += 1
            raise InjectedFailure(f"injected failure at commit {self.fail_commit_at}")
        self.num_commits += 1


def expected_tokens(prompt: list[int], max_new: int, *, seed: int = 0, vocab_size: int,
                    eos_id: int | None) -> list[int]:
    """What FakeProgram generates for a prompt (up to and including EOS)."""
    out, last, pos = [], prompt[-1], len(prompt)
    for _ in range(max_new):
        tok = next_token(last, pos, seed, vocab_size, eos_id)
        out.append(tok)
        if tok == eos_id:
            break
        last, pos = tok, pos + 1
    return out
