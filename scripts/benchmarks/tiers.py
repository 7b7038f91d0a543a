"""Time to first token of a follow-up request by where its history's checkpoint comes from.

    python scripts/bench.py --suite=tiers --out=DIR

A conversation's history (BENCH_TIERS_HISTORY random tokens, default 2,048) was prefilled and
checkpointed; the follow-up request is the history plus BENCH_TIERS_FOLLOW_UP new tokens
(default 32), greedy, BENCH_TIERS_NEW_TOKENS answer tokens (default 4). TTFT runs from submit to
the first Delta. Sources of the history's checkpoint, all measured in one run and in turn
within each repetition (device, host, disk, redis, recompute, then the next repetition):

- device: still in the device catalog (the host Engine, right after the history);
- host: reloaded from the host-memory `cache` tier (the same Engine, device catalog cleared
  with `clear_prefix_cache()` once the history's writes completed);
- disk: reloaded from a `posix` tier in a temp dir (an Engine whose topology is only that);
- redis: reloaded from a real Redis server (`ninfer_jax.testing.redis_server`; an Engine whose
  topology is only that);
- recompute: no reuse (a fresh cache scope, so neither device nor store can serve it).

Each topology is its own Program + EngineCore over the same random weights (MEDIUM, ~470M
parameters fp32, or the tiny test config) and a byte-level tokenizer. Every repetition draws a
fresh history (no repetition reuses another's blocks) and prepares it on the three Engines
untimed before its turns. Every source's answer must equal the recompute answer of its
repetition; a mismatch, or cached tokens or a reload count other than the source implies, is
reported in `errors`; a failed request stops the run, naming the Engine and its error. The
disk tier is read right after it was written, so from the OS page cache.
The weights are N(0, 0.2) so that the answer depends on the history (see WEIGHT_STD). Even so,
random GDN layers forget fast (A_log as transformers initialises it decays the recurrent state
by exp(g) <= 0.27 a token), so after a 32-token follow-up the check guards the K/V pages more
than the state image; a follow-up of 1 token checks both (the harness test uses 1).

Settings: BENCH_TIERS_MODEL=medium|tiny (default medium), BENCH_TIERS_HISTORY (2048),
BENCH_TIERS_FOLLOW_UP (32), BENCH_TIERS_NEW_TOKENS (4), BENCH_TIERS_REPS (5),
BENCH_TIERS_WARMUP (1), BENCH_TIERS_PREFILL_CHUNK (256, as the engine suite's multi_turn),
BENCH_TIERS_KV_DTYPE=auto|int8 (the Programs' K/V pages, `ProgramConfig.kv_dtype`; auto).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
import time

import numpy as np

from scripts.benchmarks._env import SettingError, env_choice, env_int

SOURCES = ("device", "host", "disk", "redis", "recompute")
STORES = ("host", "disk", "redis")  # the Engines, one per topology; device and recompute: host
TARGETS = {"host": 0.2, "disk": 0.3}  # max TTFT ratio to recompute (reported, never asserted)
MODELS = ("medium", "tiny")
# Random weights ~ N(0, WEIGHT_STD). init_params' default 0.02 leaves the tied embedding of the
# last prompt token dominant: greedy repeats that token whatever the history's state, so a wrong
# reload would go unnoticed. The cost of a step does not depend on the values.
WEIGHT_STD = 0.2
FIRST_ID = 300  # random prompt ids start past the byte tokenizer's bytes and control tokens
PAGE_CACHE_NOTE = ("the disk tier is read right after the history's blocks were written (the "
                   "same repetition, seconds to minutes earlier), so its reads come from the OS "
                   "page cache, not the device; a cold read would be slower")


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "medium"
    history: int = 2048
    follow_up: int = 32
    new_tokens: int = 4
    reps: int = 5
    warmup: int = 1
    prefill_chunk: int = 256
    kv_dtype: str = "auto"

    @classmethod
    def from_env(cls) -> Settings:
        s = cls(model=env_choice("BENCH_TIERS_MODEL", "medium", MODELS),
                history=env_int("BENCH_TIERS_HISTORY", 2048, maximum=1 << 16),
                follow_up=env_int("BENCH_TIERS_FOLLOW_UP", 32, maximum=1 << 12),
                new_tokens=env_int("BENCH_TIERS_NEW_TOKENS", 4, maximum=256),
                reps=env_int("BENCH_TIERS_REPS", 5, maximum=100),
                warmup=env_int("BENCH_TIERS_WARMUP", 1, minimum=0, maximum=10),
                prefill_chunk=env_int("BENCH_TIERS_PREFILL_CHUNK", 256, maximum=4096),
                kv_dtype=env_choice("BENCH_TIERS_KV_DTYPE", "auto", ("auto", "int8")))
        positions = _model_config(s.model).max_position_embeddings
        if s.max_seq_len > positions:
            raise SettingError(
                f"BENCH_TIERS_HISTORY + BENCH_TIERS_FOLLOW_UP + BENCH_TIERS_NEW_TOKENS must be "
                f"<= {positions} (the {s.model} model's positions), got {s.max_seq_len}")
        if s.prefill_chunk > s.max_seq_len:
            raise SettingError(f"BENCH_TIERS_PREFILL_CHUNK must be <= {s.max_seq_len} (history "
                               f"+ follow-up + new tokens), got {s.prefill_chunk}")
        return s

    @property
    def max_seq_len(self) -> int:
        return self.history + self.follow_up + self.new_tokens


def _model_config(name: str):
    from scripts.benchmarks._checkpoint import model_config

    return model_config(name)


class _Side:
    """One Program + EngineCore over one context-store topology."""

    def __init__(self, name: str, cfg, params, pcfg, store: dict, frontend) -> None:
        from ninfer_jax import context_store
        from ninfer_jax.engine import EngineCore, EngineCoreConfig
        from ninfer_jax.program.program import Program

        start = time.perf_counter()
        program = Program(cfg, params, pcfg)
        program.wait_compiled()
        identity = context_store.model_identity(params, cfg, program.limits, pcfg.dtype)
        tiers = context_store.open_tiers(store, program, identity)
        self.name, self.frontend, self.layout = name, frontend, tiers.layout
        self.core = EngineCore(program, frontend, EngineCoreConfig(max_queue=8), tiers)
        self.setup_s = time.perf_counter() - start

    def request(self, ids: list[int], new_tokens: int, scope: str | None = None) -> dict:
        """One greedy request: TTFT (submit to first Delta), answer tokens, cached tokens."""
        from ninfer_jax.engine import Delta
        from ninfer_jax.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
        prompt = self.frontend.prepare(prompt_token_ids=ids)
        start = time.perf_counter()
        handle = self.core.submit(prompt, sp, cache_scope=scope)
        first = None
        for event in handle:
            if isinstance(event, Delta) and first is None:
                first = time.perf_counter()
        r = handle.result()
        if r.error is not None or first is None:
            raise RuntimeError(f"{self.name}: request failed ({r.finish_reason}): {r.error}")
        return {"ttft_s": first - start, "tokens": list(r.token_ids),
                "cached_tokens": r.usage.cached_tokens}

    def quiesce(self, timeout_s: float = 600.0):
        """Stats once the worker is idle and every write the store accepted has completed.

        Two publications after the call began cover everything finished before it: a retained
        checkpoint's write starts on the worker's next iteration."""
        deadline = time.monotonic() + timeout_s
        s = self.core.stats()
        while True:
            s = self._next_stats(self._next_stats(s, deadline), deadline)
            if s.waiting == 0 and s.active == 0 and s.tiers.pending_writes == 0:
                return s
            if not s.available:
                raise RuntimeError(f"{self.name}: the Engine failed")

    def _next_stats(self, s, deadline: float):
        while self.core.stats() is s:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the worker published nothing in time")
            time.sleep(0.002)
        return self.core.stats()

    def write_history(self, history: list[int], clear: bool) -> int:
        """Prefills and checkpoints the history (untimed); waits for its writes. Returns the
        bytes the store wrote for it. With `clear`, the device catalog is emptied after."""
        before = self.quiesce().tiers.bytes_written
        self.request(history, 1)  # one new token: the prompt's checkpoint is the turn's
        written = self.quiesce().tiers.bytes_written - before
        if clear:
            self.clear()
        return written

    def clear(self) -> None:
        self.quiesce()
        self.core.clear_prefix_cache()
        self.quiesce()

    def close(self) -> None:
        self.core.close()


def _turn(side: _Side, source: str, prompt: list[int], s: Settings, scope: str | None) -> dict:
    before = side.quiesce().tiers
    load_before = os.getloadavg()[0]
    r = side.request(prompt, s.new_tokens, scope)
    load_after = os.getloadavg()[0]
    after = side.quiesce().tiers
    r.update(source=source, engine=side.name, load_before=load_before, load_after=load_after,
             reloads=after.reloads - before.reloads,
             reload_s=after.reload_seconds - before.reload_seconds,
             served_by=sorted(name for name, n in dict(after.hits_by_tier).items()
                              if n > dict(before.hits_by_tier).get(name, 0)))
    return r


def _check(turn: dict, s: Settings, reference: list[int] | None) -> list[str]:
    """What is wrong with a turn: its answer, its cached tokens, its reloads."""
    src, problems = turn["source"], []
    if reference is not None and turn["tokens"] != reference:
        problems.append(f"answer {turn['tokens']} differs from recompute's {reference}")
    want_cached = 0 if src == "recompute" else s.history
    if turn["cached_tokens"] != want_cached:
        problems.append(f"cached_tokens {turn['cached_tokens']}, expected {want_cached}")
    want_reloads = 0 if src in ("device", "recompute") else 1
    if turn["reloads"] != want_reloads:
        problems.append(f"{turn['reloads']} reloads from the store, expected {want_reloads}")
    return problems


def _repetition(rep: int, sides: dict[str, _Side], s: Settings, vocab: int) -> dict:
    rng = np.random.default_rng(rep)
    history = rng.integers(FIRST_ID, vocab, s.history).tolist()
    prompt = history + rng.integers(FIRST_ID, vocab, s.follow_up).tolist()
    written = {name: side.write_history(history, clear=name != "host")
               for name, side in sides.items()}
    host = sides["host"]
    turns = {"device": _turn(host, "device", prompt, s, None)}
    host.clear()
    for source in STORES:
        turns[source] = _turn(sides[source], source, prompt, s, None)
    turns["recompute"] = _turn(host, "recompute", prompt, s, f"recompute-{rep}")
    reference = turns["recompute"]["tokens"]
    errors = [f"rep {rep} {src}: {p}" for src in SOURCES
              for p in _check(turns[src], s, None if src == "recompute" else reference)]
    return {"rep": rep, "bytes_written": written, "turns": [turns[x] for x in SOURCES],
            "errors": errors}


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _summary(reps: list[dict], s: Settings) -> dict:
    out = {}
    for src in SOURCES:
        turns = [next(t for t in r["turns"] if t["source"] == src) for r in reps]
        recompute = [next(t for t in r["turns"] if t["source"] == "recompute") for r in reps]
        reload = [t["reload_s"] for t in turns if t["reloads"]]
        out[src] = {
            "engine": turns[0]["engine"],
            "ttft_s": _spread([t["ttft_s"] for t in turns]),
            "ratio_to_recompute": _spread([t["ttft_s"] / c["ttft_s"]
                                           for t, c in zip(turns, recompute)]),
            "cached_tokens": sorted({t["cached_tokens"] for t in turns}),
            "reload_s": _spread(reload) if reload else None,
            "served_by": sorted({n for t in turns for n in t["served_by"]}),
            "load": [min(t["load_before"] for t in turns), max(t["load_after"] for t in turns)],
        }
    return out


def _bytes_per_checkpoint(layout, s: Settings, reps: list[dict]) -> dict:
    kv_blocks = -(-s.history // layout.page_size)
    return {
        "tokens": s.history, "block_bytes": layout.block_bytes, "kv_blocks": kv_blocks,
        "kv_bytes": kv_blocks * layout.block_bytes, "state_bytes": layout.state_bytes,
        "state_blocks": layout.state_blocks,
        "state_stored_bytes": layout.state_blocks * layout.block_bytes,
        "layout_total_bytes": (kv_blocks + layout.state_blocks) * layout.block_bytes,
        "bytes_written_per_history": {name: [r["bytes_written"][name] for r in reps]
                                      for name in reps[0]["bytes_written"]},
    }


def measure(s: Settings, workdir: str) -> dict:
    import jax

    from ninfer_jax import context_store
    from ninfer_jax.frontend import Frontend
    from ninfer_jax.models.qwen3_6.weights import init_params
    from ninfer_jax.program.config import ProgramConfig
    from ninfer_jax.testing.redis_server import RedisServer
    from ninfer_jax.testing.tokenizer import ByteTokenizer

    cfg = _model_config(s.model)
    params = init_params(cfg, jax.random.key(0), std=WEIGHT_STD)
    frontend = Frontend(ByteTokenizer(vocab_size=cfg.vocab_size))
    pcfg = ProgramConfig(max_concurrency=1, page_size=16, max_seq_len=s.max_seq_len,
                         num_pages=4 * -(-s.max_seq_len // 16), prefill_chunk=s.prefill_chunk,
                         num_checkpoint_slots=8, kv_dtype=s.kv_dtype)
    start_load = os.getloadavg()
    with contextlib.ExitStack() as stack:
        redis = stack.enter_context(RedisServer())
        topologies = {
            "host": context_store.topology(),  # the Engine's default: a 1 GiB host tier
            "disk": context_store.topology(host_cache_gb=0, disk_cache_dir=os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory(dir=workdir)), "blocks")),
            "redis": context_store.topology(host_cache_gb=0, redis_url=redis.url),
        }
        sides: dict[str, _Side] = {}
        for name, store in topologies.items():
            sides[name] = _Side(name, cfg, params, pcfg, store, frontend)
            stack.callback(sides[name].close)
            print(f"  {name} Engine ready in {sides[name].setup_s:.1f} s "
                  f"(topology {store})", flush=True)
        reps = []
        for rep in range(s.warmup + s.reps):
            r = _repetition(rep, sides, s, cfg.vocab_size)
            r["warmup"] = rep < s.warmup
            reps.append(r)
            print("  rep " + ("warm-up " if r["warmup"] else "") + f"{rep}: " + ", ".join(
                f"{t['source']} {t['ttft_s']:.2f}s" for t in r["turns"]), flush=True)
            for e in r["errors"]:
                print(f"  ERROR {e}", flush=True)
        layout = sides["host"].layout
        final = {name: side.core.stats().tiers for name, side in sides.items()}
    measured = [r for r in reps if not r["warmup"]]
    summary = _summary(measured, s)
    return {
        "model": s.model, "settings": dataclasses.asdict(s),
        "program_config": dataclasses.asdict(pcfg),
        "setup_s": {name: side.setup_s for name, side in sides.items()},
        "topologies": topologies,
        "sources": summary,
        "targets": [{"source": src, "max_ratio_to_recompute": limit,
                     "median_ratio": summary[src]["ratio_to_recompute"]["median"],
                     "met": summary[src]["ratio_to_recompute"]["median"] <= limit}
                    for src, limit in TARGETS.items()],
        "bytes_per_checkpoint": _bytes_per_checkpoint(layout, s, measured),
        "tier_stats": {name: dataclasses.asdict(t) for name, t in final.items()},
        "identical_tokens": not any("differs from recompute" in e
                                    for r in reps for e in r["errors"]),
        "errors": [e for r in reps for e in r["errors"]],
        "repetitions": reps,
        "load_average": {"start": start_load, "end": os.getloadavg()},
        "notes": [PAGE_CACHE_NOTE],
    }


def _table(r: dict) -> str:
    def spread(x: dict | None, fmt: str) -> str:
        return "-" if x is None else f"{x['median']:{fmt}} [{x['min']:{fmt}}-{x['max']:{fmt}}]"

    lines = [(f"{'source':<10} {'TTFT s':<22} {'/recompute':<22} {'cached':>7}  "
              f"{'reload s':<22} {'served by':<12} load")]
    for src, x in r["sources"].items():
        lines.append(f"{src:<10} {spread(x['ttft_s'], '.3f'):<22} "
                     f"{spread(x['ratio_to_recompute'], '.3f'):<22} "
                     f"{','.join(map(str, x['cached_tokens'])):>7}  "
                     f"{spread(x['reload_s'], '.3f'):<22} {','.join(x['served_by']) or '-':<12} "
                     f"{x['load'][0]:.1f}-{x['load'][1]:.1f}")
    b = r["bytes_per_checkpoint"]
    lines.append(f"checkpoint of {b['tokens']:,} tokens: K/V {b['kv_blocks']} blocks x "
                 f"{b['block_bytes']:,} B = {b['kv_bytes']:,} B; state {b['state_bytes']:,} B in "
                 f"{b['state_blocks']} blocks ({b['state_stored_bytes']:,} B); "
                 f"{b['layout_total_bytes']:,} B in all")
    for name, written in b["bytes_written_per_history"].items():
        lines.append(f"  stats().tiers.bytes_written per history, {name}: "
                     f"{sorted(set(written))}")
    for t in r["targets"]:
        lines.append(f"target {t['source']} reload <= {t['max_ratio_to_recompute']}x recompute: "
                     f"{t['median_ratio']:.3f}, {'met' if t['met'] else 'NOT met'}")
    lines.append(f"identical tokens: {'yes' if r['identical_tokens'] else 'NO'}; errors: "
                 f"{len(r['errors'])}")
    lines.append(f"note: {PAGE_CACHE_NOTE}")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    from ninfer_jax.compile_cache import enable_persistent_cache

    s = Settings.from_env()
    enable_persistent_cache()
    print(f"tiers benchmark on {s.model}: history {s.history}, follow-up {s.follow_up}, "
          f"{s.reps} reps + {s.warmup} warm-up (load average {os.getloadavg()})", flush=True)
    result = measure(s, out_dir)
    print(_table(result))
    for e in result["errors"]:
        print(f"ERROR {e}")
    return result
