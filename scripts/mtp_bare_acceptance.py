"""What MTP bare rounds cost the drafts after them: an adaptive MTP Program on the embedded model.

    python scripts/mtp_bare_acceptance.py [--zeros=100,400] [--drafting=60] [--prompts=4]
        [--num_speculative_tokens=3] [--upkeep=W]

Per prompt (the `spec_policy` bench's stories) and per count Z of rounds of 0: a sequence runs
Z rounds of 0 after its prefill, then `drafting` rounds of the largest K, committing every
token a round proposes; once with the upkeep in every round of 0, once with all but the last W
bare (the head's entries of those positions left empty, `HostProgram.decode(bare=True)`;
W = `--upkeep`, default the Program's `limits.context_window`: what the draft policy waits
before drafting again). Prints the mean tokens a drafting round committed each way (the greedy
tokens are the same; checked on their common prefix).
"""

import os
import statistics
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ZEROS = flags.DEFINE_list("zeros", ["100", "400"], "rounds of 0 before the drafting rounds")
DRAFTING = flags.DEFINE_integer("drafting", 60, "rounds of the largest K measured")
PROMPTS_N = flags.DEFINE_integer("prompts", 4, "stories of the bench's prompts")
K = flags.DEFINE_integer("num_speculative_tokens", 3, "the largest K")
UPKEEP = flags.DEFINE_integer("upkeep", None, "rounds of 0 with the upkeep before drafting "
                              "(default: the Program's context_window)")


def main(argv) -> None:
    del argv
    from ninfer_jax.api import Engine
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.sampling_params import SamplingParams
    from scripts.benchmarks._engine_vs_program import PROMPTS

    enable_persistent_cache()
    engine = Engine.open(max_concurrency=1, prefix_reuse=False, speculative="mtp",
                         num_speculative_tokens=K.value, draft_policy="adaptive")
    engine.wait_compiled()
    prog = engine.core.program
    engine.close()  # stops its worker: the Program is driven from here on
    upkeep = prog.limits.context_window if UPKEEP.value is None else UPKEEP.value
    zeros = [int(z) for z in ZEROS.value]
    budget = max(zeros) + (K.value + 1) * DRAFTING.value + 1
    greedy = SamplingParams(temperature=0.0, max_new_tokens=budget, ignore_eos=True)

    def run(ids: list[int], z: int, bare: bool) -> tuple[float, list[int]]:
        h = prog.materialize(prog.plan_admission(len(ids), budget), ids, greedy)
        while (batch := prog.prefill(h)) is None:
            pass
        prog.commit(batch, [1])
        for i in range(z):
            batch = prog.decode([h], drafts=0, bare=bare and i < z - upkeep)
            prog.commit(batch, [1])
        produced = []
        for _ in range(DRAFTING.value):
            batch = prog.decode([h], drafts=K.value)
            n = batch.produced.tolist()
            produced += n
            prog.commit(batch, n)
        tokens = prog.tokens(h)
        prog.release(h)
        return statistics.mean(produced), tokens

    print(f"MTP K={K.value}, {DRAFTING.value} drafting rounds after Z rounds of 0 (the last "
          f"{upkeep} with the upkeep); tokens a drafting round committed")
    for z in zeros:
        means = {"upkeep": [], "bare": []}
        for text in PROMPTS[:PROMPTS_N.value]:
            ids = list(engine.frontend.prepare(prompt=text).token_ids)
            whole, want = run(ids, z, False)
            holes, got = run(ids, z, True)
            n = min(len(want), len(got))
            if want[:n] != got[:n]:
                raise SystemExit(f"greedy tokens differ on {text[:30]!r}: a bug")
            means["upkeep"].append(whole)
            means["bare"].append(holes)
            print(f"  Z={z:4d} {text[:28]!r:32} upkeep {whole:5.2f}  bare {holes:5.2f}")
        print(f"Z={z}: mean over prompts upkeep {statistics.mean(means['upkeep']):.3f}, "
              f"bare {statistics.mean(means['bare']):.3f}")


if __name__ == "__main__":
    app.run(main)
