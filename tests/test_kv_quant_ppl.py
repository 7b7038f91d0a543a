"""`scripts/kv_quant_ppl.py` on a few windows of held-out TinyStories: the paged path with float
pages is the plain causal forward's perplexity, int8 pages stay within the script's 0.5%, and
the command prints its table and passes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from scripts import kv_quant_ppl as ppl

pytestmark = pytest.mark.slow  # ~60 s: five scoring executables over the demo model


def test_float_pages_score_as_the_causal_forward_and_int8_pages_stay_close(capsys):
    from ninfer_jax.frontend import load_tokenizer
    from ninfer_jax.loader import load_model

    demo = load_model()
    data = ppl.windows(ppl.TEXTS["tinystories"].read_text(encoding="utf-8"),
                       load_tokenizer(demo.path), 128, 3)
    params = jax.tree.map(jnp.asarray, demo.params)
    causal, _ = ppl.perplexity(ppl.causal_scorer(demo.config, 128), params, data)
    for path in ("prefill", "decode"):
        paged, _ = ppl.perplexity(ppl.paged_scorer(demo.config, "float32", "auto", path, 128),
                                  params, data)
        assert paged == pytest.approx(causal, rel=1e-5), path
        int8, _ = ppl.perplexity(ppl.paged_scorer(demo.config, "float32", "int8", path, 128),
                                 params, data)
        assert int8 != paged and abs(int8 / paged - 1) < ppl.LIMIT, path
    assert ppl.main(["--windows=2", "--length=128", "--paths=prefill", "--dtypes=float32"]) == 0
    out = capsys.readouterr().out
    assert "| float32 | prefill | int8 |" in out and "| float32 | causal |" in out
