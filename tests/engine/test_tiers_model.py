"""Prefix checkpoints through the context store on the embedded demo model: a follow-up turn's
greedy continuation is token-identical whether its history came from the device, the host tier,
the disk tier, Redis or a recompute, with and without MTP speculation (whose checkpoints also
carry the MTP context, and whose K/V blocks depend on one token past each page)."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from ninfer_jax import Engine, load_model
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.redis_server import RedisServer
from tests.engine.conftest import settle
from tests.engine.test_speculative_engine import MAX_CONCURRENCY, SETTINGS

# ~130 s cold (the demo Engines with and without MTP, every tier): the default run's 15 minutes;
# real-model reloads stay in the default run through tests/gateway/test_serve_tiers.py (disk,
# across a SIGKILL) and test_vision_engine.py (host), the tiers' rules through FakeProgram
# Engines in test_tiers_engine.py.
pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)
HISTORY = "Once upon a time there was a little girl named Lily. She loved to play outside in"
FOLLOW_UP = " the park. One day"


def _open(topology: dict, **settings) -> Engine:
    return Engine.open(max_concurrency=MAX_CONCURRENCY, verify_weights=False,
                       context_store=topology, **SETTINGS, **settings)


def _pipe(*stores: dict) -> dict:
    return {"type": "pipe", "stores": list(stores)}


def _drained(engine: Engine) -> None:
    """Every checkpoint retained so far sent to the store (the worker idle: a turn's checkpoint
    is sent in the iteration after its answer) and every write completed."""
    settle(engine.core)
    deadline = time.monotonic() + 30
    while engine.stats().tiers.pending_writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats().tiers.pending_writes == 0


def _hits(engine: Engine) -> dict[str, int]:
    return dict(engine.stats().tiers.hits_by_tier)


@functools.cache
def _reference(prompt_ids: tuple[int, ...], num_new: int) -> list[int]:
    """Greedy by full forwards of the demo model (no Program, no cache of any kind)."""
    model, ids = load_model(verify=False), list(prompt_ids)
    for _ in range(num_new):
        ids.append(int(np.argmax(model.logits(np.array([ids]))[0, -1])))
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    with RedisServer() as redis:
        yield {"cache": {"store": "cache", "config": {"capacity_gb": 0.01}},
               "posix": {"store": "posix", "config": {"root": str(tmp_path_factory.mktemp("d"))}},
               "redis": {"store": "redis", "config": {"url": redis.url}}}


@pytest.fixture(scope="module")
def writer(stores):
    """An Engine over host -> disk that ran the first turn (its checkpoints written through to
    both tiers, and to Redis by an Engine over host -> Redis) and knows the follow-up prompt."""
    engine = _open(_pipe(stores["cache"], stores["posix"]))
    first = engine.generate(HISTORY, sampling=GREEDY)
    _drained(engine)
    assert engine.stats().tiers.offloads >= 2  # the prompt's and the turn's checkpoints
    with _open(_pipe(stores["redis"])) as to_redis:
        assert to_redis.generate(HISTORY, sampling=GREEDY).token_ids == first.token_ids
        _drained(to_redis)
    engine.follow_up = HISTORY + first.text + FOLLOW_UP
    engine.history_tokens = first.usage.prompt_tokens
    yield engine
    engine.close()


def _check(result, engine: Engine) -> None:
    prompt_ids = tuple(engine.frontend.prepare(prompt=engine.follow_up).token_ids)
    assert list(result.token_ids) == _reference(prompt_ids, len(result.token_ids))


def test_recompute(writer):
    result = writer.generate(writer.follow_up, sampling=GREEDY, cache_salt="fresh tenant")
    assert result.usage.cached_tokens == 0
    _check(result, writer)


def test_device(writer):
    reloads = writer.stats().tiers.reloads
    result = writer.generate(writer.follow_up, sampling=GREEDY)
    assert result.usage.cached_tokens >= writer.history_tokens
    assert writer.stats().tiers.reloads == reloads  # served by a device checkpoint
    _check(result, writer)


def test_host(writer):
    writer.clear_prefix_cache()
    before = _hits(writer).get("cache", 0)
    result = writer.generate(writer.follow_up, sampling=GREEDY)
    assert result.usage.cached_tokens >= writer.history_tokens, writer.stats()
    assert _hits(writer)["cache"] == before + 1
    _check(result, writer)


@pytest.mark.parametrize("tier", ["posix", "redis"])
def test_disk_and_redis(writer, stores, tier):
    with _open(_pipe(stores["cache"], stores[tier])) as engine:  # a fresh host tier: a miss
        engine.follow_up = writer.follow_up
        result = engine.generate(engine.follow_up, sampling=GREEDY)
        assert result.usage.cached_tokens >= writer.history_tokens
        assert _hits(engine) == {"cache": 0, tier: 1}
        _check(result, engine)


def test_redis_below_an_empty_disk(stores, writer, tmp_path):
    """host -> disk -> Redis, the history only in Redis: it comes up through the disk tier
    (and is written there on the way)."""
    disk = {"store": "posix", "config": {"root": str(tmp_path)}}
    with _open(_pipe(stores["cache"], disk, stores["redis"])) as engine:
        engine.follow_up = writer.follow_up
        result = engine.generate(engine.follow_up, sampling=GREEDY)
        assert result.usage.cached_tokens >= writer.history_tokens
        assert _hits(engine) == {"cache": 0, "posix": 0, "redis": 1}
        assert list((tmp_path / "blocks").rglob("*.blk"))
        _check(result, engine)


def test_host_reload_with_mtp(stores):
    with _open(_pipe(stores["cache"]), speculative="mtp", num_speculative_tokens=2) as engine:
        first = engine.generate(HISTORY, sampling=GREEDY)
        engine.follow_up = HISTORY + first.text + FOLLOW_UP
        _drained(engine)
        engine.clear_prefix_cache()
        result = engine.generate(engine.follow_up, sampling=GREEDY)
        assert result.usage.cached_tokens >= first.usage.prompt_tokens
        assert _hits(engine)["cache"] == 1
        _check(result, engine)
