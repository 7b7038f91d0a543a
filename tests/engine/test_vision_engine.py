"""Images through the Engine's Python API on the `vision` fixture (its byte-level tokenizer and
the official Qwen3.5 chat template): chat messages with image parts are rendered, the template's
placeholders expanded, and the answer equals a Program run on the same prompt and media. Prefix
reuse keys prompts by their images: a follow-up turn with the same image reuses the first
turn's checkpoint, the same text with another image does not, and outputs equal reuse off.
Bad media are refused naming the part."""

from __future__ import annotations

import base64
import functools

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.engine.events import RejectedError
from ninfer_jax.frontend import PromptError
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.sampling_params import SamplingParams
from tests.conftest import FIXTURES

DIR = FIXTURES / "vision"
IMAGES = DIR / "images"
SETTINGS = {"max_concurrency": 2, "max_seq_len": 256, "prefill_chunk": 16,
            "max_vision_patches": 512}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@functools.cache
def engine(reuse: bool) -> Engine:
    return Engine.open(DIR, prefix_reuse=reuse, **SETTINGS)


def teardown_module():
    for reuse in (True, False):
        engine(reuse).close()


def ask(image, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": text}]}]


def test_image_placeholders_expand_and_identity_follows_the_image():
    f = engine(False).frontend
    a = f.prepare(messages=ask(str(IMAGES / "grad_64x48.png")))
    assert a.token_ids.count(380) == 12 and len(a.media) == 1 and a.media[0].grid == (1, 6, 8)
    data = (IMAGES / "grad_64x48.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for same in (data, url, f"file://{IMAGES / 'grad_64x48.png'}"):
        b = f.prepare(messages=ask(same))
        assert b.token_ids == a.token_ids and b.identity == a.identity and b.digest == a.digest
    other = f.prepare(messages=ask(str(IMAGES / "frame0_64x48.png")))  # the same size
    assert other.token_ids == a.token_ids and other.identity != a.identity
    first = a.token_ids.index(380)
    assert other.identity[:first] == a.identity[:first]


def _program_answer(prompt) -> list[int]:
    e = engine(False)
    prog = Program(e.core.program.cfg, e.core.program.params,
                   ProgramConfig(max_concurrency=1, page_size=16, num_pages=32, max_seq_len=256,
                                 prefill_chunk=16, max_vision_patches=512))
    h = prog.materialize(prog.plan_admission(len(prompt.token_ids), 6), prompt.token_ids,
                         media=prompt.media)
    while (batch := prog.prefill(h)) is None:
        pass
    prog.commit(batch, [1])
    for _ in range(5):
        prog.commit(prog.decode([h]), [1])
    out = prog.tokens(h)[len(prompt.token_ids):]
    prog.close()
    return out


def test_the_answer_equals_the_program_on_the_same_prompt():
    messages = ask(str(IMAGES / "shapes_200x120.png"))
    result = engine(False).generate(messages=messages, sampling=GREEDY)
    prompt = engine(False).frontend.prepare(messages=messages)
    assert result.usage.prompt_tokens == len(prompt.token_ids)
    assert list(result.token_ids) == _program_answer(prompt)


def test_a_follow_up_with_the_same_image_reuses_and_another_image_does_not():
    def turns(e, image2):
        first = ask(str(IMAGES / "grad_64x48.png"))
        r1 = e.generate(messages=first, sampling=GREEDY)
        follow = first + [{"role": "assistant", "content": r1.text},
                          {"role": "user", "content": "And its colours?"}]
        r2 = e.generate(messages=follow, sampling=GREEDY)
        swapped = ask(str(IMAGES / image2))
        r3 = e.generate(messages=swapped, sampling=GREEDY)
        return r1, r2, r3

    on = turns(engine(True), "frame1_64x48.png")
    off = turns(engine(False), "frame1_64x48.png")
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    prompt = engine(True).frontend.prepare(messages=ask(str(IMAGES / "grad_64x48.png")))
    image_end = prompt.token_ids.index(379)  # vision end: the image is inside the reused prefix
    assert on[1].usage.cached_tokens > image_end
    assert on[2].usage.cached_tokens <= prompt.token_ids.index(380)  # none of the image
    assert all(r.usage.cached_tokens == 0 for r in off)


def test_bad_media_are_refused_naming_the_part():
    f = engine(False).frontend
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]\.image: no such file"):
        f.prepare(messages=ask(str(IMAGES / "missing.png")))
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]\.image: not a readable"):
        f.prepare(messages=ask(b"GIF89a truncated"))
    with pytest.raises(PromptError, match="http\\(s\\) is off"):
        f.prepare(messages=ask("https://example.com/cat.png"))
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[1\]: a system message"):
        f.prepare(messages=[{"role": "system", "content": [
            {"type": "text", "text": "x"}, {"type": "image", "image": b""}]}])
    text_only = Engine.open(max_concurrency=1, max_seq_len=128, verify_weights=False)  # the demo
    try:
        with pytest.raises(RejectedError, match=r"messages\[0\]\.content\[0\]: this model "
                                                "takes no images or videos"):
            text_only.generate(messages=ask(str(IMAGES / "grad_64x48.png")), sampling=GREEDY)
    finally:
        text_only.close()


