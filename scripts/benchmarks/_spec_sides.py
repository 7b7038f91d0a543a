"""The `spec` suite's in-process sides: Programs with and without MTP speculation, driven through
the Program's public API (admit, prefill, decode + commit), and the acceptance tally.

- `GenerateSide`: a repetition admits and prefills its prompts (untimed), then times decode +
  commit rounds that commit every produced token, until each row has generated `new_tokens`
  (a row that is done leaves the batch, as it would leave an Engine's round); then releases.
  Its work is the tokens the timed rounds committed, B * (new_tokens - 1).
- `RoundSide`: sequences admitted and prefilled once (`prepare`); a repetition times `rounds`
  decode + commit rounds on all B rows, each row proposing a full verify width every round.

Both record each round's per-row limit (the most tokens a row may propose: verify width, or
less near its budget) and produced count, so `tally` can say how many drafts were accepted.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np


def program_config(k: int, max_concurrency: int, max_seq_len: int, prefill_chunk: int,
                   method: str = "mtp", draft_head: str = "full"):
    """The ProgramConfig of one side: speculation off for K = 0, `method` ("mtp" or "dflash",
    the latter with `draft_head`) with K drafts every round otherwise (draft_policy "fixed"); pools sized for max_concurrency
    sequences of max_seq_len, no checkpoints."""
    from ninfer_jax.program.config import ProgramConfig

    page_size = 16
    pages = max_concurrency * -(-max_seq_len // page_size)
    return ProgramConfig(max_concurrency=max_concurrency, page_size=page_size, num_pages=pages,
                         max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                         num_checkpoint_slots=0, speculative=method if k else "off",
                         num_speculative_tokens=k, draft_policy="fixed",
                         draft_head=draft_head if k and method == "dflash" else "full")


def build_program(cfg, params: dict, pcfg, drafter=None) -> tuple[object, dict]:
    """A Program with every executable compiled; returns it and its compile report (the wall
    time of construction + `wait_compiled`, and the table's per-executable seconds summed).
    `drafter`: a `LoadedDrafter` for speculative="dflash"."""
    from ninfer_jax.program.program import Program

    start = time.perf_counter()
    if drafter is not None:
        params = {**params, "dflash": drafter.params}
    program = Program(cfg, params, pcfg, drafter=None if drafter is None else drafter.config)
    program.wait_compiled()
    wall = time.perf_counter() - start
    return program, {"wall_s": wall,
                     "executables": len(program.executables.compile_seconds),
                     "compile_s": sum(program.executables.compile_seconds.values())}


def tally(k: int, limits: Sequence[np.ndarray], produced: Sequence[np.ndarray]) -> dict:
    """Acceptance over a run's rounds: limits[i] and produced[i] are round i's per-row limit and
    produced count. Row-rounds, committed tokens (all produced ones), and per draft position
    j = 1..k the row-rounds that could accept draft j (limit > j) and those that did
    (produced > j: the target's tokens run through draft j)."""
    lim = np.concatenate([np.asarray(x, np.int64) for x in limits]) if limits else np.zeros(0)
    got = np.concatenate([np.asarray(x, np.int64) for x in produced]) if produced \
        else np.zeros(0)
    return {"row_rounds": int(lim.size), "committed": int(got.sum()),
            "attempted": [int((lim > j).sum()) for j in range(1, k + 1)],
            "accepted": [int((got > j).sum()) for j in range(1, k + 1)]}


def merge_tallies(tallies: Sequence[dict]) -> dict:
    """The sum of several `tally` results (one k); adds the mean committed per row-round and
    the acceptance rate per draft position."""
    out = {key: sum(t[key] for t in tallies) for key in ("row_rounds", "committed")}
    for key in ("attempted", "accepted"):
        out[key] = [sum(col) for col in zip(*(t[key] for t in tallies))]
    out["mean_committed_per_row_round"] = out["committed"] / max(out["row_rounds"], 1)
    out["acceptance_by_position"] = [a / n if n else None
                                     for a, n in zip(out["accepted"], out["attempted"])]
    return out


def _prefill(program, handle) -> None:
    while (batch := program.prefill(handle)) is None:
        pass
    program.commit(batch, [1])


@dataclasses.dataclass
class _Rounds:
    """What a repetition's timed rounds recorded."""

    limits: list = dataclasses.field(default_factory=list)
    produced: list = dataclasses.field(default_factory=list)


class GenerateSide:
    """Prompts admitted and prefilled untimed, then timed rounds until each row has new_tokens."""

    def __init__(self, program, k: int, new_tokens: int):
        self.program, self.k, self.new_tokens = program, k, new_tokens

    def prepare(self, name: str, args: dict) -> None:
        self.prompts = args["prompts"]

    def rep(self, name: str) -> dict:
        prog, n, width = self.program, self.new_tokens, self.k + 1
        handles = [prog.materialize(prog.plan_admission(len(p), n), p) for p in self.prompts]
        for h in handles:
            _prefill(prog, h)
        rounds = _Rounds()
        start = time.perf_counter()
        active = handles
        while active:
            left = np.array([n - prog.num_generated(h) for h in active])
            batch = prog.decode(active)
            produced = batch.produced
            prog.commit(batch, produced.tolist())
            rounds.limits.append(np.minimum(left, width))
            rounds.produced.append(produced)
            active = [h for h in active if prog.num_generated(h) < n]
        seconds = time.perf_counter() - start
        tokens = [prog.tokens(h)[len(p):] for h, p in zip(handles, self.prompts)]
        for h in handles:
            prog.release(h)
        return {"seconds": seconds, "work": len(handles) * (n - 1),
                "outputs": {"tokens": tokens,
                            "tally": tally(self.k, rounds.limits, rounds.produced)}}

    def finish(self, name: str) -> None:
        pass


class RoundSide:
    """B sequences prefilled once; a repetition is `rounds` decode + commit rounds on all rows
    (work: rounds, so the rate is rounds per second); its outputs hold every row's tokens
generated so far (the sequences continue across repetitions). Each sequence's budget keeps every round
    at the full verify width: 1 + total_rounds * (k + 1) new tokens."""

    def __init__(self, program, k: int, rounds: int, total_rounds: int):
        self.program, self.k, self.rounds = program, k, rounds
        self.max_new = 1 + total_rounds * (k + 1)

    def prepare(self, name: str, args: dict) -> list[int]:
        prog = self.program
        self.prompts = args["prompts"]
        self.handles = [prog.materialize(prog.plan_admission(len(p), self.max_new), p)
                        for p in self.prompts]
        for h in self.handles:
            _prefill(prog, h)
        return [prog.tokens(h)[-1] for h in self.handles]

    def rep(self, name: str) -> dict:
        prog, rounds = self.program, _Rounds()
        start = time.perf_counter()
        for _ in range(self.rounds):
            batch = prog.decode(self.handles)
            produced = batch.produced
            prog.commit(batch, produced.tolist())
            rounds.produced.append(produced)
        seconds = time.perf_counter() - start
        rounds.limits = [np.full(len(self.handles), self.k + 1)] * self.rounds
        tokens = [prog.tokens(h)[len(p):] for h, p in zip(self.handles, self.prompts)]
        return {"seconds": seconds, "work": self.rounds,
                "outputs": {"tokens": tokens,
                            "tally": tally(self.k, rounds.limits, rounds.produced)}}

    def finish(self, name: str) -> None:
        for h in self.handles:
            self.program.release(h)
