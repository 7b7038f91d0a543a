"""Images through `ninfer serve` on the `vision` fixture: the official openai and anthropic
clients send an image (a data URL / a base64 block, and a file:// URL under the server's
--allowed_media_dir) and get the Engine's own answer for the same messages; bad media get a
400 naming the part, and the server stays healthy (a normal request after them succeeds and
nothing is left outstanding)."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from ninfer_jax.api import Engine
from ninfer_jax.sampling_params import SamplingParams
from tests.conftest import FIXTURES
from tests.gateway.conftest import MODEL, served, wait_idle

DIR = FIXTURES / "vision"
IMAGES = DIR / "images"
PNG = (IMAGES / "grad_64x48.png").read_bytes()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def server():
    engine = Engine.open(DIR, max_concurrency=2, max_seq_len=256, prefill_chunk=16,
                         max_vision_patches=512, local_media=IMAGES)
    with served(engine) as s:
        yield s


def _engine(server) -> Engine:
    return server.server.config.app.state.server.engine


def _want(server, image, thinking: bool | None = None):
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": QUESTION}]}]
    return _engine(server).generate(messages=messages, enable_thinking=thinking,
                                    sampling=SamplingParams(max_new_tokens=6, temperature=0))


def _chat(url: str | list[str]) -> dict:
    urls = [url] if isinstance(url, str) else url
    return {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}}
                                     for u in urls] + [{"type": "text", "text": QUESTION}]}]}


def test_openai_client_sends_an_image(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        for url in (DATA_URL, f"file://{IMAGES / 'grad_64x48.png'}"):
            r = c.chat.completions.create(**_chat(url))
            want = _want(server, PNG)
            message = r.choices[0].message
            assert (message.content, message.model_extra["reasoning_content"]) == (
                want.text, want.reasoning_text)
            assert r.usage.prompt_tokens == want.usage.prompt_tokens > 12  # 12 placeholders


def test_anthropic_client_sends_an_image(server):
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    msg = c.messages.create(model=MODEL, max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}},
            {"type": "text", "text": QUESTION}]}])
    want = _want(server, PNG, thinking=False)  # Anthropic's default: thinking off
    assert msg.content[0].text == want.text
    # Anthropic counts cached prompt tokens apart (an earlier test left this prefix)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == want.usage.prompt_tokens


def _png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


BAD = {
    "truncated": ("data:image/png;base64," + base64.b64encode(PNG[: len(PNG) // 2]).decode(),
                  "not a readable image"),
    "not an image": ("data:image/png;base64," + base64.b64encode(b"hello").decode(),
                     "not a readable image"),
    # #41: a PNG declared as text was decoded as an image; a directory gave a 500
    "text, not an image": ("data:text/plain;base64," + base64.b64encode(PNG).decode(),
                           "data URL of type 'text/plain' is not an image"),
    "a directory": (f"file://{IMAGES}", "is not a regular file"),
    "too thin": (_png(Image.new("RGB", (2010, 10))), "aspect ratio 201 exceeds 200"),
    "over http": ("https://example.com/cat.png", "fetching media over http(s) is off"),
    "outside the directory": (f"file://{DIR / 'config.json'}", "outside the allowed media"),
    "too many patches": ([_png(Image.new("RGB", (512, 512)))] * 3,
                         "768 patches, more than max_vision_patches 512"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_media_get_400_naming_the_part(server, case):
    url, why = BAD[case]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(url), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert why in err["message"], err
    if case != "too many patches":  # that one is the prompt's, not one part's
        assert "messages[0].content[0]" in (err.get("param") or "") + err["message"], err


def test_the_server_is_healthy_after_bad_media(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(DATA_URL), timeout=30)
    assert r.status_code == 200, r.text
    s = wait_idle(_engine(server))
    assert (s.outstanding, s.active, s.waiting) == (0, 0, 0), s
    assert s.free_lanes == s.total_lanes


def test_a_video_as_frames_and_as_a_file(server):
    frames = [IMAGES / f"frame{i}_64x48.png" for i in range(4)]
    urls = ["data:image/png;base64," + base64.b64encode(f.read_bytes()).decode() for f in frames]
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "video", "video": urls, "fps": 4},
                                     {"type": "text", "text": QUESTION}]}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    want = _engine(server).generate(messages=[{"role": "user", "content": [
        {"type": "video", "video": [f.read_bytes() for f in frames], "fps": 4},
        {"type": "text", "text": QUESTION}]}], sampling=SamplingParams(max_new_tokens=6,
                                                                       temperature=0))
    message = r.json()["choices"][0]["message"]
    assert (message["content"], message.get("reasoning_content", "")) == (
        want.text, want.reasoning_text)
    assert r.json()["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    mp4 = "data:video/mp4;base64," + base64.b64encode(_mp4()).decode()
    body["messages"][0]["content"][0] = {"type": "video_url", "video_url": {"url": mp4}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    body["messages"][0]["content"][0]["video_url"]["url"] = (
        "data:video/mp4;base64," + base64.b64encode(b"\x00\x00 not a video").decode())
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "not a readable video" in r.json()["error"]["message"]


def _mp4() -> bytes:
    from tests.engine.test_vision_engine import mp4_of

    return mp4_of([IMAGES / f"frame{i}_64x48.png" for i in range(4)] * 5, rate=10)
