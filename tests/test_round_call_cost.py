"""scripts/round_call_cost.py runs and prints, for each round it compares, both calls."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_it_times_each_round_with_what_it_reads_and_with_everything():
    out = subprocess.run([sys.executable, "scripts/round_call_cost.py", "--method=mtp",
                          "--batch=1", "--reps=1", "--calls=2"], cwd=REPO, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if "leaves" in line]
    assert len(rows) == 6, out.stdout
    for read, every in zip(rows[::2], rows[1::2]):  # fewer leaves passed: params, then pools
        i, j = read.index("leaves"), every.index("leaves")
        assert int(read[i - 3]) <= int(every[j - 3]) and int(read[i - 1]) < int(every[j - 1])
    assert "bare 0, what it reads" in out.stdout
