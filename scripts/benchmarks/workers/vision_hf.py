"""Worker: transformers `Qwen3_5ForConditionalGeneration` on a vision-language model directory
(the `vision` suite).

setup args: path. fp32, eval mode, every call under `torch.inference_mode()`, torch's default
thread count; images through `Qwen2VLImageProcessorPil` with the directory's
`preprocessor_config.json` (the processor transformers picks without torchvision).

Measurements (prepare args, as `vision_jax`):
- encode: a repetition runs the image processor on the decoded image and
  `model.model.get_image_features`; outputs the embeddings' sum and shape.
- ttft: `ids` are the prompt our Frontend renders (the same tokens on both sides); a repetition
  runs the image processor and one forward over the prompt with the pixel values
  (`logits_to_keep=1`) and takes the greedy first token.
"""

from __future__ import annotations

import json
import pathlib
import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class VisionHF(BenchWorker):
    def setup(self, args: dict) -> dict:
        import torch
        import transformers
        from transformers import Qwen3_5ForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.torch = torch
        start = time.perf_counter()
        path = pathlib.Path(args["path"])
        self.model = Qwen3_5ForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32).eval()
        settings = json.loads((path / "preprocessor_config.json").read_text())
        settings.pop("image_processor_type", None)
        self.processor = Qwen2VLImageProcessorPil(**settings)
        return {"setup_s": time.perf_counter() - start, "torch": torch.__version__,
                "transformers": transformers.__version__, "threads": torch.get_num_threads()}

    def prepare(self, name: str, args: dict) -> None:
        from PIL import Image

        self.args = args
        with Image.open(args["image"]) as f:
            f.load()
            self.image = f.copy()

    def rep(self, name: str) -> dict:
        torch, model, args = self.torch, self.model, self.args
        if args["kind"] == "encode":
            def once():
                with torch.inference_mode():
                    r = self.processor(images=[self.image], return_tensors="pt")
                    out = model.model.get_image_features(r["pixel_values"],
                                                         r["image_grid_thw"])
                    embeds = torch.cat(out.pooler_output)
                return {"sum": float(embeds.sum()), "shape": list(embeds.shape)}

            return timed(once, work=1)
        cfg = model.config
        ids = torch.tensor([args["ids"]], dtype=torch.long)
        types = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()

        def first_token():
            with torch.inference_mode():
                r = self.processor(images=[self.image], return_tensors="pt")
                out = model(input_ids=ids, pixel_values=r["pixel_values"],
                            image_grid_thw=r["image_grid_thw"], mm_token_type_ids=types,
                            logits_to_keep=1)
            return {"token": int(out.logits[0, -1].argmax()), "prompt_tokens": ids.shape[1]}

        return timed(first_token, work=1)


if __name__ == "__main__":
    serve(VisionHF())
