"""An idle Engine runs each compiled decode round once before requests need it
(`Program.warm_up_next`: an executable's first run is several times its steady time), and the
output is what an Engine that did not gives."""

from __future__ import annotations

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.sampling_params import SamplingParams
from tests.program.test_speculative_program import PCFG

# The speculative Program tests' settings (their executables come from the persistent cache)
SETTINGS = {k: v for k, v in PCFG.items() if k != "max_concurrency"}


@pytest.mark.slow  # ~30 s: two Engines of their own
def test_wait_compiled_returns_with_every_round_run_once():
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    prompts = ["Once upon a time", "Tom had a big red ball."]
    with Engine.open(max_concurrency=2, speculative="mtp", num_speculative_tokens=2,
                     **SETTINGS) as e:
        program = e.core.program
        e.wait_compiled()
        assert program.cold_rounds == 0 and not program.warm_up_next()
        got = [list(h.result().token_ids) for h in
               [e.submit(prompt=p, sampling=greedy) for p in prompts]]
    with Engine.open(max_concurrency=2, **SETTINGS) as off:
        want = [list(off.submit(prompt=p, sampling=greedy).result().token_ids)
                for p in prompts]
    assert got == want
