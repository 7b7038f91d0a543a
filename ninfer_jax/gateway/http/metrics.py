"""`GET /metrics`: the server's Prometheus metrics, one registry per app.

Owns what the gateway observes itself (time to first token, inter-token latency, request
outcomes, rejections by reason, prompt tokens, client disconnects, recent tokens/s) and a
collector that reads the Engine's published `EngineStats` at scrape time (queue depth, active
requests, pages, slots, generated tokens, prefix hits and cached tokens, speculative
acceptance). It keeps no copy of Engine state.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ninfer_jax.api import Engine

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0)


class TokenRate:
    """Generated tokens per second over the last `window_s` seconds (event-loop thread only)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, num_tokens: int, now: float) -> None:
        self._events.append((now, num_tokens))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def rate(self, now: float) -> float:
        self._trim(now)
        return sum(n for _, n in self._events) / self.window_s


class _EngineCollector:
    """Reads `engine.stats()` at each scrape."""

    def __init__(self, engine: Engine, rate: TokenRate):
        self._engine, self._rate = engine, rate

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        gauges = {
            "available": ("1 while the Engine accepts requests", int(s.available)),
            "queue_depth": ("requests waiting for admission", s.waiting),
            "active_requests": ("requests admitted and not yet finished", s.active),
            "outstanding_requests": (
                "requests holding capacity (waiting, running or unconsumed)",
                self._engine.outstanding),
            "max_outstanding_requests": ("outstanding requests before overload (429)",
                                         s.capacity),
            "free_lanes": ("free request lanes", s.free_lanes),
            "free_pages": ("free KV pages", s.free_pages),
            "total_pages": ("KV pages in the pool", s.total_pages),
            "reserved_pages": ("KV pages reserved for admitted requests' growth",
                               s.reserved_pages),
            "free_slots": ("free GDN state slots", s.free_slots),
            "prefix_checkpoints": ("checkpoints held for prefix reuse", s.prefix.checkpoints),
            "total_slots": ("GDN state slots in the pool", s.total_slots),
            "generation_tokens_per_second": (
                f"tokens streamed per second over the last {self._rate.window_s:g} s",
                self._rate.rate(time.monotonic())),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"ninfer_{name}", doc, value=value)
        yield CounterMetricFamily("ninfer_generated_tokens", "tokens committed by the Engine",
                                  value=s.generated_tokens)
        yield CounterMetricFamily("ninfer_engine_finished_requests",
                                  "requests the Engine finished", value=s.finished_requests)
        yield CounterMetricFamily("ninfer_prefix_hits", "admissions that reused a checkpoint",
                                  value=s.prefix.hits)
        yield CounterMetricFamily("ninfer_prefix_misses", "admissions with no reusable prefix",
                                  value=s.prefix.misses)
        yield CounterMetricFamily("ninfer_prefix_cached_tokens",
                                  "prompt tokens served from a checkpoint (prefill saved)",
                                  value=s.prefix.cached_tokens)
        spec = s.speculative
        method = GaugeMetricFamily("ninfer_speculative_method",
                                   "what drafts (mtp, dflash; off: speculation off); always 1",
                                   labels=["method"])
        method.add_metric([spec.method], 1)
        yield method
        yield GaugeMetricFamily("ninfer_speculative_tokens",
                                "draft tokens per decode round (0: speculation off)",
                                value=spec.num_speculative_tokens)
        yield CounterMetricFamily("ninfer_speculative_verify_rows",
                                  "rows of speculative decode rounds that committed tokens",
                                  value=spec.verify_rows)
        yield GaugeMetricFamily("ninfer_speculative_mean_accepted_tokens",
                                "tokens committed per verify row, the bonus token included",
                                value=spec.mean_accepted_tokens)
        by_position = GaugeMetricFamily("ninfer_speculative_acceptance",
                                        "accepted / attempted drafts by draft position",
                                        labels=["position"])
        for i, rate in enumerate(spec.acceptance_by_position):
            by_position.add_metric([str(i)], rate)
        yield by_position
        rounds = CounterMetricFamily("ninfer_speculative_rounds",
                                     "decode rounds by their draft count K (the draft policy's "
                                     "choice)", labels=["drafts"])
        for k, n in spec.rounds_by_drafts:
            rounds.add_metric([str(k)], n)
        yield rounds
        yield CounterMetricFamily("ninfer_speculative_bare_rounds",
                                  "decode rounds of no drafts that skipped the drafter's upkeep "
                                  "(DFlash: drafting was losing for their rows)",
                                  value=spec.bare_rounds)
        yield GaugeMetricFamily("ninfer_speculative_estimated_gain",
                                "chosen rounds' expected tokens/s over rounds of no drafts, "
                                "as the adaptive policy estimates them (0: not measured)",
                                value=spec.estimated_gain)
        yield from _tier_metrics(s.tiers)


def _tier_metrics(t: Any) -> Iterator[Metric]:
    """The context store's counters (all zero when the Engine has none)."""
    counters = {
        "offloads": "checkpoints written to the context store", "blocks_written": "blocks "
        "written", "bytes_written": "bytes written", "write_failures": "failed writes",
        "lookups": "prompts looked up after a device miss", "reloads": "checkpoints "
        "reloaded from the store", "reloaded_tokens": "prompt tokens reloaded",
        "bytes_loaded": "bytes read back", "reload_failures": "found checkpoints that could "
        "not be reloaded (a miss)", "store_errors": "store calls that failed",
        "reload_seconds": "time from lookup to import, summed over reloads"}
    for name, doc in counters.items():
        yield CounterMetricFamily(f"ninfer_store_{name}", doc, value=getattr(t, name))
    yield GaugeMetricFamily("ninfer_store_pending_writes", "write jobs not yet completed",
                            value=t.pending_writes)
    yield GaugeMetricFamily("ninfer_store_pending_reads", "reads not yet concluded",
                            value=t.pending_reads)
    hits = CounterMetricFamily("ninfer_store_hits", "reloads by the slowest tier they came "
                               "from", labels=["tier"])
    for tier, n in t.hits_by_tier:
        hits.add_metric([tier], n)
    yield hits
    evictions = CounterMetricFamily("ninfer_store_evictions", "blocks evicted by a host-memory "
                                    "tier (they stay readable from the tiers below)",
                                    labels=["tier"])
    for tier, n in t.evictions_by_tier:
        evictions.add_metric([tier], n)
    yield evictions
    quarantined = CounterMetricFamily("ninfer_store_quarantined", "block files a disk tier "
                                      "found damaged or foreign and moved to its quarantine "
                                      "directory", labels=["tier"])
    for tier, n in t.quarantined_by_tier:
        quarantined.add_metric([tier], n)
    yield quarantined


class Metrics:
    """The gateway's observations plus the Engine collector, in one registry."""

    def __init__(self, engine: Engine):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("ninfer_time_to_first_token_seconds",
                              "from the request's arrival to its first output token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ninfer_inter_token_latency_seconds",
                             "between consecutive output tokens of one request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("ninfer_requests", "finished HTTP generation requests",
                                ["api", "outcome"], registry=r)
        self.rejections = Counter("ninfer_rejected_requests",
                                  "requests refused before generation, by reason",
                                  ["reason"], registry=r)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.disconnects = Counter("ninfer_client_disconnects",
                                   "requests cancelled because the client went away",
                                   registry=r)
        self.rate = TokenRate()
        r.register(_EngineCollector(engine, self.rate))

    def render(self) -> bytes:
        return generate_latest(self.registry)
