"""scripts/mtp_bare_acceptance.py: the drafts after MTP bare rounds against the upkeep's, on the
embedded model (slow tier: it compiles an adaptive MTP Engine)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_short_run_reports_both_ways_with_equal_greedy_tokens():
    done = subprocess.run([sys.executable, "scripts/mtp_bare_acceptance.py", "--zeros=30",
                           "--drafting=6", "--prompts=2"],
                          capture_output=True, text=True, timeout=900, check=True)
    rows = re.findall(r"^  Z=  30 .* upkeep\s+([\d.]+)\s+bare\s+([\d.]+)$", done.stdout,
                      re.MULTILINE)
    assert len(rows) == 2, done.stdout
    assert all(1.0 <= float(x) <= 4.0 for row in rows for x in row)
    assert re.search(r"^Z=30: mean over prompts upkeep [\d.]+, bare [\d.]+$", done.stdout,
                     re.MULTILINE)
