"""Worker: our Program, through its public API, on a model directory (the `program` suite).

setup args: path (HF checkpoint dir, loaded with `load_model`), max_batch, prompt_len,
max_new_tokens (per decode sequence), prefill_len, prefill_chunk, page_size, and optionally
quantize ("int8" | "int4": `load_model(quantize=)`). Two Programs are
built: one for decode (exact-B executables for B = 1..max_batch, prefill chunk = prompt_len, so
a decode prompt is one chunk) and one for the prefill measurement (B = 1, prefill_chunk).

Measurements (prepare args):
- {"kind": "decode", "prompts": [[ids] * B], "steps": n}: prepare admits the B prompts and
  prefills them (untimed; returns each row's first token); a repetition is `steps` rounds of
  `decode` + `commit` on all B rows; outputs the tokens of the rep, [B][steps].
- {"kind": "prefill", "prompt": [ids]}: a repetition admits the prompt, prefills it chunk by
  chunk to its first token (commit included) and releases it; outputs that token.
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


def _admit(prog, prompt: list[int], max_new: int):
    return prog.materialize(prog.plan_admission(len(prompt), max_new), prompt)


def _prefill(prog, handle) -> None:
    while (batch := prog.prefill(handle)) is None:
        pass
    prog.commit(batch, [1])


class ProgramJax(BenchWorker):
    def setup(self, args: dict) -> dict:
        import jax

        from ninfer_jax import quant
        from ninfer_jax.compile_cache import enable_persistent_cache
        from ninfer_jax.loader import load_model
        from ninfer_jax.program.config import ProgramConfig
        from ninfer_jax.program.program import Program

        enable_persistent_cache()
        start = time.perf_counter()
        model = load_model(args["path"], verify=False, quantize=args.get("quantize"))
        load_s = time.perf_counter() - start
        ps = args["page_size"]
        per_seq = -(-(args["prompt_len"] + args["max_new_tokens"]) // ps)
        decode_cfg = ProgramConfig(
            max_concurrency=args["max_batch"], page_size=ps, num_pages=per_seq * args["max_batch"],
            max_seq_len=per_seq * ps, prefill_chunk=args["prompt_len"],
            layer_loop=args["layer_loop"])
        start = time.perf_counter()
        self.decode_prog = Program(model.config, model.params, decode_cfg)
        self.decode_prog.wait_compiled()  # every exact B, not only what start-up waits for
        decode_compile_s = time.perf_counter() - start
        per_prompt = -(-(args["prefill_len"] + 1) // ps)
        prefill_cfg = ProgramConfig(max_concurrency=1, page_size=ps, num_pages=per_prompt,
                                    max_seq_len=per_prompt * ps,
                                    prefill_chunk=args["prefill_chunk"],
                                    layer_loop=args["layer_loop"])
        start = time.perf_counter()
        self.prefill_prog = Program(model.config, model.params, prefill_cfg)
        self.max_new = args["max_new_tokens"]
        return {"load_s": load_s, "decode_compile_s": decode_compile_s,
                "decode_weight_bytes": quant.decode_weight_bytes(model.params, model.config),
                "prefill_compile_s": time.perf_counter() - start,
                "jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}

    def prepare(self, name: str, args: dict) -> list[int] | None:
        self.args = args
        if args["kind"] != "decode":
            return None
        prog = self.decode_prog
        self.handles = [_admit(prog, p, self.max_new) for p in args["prompts"]]
        for h in self.handles:
            _prefill(prog, h)
        return [prog.tokens(h)[-1] for h in self.handles]

    def rep(self, name: str) -> dict:
        if self.args["kind"] == "decode":
            prog, handles, steps = self.decode_prog, self.handles, self.args["steps"]

            def rounds() -> None:
                for _ in range(steps):
                    prog.commit(prog.decode(handles), [1] * len(handles))

            r = timed(rounds, work=steps * len(handles))
            r["outputs"] = [prog.tokens(h)[-steps:] for h in handles]
            return r
        prog, prompt = self.prefill_prog, self.args["prompt"]

        def once() -> int:
            handle = _admit(prog, prompt, 1)
            _prefill(prog, handle)
            token = prog.tokens(handle)[-1]
            prog.release(handle)
            return token

        return timed(once, work=len(prompt))

    def finish(self, name: str) -> None:
        if self.args["kind"] == "decode":
            for h in self.handles:
                self.decode_prog.release(h)


if __name__ == "__main__":
    serve(ProgramJax())
