"""Where one scoring call's time goes on XLA:CPU, by compiled operation.

    python -m scripts.profile_scoring_call [medium|tiny|demo] [--rows=16] [--length=256] [--top=30]

Builds a CausalScoreCore with the scoring suite's rolling call (random fp32 weights for
`medium`/`tiny`, the embedded model for `demo`), scores `rows` random windows of `length`
tokens once to warm it, then once under jax's profiler with XLA:CPU's per-operation trace
(`--xla_cpu_enable_xprof_traceme`, set before jax starts). Each compiled operation (a thunk:
a YNNPACK library fusion, an XLA loop fusion, a while loop...) is named with its output
shape and op from the executable's optimized HLO. Wall time is shared among the operations
running at each instant (XLA:CPU runs independent thunks concurrently), so the shares add up to
the call's time. Prints the share in the weight matmuls (a [rows * length, hidden] operand
against a weight matrix or the head) and the `--top` costliest (shape, op, kind) groups.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

from absl import app, flags


def _define_flags() -> None:
    """Defined when run as a script only: the tests import the helpers beside the CLI's flags."""
    flags.DEFINE_integer("rows", 16, "windows per call", lower_bound=1)
    flags.DEFINE_integer("length", 256, "tokens per window", lower_bound=2)
    flags.DEFINE_integer("top", 30, "groups to list", lower_bound=0)


def _hlo_names(hlo_text: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (output shape, the jax op it came from) in an optimized HLO text."""
    from ninfer_jax.program import hlo

    return {i.name: (i.shape, i.op_name.split("/")[-1] or i.opcode)
            for instrs in hlo.parse(hlo_text).computations.values() for i in instrs}


def _wall_shares(events: list[dict], key) -> collections.Counter:
    """Each instant's wall time split evenly among the events running then, summed by key."""
    points = sorted([(e["ts"], 1, key(e)) for e in events]
                    + [(e["ts"] + e["dur"], -1, key(e)) for e in events],
                    key=lambda p: (p[0], p[1]))
    running, shares, last = collections.Counter(), collections.Counter(), None
    for t, delta, k in points:
        total = sum(running.values())
        if last is not None and total:
            for name, n in running.items():
                if n:
                    shares[name] += (t - last) * n / total
        running[k] += delta
        last = t
    return shares


def main(argv: list[str]) -> None:
    name = argv[1] if len(argv) > 1 else "medium"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_cpu_enable_xprof_traceme=true").strip()
    import jax
    import numpy as np

    from ninfer_jax.program.scoring import WindowKey
    from ninfer_jax.scoring import CausalScoreCore, ScoreRequest, ScoringConfig

    if name == "demo":
        from ninfer_jax.loader import load_model

        model = load_model(None, dtype="float32")
        cfg, params = model.config, model.params
    else:
        from ninfer_jax.models.qwen3_6.weights import init_params
        from scripts.benchmarks._checkpoint import model_config

        cfg = model_config(name)
        params = init_params(cfg, jax.random.key(0))
    rows, length = flags.FLAGS.rows, flags.FLAGS.length
    core = CausalScoreCore(cfg, params, ScoringConfig(  # the call's shape and shorter ones only
        max_len=length, min_len=min(64, length), max_batch_tokens=rows * length, pack=False,
        share_contexts=False))
    del params
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, length + 1))
    requests = [ScoreRequest(row, 1) for row in ids]
    key, keys = WindowKey(rows, length), core.keys()
    if key not in keys:
        raise app.UsageError(f"--length must be one of the core's window lengths: {keys}")
    core.score(requests, roll=True)
    hlo = _hlo_names(core.program.executables.hlo_text(key.step_key()))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        start = time.perf_counter()
        core.score(requests, roll=True)
        seconds = time.perf_counter() - start
        jax.profiler.stop_trace()
        path = max(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
        with gzip.open(path) as f:
            trace = json.load(f)
    events = [e for e in (trace["traceEvents"] if isinstance(trace, dict) else trace)
              if e.get("ph") == "X" and e["name"] in hlo]

    def weight_matmul(e: dict) -> bool:  # every token's row against a weight, or the head
        shape, op = hlo[e["name"]]
        dims = [int(d) for d in re.findall(r"\d+", shape.split("[")[1].split("]")[0])]
        return op.endswith("dot_general") and (
            dims[:1] == [rows * length] or dims[:2] == [rows, length]
            or (len(dims) == 2 and dims[1] == cfg.vocab_size))

    by_kind = _wall_shares(events, lambda e: "weight matmuls" if weight_matmul(e) else "rest")
    total = sum(by_kind.values()) / 1e3
    print(f"{name}: one call of {rows} x {length} tokens in {seconds * 1e3:.0f} ms "
          f"({rows * length / seconds:.0f} tok/s); traced operations cover {total:.0f} ms")
    for kind, us in by_kind.most_common():
        print(f"  {kind:<16}{us / 1e3:9.1f} ms  {us / 1e3 / total:6.1%}")
    groups = _wall_shares(events, lambda e: (*hlo[e["name"]], e["name"].split(".")[0]))
    counts = collections.Counter((*hlo[e["name"]], e["name"].split(".")[0]) for e in events)
    print(f"\n{'ms':>9}  {'calls':>5}  shape, op, kind")
    for (shape, op, kind), us in groups.most_common(flags.FLAGS.top):
        print(f"{us / 1e3:9.1f}  {counts[(shape, op, kind)]:5d}  {shape.split('{')[0]}, {op}, "
              f"{kind}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
