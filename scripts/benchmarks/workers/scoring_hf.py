"""Worker: transformers forward + log_softmax + gather on a model directory (the `scoring` suite).

setup args: path, rows. fp32, eval mode, `torch.inference_mode()`. A repetition scores the
requests as lm-evaluation-harness's HF backend does: longest first (its `Collator` order),
`rows` at a time right-padded to the batch's longest, each request's whole sequence in one
forward, `log_softmax` over the logits, the targets' log-probs gathered and `argmax == target`
as the greedy flags. Prepare args and outputs as `scoring_jax` (no fill).
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
        torch = self.torch
        seqs, firsts = args["seqs"], args["firsts"]
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        self.batches = []
        for k in range(0, len(order), self.rows):
            members = order[k : k + self.rows]
            width = max(len(seqs[i]) for i in members)
            ids = torch.zeros((len(members), width), dtype=torch.long)
            for row, i in enumerate(members):
                ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
            spans = [(i, firsts[i] - 1, len(seqs[i]) - 1) for i in members]
            self.batches.append((ids, spans))
        self.count = len(seqs)
        targets = sum(len(q) - f for q, f in zip(seqs, firsts))
        self.work = targets if args["unit"] == "tokens" else len(seqs)

    def _score(self, ids, spans):
        torch = self.torch
        logits = self.model(ids[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for row, (i, lo, hi) in enumerate(spans):
            targets = ids[row, lo + 1 : hi + 1]
            lp = torch.gather(logprobs[row, lo:hi], -1, targets[:, None])[:, 0]
            out.append((i, lp, logits[row, lo:hi].argmax(-1) == targets))
        return out

    def rep(self, name: str) -> dict:
        def score_all():
            with self.torch.inference_mode():
                return [x for ids, spans in self.batches for x in self._score(ids, spans)]

        r = timed(score_all, work=self.work)
        by_request = sorted(r["outputs"], key=lambda x: x[0])
        r["outputs"] = {"logprobs": self.torch.cat([lp for _, lp, _ in by_request]),
                        "is_greedy": self.torch.cat([g for _, _, g in by_request])}
        return r


if __name__ == "__main__":
    serve(ScoringHF())
