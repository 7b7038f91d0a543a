"""The event loop never runs a request's CPU work: parsing a body, tokenizing and rendering a
prompt (`generation.prepare`), the tokens endpoints. A request whose preparation blocks must
leave `/health` and other clients answered meanwhile (#41's stall: 3.3 s for a 3.9 MB prompt,
9.2 s for 60,000 messages, with every client waiting)."""

from __future__ import annotations

import threading

import httpx
import pytest

from ninfer_jax.frontend import Frontend
from tests.gateway.conftest import CHATML, MODEL, TOKENIZER, assert_fully_free, make_engine, served

MARK = "block-here"


class _BlockingFrontend(Frontend):
    """Prepares a prompt holding MARK only once `release` is set (or 10 s passed), recording
    which; the gateway must be running it off the event loop for anything to set it."""

    def __init__(self):
        super().__init__(TOKENIZER, CHATML)
        self.entered, self.release, self.released = threading.Event(), threading.Event(), []

    def prepare(self, **kwargs):
        text = str(kwargs.get("prompt") or kwargs.get("messages") or kwargs.get("text") or "")
        if MARK in text:
            self.entered.set()
            self.released.append(self.release.wait(10))
        return super().prepare(**kwargs)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": MARK, "max_tokens": 2}),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                              "messages": [{"role": "user", "content": MARK}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 2,
                      "messages": [{"role": "user", "content": MARK}]}),
    ("/tokenize", {"model": MODEL, "prompt": MARK}),
])
def test_a_request_being_prepared_leaves_the_event_loop_answering(path, body):
    frontend = _BlockingFrontend()
    engine = make_engine(frontend=frontend)
    with served(engine) as server:
        answers = {}
        slow = threading.Thread(target=lambda: answers.update(
            slow=httpx.post(f"{server.url}{path}", json=body, timeout=30)))
        slow.start()
        assert frontend.entered.wait(10)  # its preparation is running now
        health = httpx.get(f"{server.url}/health", timeout=5)  # on today's loop: a timeout
        other = httpx.post(f"{server.url}/v1/completions", timeout=5,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        frontend.release.set()
        slow.join(30)
        assert health.status_code == 200 and other.status_code == 200
        assert frontend.released == [True]  # released by the test, not by the 10-s timeout
        assert answers["slow"].status_code == 200, answers["slow"].text
        assert_fully_free(engine)
