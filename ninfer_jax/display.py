"""Rich display of results and stats in notebooks (IPython's `_repr_html_` / `_repr_pretty_`).

Owns how a GenerationResult, EngineStats and ScoreResult look in a notebook cell: a compact
HTML table, with token log-probabilities coloured from red (unlikely) to green (likely), and a
one-line plain-text summary for IPython's pretty printer. Pure formatting: no jax, no engine
state; every object keeps its dataclass repr for `repr()`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

MAX_TOKENS_SHOWN = 2000  # a heat map of a longer text shows its first tokens and says so

_TABLE = ("<table style='border-collapse:collapse;font-size:90%;text-align:left'>{}</table>")
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;vertical-align:top"


def _rows(rows: Iterable[tuple[str, Any]]) -> str:
    return "".join(f"<tr><th style='{_CELL}'>{html.escape(k)}</th>"
                   f"<td style='{_CELL}'>{v}</td></tr>" for k, v in rows)


def _text(text: str) -> str:
    return (f"<div style='white-space:pre-wrap;font-family:monospace;max-width:60em'>"
            f"{html.escape(text)}</div>")


def _colour(logprob: float) -> str:
    """Background for a token of this log-prob: hue 0 (red, p = 0) to 120 (green, p = 1)."""
    p = math.exp(min(0.0, logprob)) if math.isfinite(logprob) else 0.0
    return f"hsl({120 * p:.0f},70%,85%)"


def heat_map(pieces: Sequence[str], logprobs: Sequence[float]) -> str:
    """Tokens as spans coloured by their log-prob; each span's tooltip gives the numbers."""
    spans = []
    for piece, lp in zip(pieces[:MAX_TOKENS_SHOWN], logprobs[:MAX_TOKENS_SHOWN]):
        lp = float(lp)
        title = f"logprob {lp:.3f}, p {math.exp(lp):.3f}" if math.isfinite(lp) else "logprob -inf"
        shown = html.escape(piece).replace("\n", "\u21b5<br>") or "&#8203;"
        spans.append(f"<span title='{title}' style='background:{_colour(lp)};"
                     f"border-radius:2px;margin:0 1px'>{shown}</span>")
    more = len(pieces) - MAX_TOKENS_SHOWN
    tail = f" <i>... {more} more tokens</i>" if more > 0 else ""
    return (f"<div style='font-family:monospace;line-height:1.9;max-width:60em;"
            f"white-space:pre-wrap'>{''.join(spans)}{tail}</div>")


def token_pieces(decode: Callable[[Sequence[int]], str] | None,
                 token_ids: Sequence[int]) -> list[str]:
    """Each token's own text (a byte-level piece of a longer character may show as U+FFFD);
    without a tokenizer, the ids."""
    if decode is None:
        return [f"[{int(t)}]" for t in token_ids]
    return [decode([int(t)]) for t in token_ids]


def _shorten(text: str, n: int = 60) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= n else text[: n - 3] + "..."


# GenerationResult ---------------------------------------------------------------------------
def generation_html(r: Any) -> str:
    u = r.usage
    rows = [("finish", html.escape(r.finish_reason.value + (f" ({r.stop_string!r})"
                                                             if r.stop_string else "")))]
    if r.error:
        rows.append(("error", _text(r.error)))
    if r.reasoning_text:
        rows.append(("thinking", f"<details><summary>{len(r.reasoning_text)} characters"
                                 f"</summary>{_text(r.reasoning_text)}</details>"))
    if r.logprobs is not None:
        pieces = token_pieces(r.decode, [t.token_id for t in r.logprobs])
        rows.append(("text", heat_map(pieces, [t.logprob for t in r.logprobs])))
    else:
        rows.append(("text", _text(r.text)))
    rows.append(("tokens", f"prompt {u.prompt_tokens} (cached {u.cached_tokens}), "
                           f"completion {u.completion_tokens}"))
    rows.append(("seed", str(r.seed)))
    return f"<b>GenerationResult</b> #{r.request_id}" + _TABLE.format(_rows(rows))


