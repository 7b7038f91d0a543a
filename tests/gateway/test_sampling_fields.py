"""Every sampling field of each API reaches the Engine: the SamplingParams the Program received
(the FakeProgram's `after_materialize` hook) is compared with what the body asked for, one field
at a time and all together, streaming and not, for OpenAI chat, completions and Anthropic."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import MODEL, make_engine, served

BUDGET = 2
# (body field, value, SamplingParams field, value the Engine must receive)
OPENAI = [
    ("temperature", 0.25, "temperature", 0.25),
    ("top_p", 0.5, "top_p", 0.5),
    ("top_k", 7, "top_k", 7),
    ("min_p", 0.25, "min_p", 0.25),
    ("presence_penalty", 0.5, "presence_penalty", 0.5),
    ("frequency_penalty", -0.5, "frequency_penalty", -0.5),
    ("repetition_penalty", 1.25, "repetition_penalty", 1.25),
    ("stop", ["zz", "yy"], "stop", ("zz", "yy")),
    ("stop", "zz", "stop", ("zz",)),
    ("seed", 1234, "seed", 1234),
    ("max_tokens", 3, "max_new_tokens", 3),
]
CHAT = [*OPENAI, ("max_completion_tokens", 3, "max_new_tokens", 3)]
ANTHROPIC = [
    ("temperature", 0.25, "temperature", 0.25),
    ("top_p", 0.5, "top_p", 0.5),
    ("top_k", 7, "top_k", 7),
    ("stop_sequences", ["zz", "yy"], "stop", ("zz", "yy")),
    ("max_tokens", 3, "max_new_tokens", 3),
]
APIS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, CHAT),
    "completions": ("/v1/completions", {"prompt": "hi"}, OPENAI),
    "anthropic": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, ANTHROPIC),
}
CASES = [(api, field) for api, (_, _, fields) in APIS.items() for field in fields]


@pytest.fixture(scope="module")
def live():
    """A server whose Program notes the SamplingParams of every sequence it creates."""
    engine = make_engine()
    received: list[SamplingParams] = []
    engine.core.program.on("after_materialize", lambda seqs: received.append(seqs[0].sampling))
    with served(engine) as server:
        yield server, received


def _send(live, api: str, fields: list[tuple], stream: bool) -> SamplingParams:
    server, received = live
    path, base, _ = APIS[api]
    body = {"model": MODEL, **base, "max_tokens": BUDGET, "stream": stream}
    body.update({name: value for name, value, _, _ in fields})
    received.clear()
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    assert len(received) == 1, received
    return received[0]


def _expected(fields: list[tuple]) -> SamplingParams:
    kwargs = {"max_new_tokens": BUDGET}
    kwargs.update({name: value for _, _, name, value in fields})
    return SamplingParams(**kwargs)


def _same(got: SamplingParams, want: SamplingParams) -> None:
    if want.seed is None:  # the Engine draws a seed for a sampled request that gave none
        got = dataclasses.replace(got, seed=None)
    assert got == want


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api, field", CASES, ids=[f"{a}-{f[0]}-{f[1]}" for a, f in CASES])
def test_each_field_reaches_the_engine(live, api, field, stream):
    got = _send(live, api, [field], stream)
    _same(got, _expected([field]))
    name, value = field[2], field[3]
    assert getattr(got, name) == value != getattr(SamplingParams(), name)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", list(APIS))
def test_all_fields_together_reach_the_engine(live, api, stream):
    fields = {f[0]: f for f in APIS[api][2]}  # one value per body field
    fields.pop("max_completion_tokens", None)  # it replaces max_tokens: checked on its own
    got = _send(live, api, list(fields.values()), stream)
    _same(got, _expected(list(fields.values())))
