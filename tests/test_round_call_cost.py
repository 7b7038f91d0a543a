"""scripts/round_call_cost.py runs and prints, for each round it compares, both calls."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_it_times_each_round_with_the_params_it_reads_and_with_every_param():
    out = subprocess.run([sys.executable, "scripts/round_call_cost.py", "--method=mtp",
                          "--batch=1", "--reps=1", "--calls=2"], cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if "leaves" in line]
    assert len(rows) == 6, out.stdout
    for read, every in zip(rows[::2], rows[1::2]):  # fewer leaves passed, never more
        assert int(read[read.index("leaves") - 1]) <= int(every[every.index("leaves") - 1])
    assert "bare 0, the params it reads" in out.stdout
