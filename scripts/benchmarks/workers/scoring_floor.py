"""Worker: the matmul floor of a scoring call (the `scoring` suite's rolling task).

setup args: path (HF checkpoint dir, loaded with `load_model`). Measurement (prepare args as
`scoring_jax`'s: {"seqs", "firsts", "unit": "tokens"}): a repetition applies every weight matrix
of the model and its head to as many rows as the task scores targets, one XLA dot after another
(`scripts.scoring_matmul_floor.matmul_chain`) and nothing else: no scoring call can do that
work faster on this machine.
"""

from __future__ import annotations

from scripts.benchmarks._worker import BenchWorker, serve, timed


class ScoringFloor(BenchWorker):
    def setup(self, args: dict) -> dict:
        import jax

        from ninfer_jax.host_memory import keep_freed_memory
        from ninfer_jax.loader import load_model

        keep_freed_memory()  # as our scoring calls have it
        self.params = load_model(args["path"], verify=False).params
        return {"jax": jax.__version__}

    def prepare(self, name: str, args: dict) -> None:
        from scripts.scoring_matmul_floor import matmul_chain

        self.tokens = sum(len(q) - f for q, f in zip(args["seqs"], args["firsts"]))
        self.chain, self.args, self.macs = matmul_chain(self.params, self.tokens)
        self.chain(*self.args).block_until_ready()  # compiled before the turns

    def rep(self, name: str) -> dict:
        r = timed(lambda: self.chain(*self.args).block_until_ready(), work=self.tokens)
        r["outputs"] = {"macs_per_token": self.macs}
        return r


if __name__ == "__main__":
    serve(ScoringFloor())