def generation_line(r: Any) -> str:
    u = r.usage
    return (f"GenerationResult(#{r.request_id} {r.finish_reason.value}, "
            f"{u.completion_tokens} tokens, cached {u.cached_tokens}/{u.prompt_tokens}: "
            f"{_shorten(r.text)!r})")


# EngineStats --------------------------------------------------------------------------------
def stats_html(s: Any) -> str:
    p = s.prefix
    rows = [
        ("state", "available" if s.available else "<b>failed or closed</b>"),
        ("requests", f"{s.active} active, {s.waiting} waiting, {s.outstanding} outstanding of "
                     f"capacity {s.capacity}; {s.finished_requests} finished"),
        ("lanes", f"{s.free_lanes} free of {s.total_lanes}"),
        ("pages", f"{s.free_pages} free of {s.total_pages} ({s.reserved_pages} reserved)"),
        ("state slots", f"{s.free_slots} free of {s.total_slots}"),
        ("tokens generated", str(s.generated_tokens)),
        ("prefix cache", f"{p.checkpoints} checkpoints, {p.hits} hits, {p.misses} misses, "
                         f"{p.cached_tokens} tokens reused, {p.evictions} evictions, "
                         f"{p.bytes_held / 2**20:.1f} MiB held"),
    ]
    sp = s.speculative
    if sp.num_speculative_tokens:
        by_pos = ", ".join(f"{a:.2f}" for a in sp.acceptance_by_position)
        rows.append(("speculative", f"{sp.method} K={sp.num_speculative_tokens}: "
                                    f"{sp.mean_accepted_tokens:.2f} tokens per row-round, "
                                    f"acceptance by position [{by_pos}]"))
        if sp.policy == "adaptive":
            chosen = ", ".join(f"K={k}: {n}" for k, n in sp.rounds_by_drafts)
            rows.append(("draft policy", f"adaptive, rounds {chosen or 'none yet'}, estimated "
                                         f"gain {sp.estimated_gain:.2f}x"))
    t = s.tiers
    if t.tiers:
        hits = ", ".join(f"{k} {v}" for k, v in t.hits_by_tier) or "none"
        damaged = "".join(f", {n} damaged files quarantined by {k}"
                          for k, n in t.quarantined_by_tier if n)
        rows.append(("context store", f"{' > '.join(t.tiers)}: {t.offloads} offloads, "
                                      f"{t.reloads} reloads (by tier: {hits}){damaged}"))
    return "<b>EngineStats</b>" + _TABLE.format(_rows(rows))


def stats_line(s: Any) -> str:
    return (f"EngineStats({'available' if s.available else 'unavailable'}: {s.active} active, "
            f"{s.waiting} waiting, {s.free_lanes}/{s.total_lanes} lanes free, "
            f"{s.free_pages}/{s.total_pages} pages free, {s.generated_tokens} tokens, "
            f"{s.prefix.checkpoints} checkpoints, {s.prefix.hits} hits)")


# ScoreResult --------------------------------------------------------------------------------
def score_html(r: Any) -> str:
    pieces = token_pieces(r.decode, r.token_ids)
    rows = [("tokens", str(r.num_tokens)), ("sum log-prob", f"{r.sum_logprob:.4f}"),
            ("perplexity", f"{r.perplexity:.4g}"), ("greedy", str(r.is_greedy)),
            ("log-probs", heat_map(pieces, r.token_logprobs))]
    return "<b>ScoreResult</b>" + _TABLE.format(_rows(rows))


def score_line(r: Any) -> str:
    return (f"ScoreResult({r.num_tokens} tokens, sum log-prob {r.sum_logprob:.4f}, "
            f"perplexity {r.perplexity:.4g}, greedy {r.is_greedy})")


def pretty(line: Callable[[Any], str]) -> Callable:
    """A `_repr_pretty_` method printing `line(self)`."""
    def _repr_pretty_(self, p, cycle):
        p.text(line(self))
    return _repr_pretty_
