"""scripts/profile_scoring_call.py: one scoring call's wall time split among the compiled
operations that ran, concurrent ones sharing each instant."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from scripts.profile_scoring_call import _hlo_names, _wall_shares


def test_concurrent_operations_share_each_instant():
    events = [{"name": "a", "ts": 0, "dur": 10}, {"name": "b", "ts": 5, "dur": 10},
              {"name": "c", "ts": 20, "dur": 4}]
    shares = _wall_shares(events, lambda e: e["name"])
    assert shares == {"a": 7.5, "b": 7.5, "c": 4.0}  # 19 us of wall time, the gap unclaimed


def test_hlo_names_give_shape_and_op():
    text = ('ENTRY %main.1 (p.1: f32[4096,64], w.2: f32[1024,64]) -> f32[8] {\n'
            '  %ynn_fusion.3 = f32[4096,1024]{1,0} fusion(%p.1, %w.2), kind=kCustom, '
            'metadata={op_name="jit(f)/while/body/...i,oi->...o/dot_general"}\n'
            '  ROOT %add.1 = f32[8]{0} add(%x, %y)\n}\n')
    assert _hlo_names(text) == {"ynn_fusion.3": ("f32[4096,1024]{1,0}", "dot_general"),
                                "add.1": ("f32[8]{0}", "add")}


@pytest.mark.slow  # ~30 s: a profiling script's run; its parsers are tested above
def test_a_tiny_call_is_split_into_weight_matmuls_and_the_rest():
    done = subprocess.run([sys.executable, "-m", "scripts.profile_scoring_call", "tiny",
                           "--rows=2", "--length=64", "--top=3"],
                          capture_output=True, text=True, timeout=600, check=True)
    shares = dict(re.findall(r"^  (weight matmuls|rest)\s+[\d.]+ ms\s+([\d.]+)%$", done.stdout,
                             re.MULTILINE))
    assert set(shares) == {"weight matmuls", "rest"}, done.stdout
    assert abs(sum(float(v) for v in shares.values()) - 100.0) < 0.2
    assert re.search(r"one call of 2 x 64 tokens in [\d.]+ ms", done.stdout)
    # the top operations' lines: ms, calls, then the shape (an array's, or a while loop's
    # tuple: which of them are the top three changes with the run's timings)
    assert len(re.findall(r"^\s+[\d.]+\s+\d+  (?:\w+\[|\()", done.stdout, re.MULTILINE)) == 3, \
        done.stdout
