"""Worker: transformers forward + log_softmax + gather on a model directory (the `scoring` suite).

setup args: path, rows. fp32, eval mode, `torch.inference_mode()`. A repetition scores the
sequences `rows` at a time as lm-evaluation-harness's HF backend does: logits of the whole
window, `log_softmax`, the target log-probs gathered, and `argmax == target` as the greedy
flags. Outputs as `scoring_jax`.
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class ScoringHF(BenchWorker):
    def setup(self, args: dict) -> dict:
        import torch
        import transformers
        from transformers import Qwen3_5ForCausalLM

        self.torch, self.rows = torch, args["rows"]
        start = time.perf_counter()
        self.model = Qwen3_5ForCausalLM.from_pretrained(args["path"], dtype=torch.float32).eval()
        return {"load_s": time.perf_counter() - start, "torch": torch.__version__,
                "transformers": transformers.__version__, "threads": torch.get_num_threads()}

    def prepare(self, name: str, args: dict) -> None:
        seqs = self.torch.tensor(args["seqs"], dtype=self.torch.long)
        self.batches = list(seqs.split(self.rows))
        self.num_targets = seqs.shape[0] * (seqs.shape[1] - 1)

    def _score(self, batch):
        torch = self.torch
        logits = self.model(batch[:, :-1]).logits.float()
        targets = batch[:, 1:]
        logprobs = torch.gather(torch.log_softmax(logits, dim=-1), -1, targets[..., None])
        return logprobs[..., 0], logits.argmax(-1) == targets

    def rep(self, name: str) -> dict:
        def score_all():
            with self.torch.inference_mode():
                return [self._score(b) for b in self.batches]

        r = timed(score_all, work=self.num_targets)
        r["outputs"] = {"logprobs": self.torch.cat([lp for lp, _ in r["outputs"]]),
                        "is_greedy": self.torch.cat([g for _, g in r["outputs"]])}
        return r


if __name__ == "__main__":
    serve(ScoringHF())
