"""Worker: our vision path on a vision-language model directory (the `vision` suite).

setup args: path (an HF vision-language checkpoint with its processor settings and frontend),
max_vision_patches. Loads it with `load_model` and `Frontend.load`, and builds one Program
(max_concurrency 1) whose executables, the vision encoder's buckets included, are compiled
before any measurement.

Measurements (prepare args):
- {"kind": "encode", "image": PATH}: a repetition preprocesses the decoded image (Pillow) and
  runs the vision encoder; outputs the embeddings' sum and shape.
- {"kind": "ttft", "image": PATH, "text": TEXT}: a repetition prepares the chat prompt (the
  image preprocessed, the placeholders expanded), admits it, runs the encoder and the staged
  prefill to the first token, and releases it; outputs that token and the prompt length.
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


def _image(path: str):
    from PIL import Image

    with Image.open(path) as f:
        f.load()
        return f.copy()


class VisionJax(BenchWorker):
    def setup(self, args: dict) -> dict:
        import jax

        from ninfer_jax.compile_cache import enable_persistent_cache
        from ninfer_jax.frontend import Frontend
        from ninfer_jax.loader import load_model
        from ninfer_jax.program.config import ProgramConfig
        from ninfer_jax.program.program import Program

        enable_persistent_cache()
        start = time.perf_counter()
        model = load_model(args["path"], verify=False)
        self.frontend = Frontend.load(args["path"], model.config)
        pcfg = ProgramConfig(max_concurrency=1, page_size=16, num_pages=64, max_seq_len=1024,
                             prefill_chunk=256, max_vision_patches=args["max_vision_patches"])
        self.prog = Program(model.config, model.params, pcfg)
        self.prog.wait_compiled()
        return {"setup_s": time.perf_counter() - start, "jax": jax.__version__,
                "buckets": list(pcfg.vision_buckets)}

    def prepare(self, name: str, args: dict) -> None:
        from ninfer_jax.frontend.vision import process_image

        self.args = args
        self.image = _image(args["image"])
        self.process = process_image

    def rep(self, name: str) -> dict:
        prog, args = self.prog, self.args
        if args["kind"] == "encode":
            cfg = self.frontend.vision.processor

            def once():
                embeds = prog.encode_media([self.process(self.image, cfg, "x")])
                return {"sum": float(embeds.sum()), "shape": list(embeds.shape)}

            return timed(once, work=1)
        messages = [{"role": "user", "content": [{"type": "image", "image": self.image},
                                                 {"type": "text", "text": args["text"]}]}]

        def first_token():
            p = self.frontend.prepare(messages=messages, enable_thinking=False)
            h = prog.materialize(prog.plan_admission(len(p.token_ids), 1), p.token_ids,
                                 media=p.media)
            while (batch := prog.prefill(h)) is None:
                pass
            prog.commit(batch, [1])
            token = prog.tokens(h)[-1]
            prog.release(h)
            return {"token": int(token), "prompt_tokens": len(p.token_ids)}

        return timed(first_token, work=1)


if __name__ == "__main__":
    serve(VisionJax())
