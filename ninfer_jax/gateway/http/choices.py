"""The generations behind one answer's choices: `n` per prompt and a batch of prompts.

Owns expanding a request into its choices (OpenAI's order: choice `i * n + j` is prompt i's
j-th sample), submitting them so that the n samples of a prompt share its prefill (the Engine
is asked to leave a prefix checkpoint first, `Engine.aprime_prefix`; each sample then prefills
only the prompt's last token), distinct seeds per sample (a given `seed` becomes seed + j, so
sampled choices differ yet reproduce), waiting for all of them while watching the connection,
and merging their streams in arrival order. Every generation is released exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from ninfer_jax.engine.events import Event, Finished
from ninfer_jax.gateway.http.generation import Generation, prepare, submit, until_disconnect
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.state import ServerState
from ninfer_jax.sampling_params import MAX_SEED


def prompts(req: GenerationRequest) -> list[GenerationRequest]:
    """One single-prompt request per prompt of the batch, in order."""
    out = [dataclasses.replace(req, more_prompts=())]
    for p in req.more_prompts:
        text, ids = (p, None) if isinstance(p, str) else (None, p)
        out.append(dataclasses.replace(req, prompt=text, prompt_token_ids=ids, more_prompts=()))
    return out


async def start_choices(state: ServerState, req: GenerationRequest,
                        received_at: float) -> list[Generation]:
    """The generations of every choice, in choice order. All prompts are checked before any is
    submitted; a refusal part-way releases those already submitted."""
    engine, gens = state.engine, []
    prepared = await state.off_loop(lambda: [prepare(engine, r) for r in prompts(req)],
                                    body_bytes=req.body_bytes)
    try:
        for r, (prompt, sampling) in zip(prompts(req), prepared):
            if req.n > 1:
                await engine.aprime_prefix(prompt.token_ids, cache_salt=r.cache_scope)
            for j in range(req.n):
                seeded = sampling
                if sampling.seed is not None and j:
                    seeded = dataclasses.replace(sampling, seed=(sampling.seed + j) % (MAX_SEED + 1))
                gens.append(await submit(engine, r, prompt, seeded, state.metrics, received_at))
    except BaseException:
        for gen in gens:
            gen.close(False)
        raise
    return gens


def close_all(gens: list[Generation]):
    def close(disconnected: bool) -> None:
        for gen in gens:
            gen.close(disconnected)
    return close


async def whole_results(request: Request, gens: list[Generation]) -> list[Any] | None:
    """Every generation's result, or None when the client left first (all are cancelled)."""
    async def work() -> list[Any]:
        return list(await asyncio.gather(*(g.result() for g in gens)))

    results = None
    try:
        results = await until_disconnect(request, work)
    finally:
        close_all(gens)(results is None)
    return results


async def merged_events(gens: list[Generation]) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every generation, as they arrive; ends after every Finished."""
    if len(gens) == 1:
        async for event in gens[0].events():
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        async for event in gen.events():
            await queue.put((i, event))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, event = await queue.get()
            if isinstance(event, Finished):
                left -= 1
            yield i, event
    finally:
        for task in tasks:
            task.cancel()
