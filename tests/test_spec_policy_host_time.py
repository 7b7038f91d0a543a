"""scripts/spec_policy_host_time.py runs and prints a time for every call it names."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_it_times_each_call_of_the_policy():
    out = subprocess.run([sys.executable, "scripts/spec_policy_host_time.py", "--repeats=1",
                          "--ks=0,1,3"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for call in ("choice scored afresh", "choose, a choice of 0 standing", "round_done",
                 "dispatched", "stats"):
        row = next(line for line in lines if line.startswith(call))
        assert float(row.split()[-1]) > 0.0


def test_a_baseline_without_the_policy_is_a_usage_error(tmp_path):
    out = subprocess.run([sys.executable, "scripts/spec_policy_host_time.py",
                          f"--baseline={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "no ninfer_jax/engine/spec_policy.py" in out.stderr