def test_a_checkpoint_with_an_image_comes_back_from_the_host_tier():
    # one device checkpoint slot: the first turn's checkpoint is evicted to the host tier by
    # the next request, then reloaded for the follow-up (the store keys it by the image too)
    e = Engine.open(DIR, prefix_reuse=True, num_checkpoint_slots=1, host_cache_gb=0.05,
                    **SETTINGS)
    try:
        first = ask(str(IMAGES / "grad_64x48.png"))
        r1 = e.generate(messages=first, sampling=GREEDY)
        e.generate(messages=ask(str(IMAGES / "frame2_64x48.png"), "Something else."),
                   sampling=GREEDY)
        follow = first + [{"role": "assistant", "content": r1.text},
                          {"role": "user", "content": "And its colours?"}]
        r2 = e.generate(messages=follow, sampling=GREEDY)
        tiers = e.stats().tiers
        ref = engine(False).generate(messages=follow, sampling=GREEDY)
    finally:
        e.close()
    assert r2.token_ids == ref.token_ids
    prompt = engine(False).frontend.prepare(messages=first)
    assert r2.usage.cached_tokens > prompt.token_ids.index(379)
    assert tiers.reloads >= 1, tiers


def test_http_images_are_fetched_only_when_enabled_within_time_and_size():
    import http.server
    import threading
    import time

    from ninfer_jax.frontend import Frontend
    from ninfer_jax.frontend import media as media_module

    png = (IMAGES / "grad_64x48.png").read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/cat.png": png, "/big.png": b"x" * (media_module.MAX_MEDIA_BYTES + 1),
                    "/slow.png": png}.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.path == "/slow.png":
                time.sleep(1.5)
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        cfg = engine(False).core.program.cfg
        on = Frontend.load(DIR, cfg, media_fetch_timeout_s=1.0)
        fetched = on.prepare(messages=ask(f"{url}/cat.png"))
        local = on.prepare(messages=ask(png))
        assert fetched.identity == local.identity  # the digest of the same bytes
        for path, why in (("/big.png", "larger than"), ("/slow.png", "timed out|took over"),
                          ("/none.png", "HTTP Error 404")):
            with pytest.raises(PromptError, match=rf"messages\[0\]\.content\[0\]\.image: .*({why})"):
                on.prepare(messages=ask(url + path))
        with pytest.raises(PromptError, match=r"over http\(s\) is off"):
            engine(False).frontend.prepare(messages=ask(f"{url}/cat.png"))
    finally:
        server.shutdown()


def mp4_of(frames, rate: int) -> bytes:
    """An MPEG-4 video of the image files, `rate` frames a second (PyAV)."""
    import io

    import av
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=rate)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for path in frames:
            with Image.open(path) as image:
                frame = av.VideoFrame.from_ndarray(np.asarray(image.convert("RGB")),
                                                   format="rgb24")
            for packet in s.encode(frame):
                c.mux(packet)
        for packet in s.encode():
            c.mux(packet)
    return buf.getvalue()


def test_a_video_file_is_sampled_at_fps_with_its_timestamps(tmp_path):
    from ninfer_jax.frontend.media import decode_video
    from ninfer_jax.frontend.vision import process_video

    data = mp4_of([IMAGES / f"frame{i % 4}_64x48.png" for i in range(20)], rate=10)
    (tmp_path / "clip.mp4").write_bytes(data)
    f = engine(False).frontend
    p = f.prepare(messages=[{"role": "user", "content": [
        {"type": "video", "video": str(tmp_path / "clip.mp4")},
        {"type": "text", "text": "What happens?"}]}])
    frames, indices, rate = decode_video(data, "v", 2.0)
    assert indices == [0, 6, 13, 19] and rate == 10.0  # 2 s of video at 2 frames a second
    want = process_video(frames, f.vision.processor)
    assert (p.media[0].patches == want.patches).all()
    assert p.media[0].grid == want.grid == (2, 6, 8)
    text = f.tokenizer.decode(list(p.token_ids))
    assert "<0.3 seconds>" in text and "<1.6 seconds>" in text  # (0 + 0.6) / 2, (1.3 + 1.9) / 2
    r = engine(False).generate(messages=[{"role": "user", "content": [
        {"type": "video", "video": data}, {"type": "text", "text": "What happens?"}]}],
        sampling=GREEDY)
    assert r.usage.prompt_tokens == len(p.token_ids) and r.error is None
    with pytest.raises(PromptError, match=r"messages\[0\]\.content\[0\]\.video: not a "
                                          r"readable video"):
        f.prepare(messages=[{"role": "user", "content": [
            {"type": "video", "video": data[: len(data) // 3]}]}])
