"""Benchmark settings read from environment variables, with errors naming the variable.

Suites are called as `run(out_dir)`, so their knobs (configs, batch sizes, repetitions) come
from `BENCH_*` variables; a bad value stops the run before anything is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


class SettingError(ValueError):
    """A BENCH_* variable holds a value the suite cannot use."""


def _parse_int(name: str, raw: str, minimum: int, maximum: int | None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name} must be an integer, got {raw!r:.40}") from None
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise SettingError(f"{name} must be >= {minimum}{upper}, got {value}")
    return value


def env_int(name: str, default: int, *, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer in [minimum, maximum] from $name, or `default` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    return _parse_int(name, raw, minimum, maximum) if raw else default


def env_ints(name: str, default: Sequence[int], *, minimum: int = 1,
             maximum: int | None = None) -> tuple[int, ...]:
    """Distinct integers in [minimum, maximum], comma-separated, in ascending order."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return tuple(default)
    values = [_parse_int(name, part.strip(), minimum, maximum) for part in raw.split(",")]
    if len(set(values)) != len(values):
        raise SettingError(f"{name} must list distinct integers, got {raw!r:.60}")
    return tuple(sorted(values))


def env_choices(name: str, default: Sequence[str], choices: Sequence[str]) -> tuple[str, ...]:
    """Distinct names out of `choices`, comma-separated, in the order given."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return tuple(default)
    values = tuple(p.strip() for p in raw.split(","))
    bad = [v for v in values if v not in choices]
    if bad or len(set(values)) != len(values):
        raise SettingError(f"{name} must list distinct names out of {list(choices)}, got "
                           f"{raw!r:.60}")
    return values


def env_choice(name: str, default: str, choices: Sequence[str]) -> str:
    """One name out of `choices` from $name, or `default` when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if raw and raw not in choices:
        raise SettingError(f"{name} must be one of {list(choices)}, got {raw!r:.40}")
    return raw or default


def env_checkout(name: str) -> str | None:
    """$name: a checkout's directory whose ninfer_jax a baseline worker runs (`git worktree
    add DIR COMMIT`), resolved; None when unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    path = os.path.realpath(raw)
    if not os.path.isfile(os.path.join(path, "ninfer_jax", "__init__.py")):
        raise SettingError(f"{name}={raw!r:.200}: no ninfer_jax/ in that directory")
    return path


def torch_worker_env() -> dict[str, str]:
    """Environment for a worker running torch: OMP_WAIT_POLICY from
    $BENCH_TORCH_OMP_WAIT_POLICY (passive, the default; active; or inherit = leave as is).

    Why passive: torch's OpenMP threads spin at every parallel region's barrier by default. On
    a machine shared with other jobs (load above its core count) a spinning thread waits for a
    descheduled partner, and transformers' decode ran 5x slower on MEDIUM (0.6 vs 3.3 tok/s at
    B=1, load 4 on 2 cores, ABAB) and 12x slower on the tiny config. Passive waiting is
    transformers at its best here, so the comparison does not flatter us.
    """
    policy = env_choice("BENCH_TORCH_OMP_WAIT_POLICY", "passive", ("passive", "active", "inherit"))
    return {} if policy == "inherit" else {"OMP_WAIT_POLICY": policy.upper()}
