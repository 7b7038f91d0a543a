"""Worker: transformers `Qwen3_5ForCausalLM` on a model directory (the `program` suite).

setup args: path (the HF checkpoint the jax side loads too). fp32, eval mode, every call under
`torch.inference_mode()`, torch's default thread count. The same measurements as
`program_jax`:
- decode: prepare runs the B prompts through one forward with a fresh cache (`use_cache=True`,
  `logits_to_keep=1`, as `generate` prefills) and takes the greedy first token; a repetition is
  `steps` single-token forwards on that cache, each followed by the argmax (the loop `generate`
  runs, without its logits processors and stopping checks). Outputs [B][steps] tokens.
- prefill: one forward over the prompt with a fresh cache and `logits_to_keep=1`; outputs the
  greedy first token.
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class ProgramHF(BenchWorker):
    def setup(self, args: dict) -> dict:
        import torch
        import transformers
        from transformers import Qwen3_5ForCausalLM

        self.torch = torch
        start = time.perf_counter()
        self.model = Qwen3_5ForCausalLM.from_pretrained(args["path"], dtype=torch.float32).eval()
        return {"load_s": time.perf_counter() - start, "torch": torch.__version__,
                "transformers": transformers.__version__, "threads": torch.get_num_threads()}

    def prepare(self, name: str, args: dict) -> list[int] | None:
        self.args = args
        if args["kind"] != "decode":
            return None
        with self.torch.inference_mode():
            ids = self.torch.tensor(args["prompts"], dtype=self.torch.long)
            out = self.model(ids, use_cache=True, logits_to_keep=1)
            self.cache, self.next = out.cache, out.logits[:, -1].argmax(-1)
        return self.next.tolist()

    def rep(self, name: str) -> dict:
        torch, model = self.torch, self.model
        if self.args["kind"] == "decode":
            steps = self.args["steps"]

            def rounds():
                tokens = []
                with torch.inference_mode():
                    for _ in range(steps):
                        out = model(self.next[:, None], cache=self.cache, use_cache=True)
                        self.next = out.logits[:, -1].argmax(-1)
                        tokens.append(self.next)
                return torch.stack(tokens, 1)  # [B, steps]; sent as lists after the clock

            return timed(rounds, work=steps * len(self.args["prompts"]))
        ids = torch.tensor([self.args["prompt"]], dtype=torch.long)

        def once() -> int:
            with torch.inference_mode():
                return int(model(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())

        return timed(once, work=ids.shape[1])

    def finish(self, name: str) -> None:
        self.cache = self.next = None


if __name__ == "__main__":
    serve(ProgramHF())
