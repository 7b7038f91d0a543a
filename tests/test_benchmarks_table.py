"""BENCHMARKS.md is generated from results/*.json, and the committed copy is the generated one.

Every results file must be read (a file the generator cannot read is an error naming it), and
every row of every file must reach the table.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from scripts import benchmarks_table
from scripts.benchmarks_table import ResultsError, format_figure, read_result, render

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
REGENERATE = "python -m scripts.benchmarks_table"


def test_the_committed_benchmarks_md_is_the_generated_one():
    assert (REPO / "BENCHMARKS.md").read_text() == render(RESULTS), (
        f"BENCHMARKS.md is stale: run `{REGENERATE}` and commit it")


def test_the_command_writes_the_committed_file(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, "-m", "scripts.benchmarks_table", f"--out={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == (REPO / "BENCHMARKS.md").read_text()


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_is_read_and_every_row_is_in_the_table(path):
    result = read_result(path)
    assert result.rows
    text = render(RESULTS)
    section = text.split(f"\n## {result.suite}\n", 1)[1].split("\n## ", 1)[0]
    assert f"`results/{path.name}`" in section
    for row in result.rows:
        assert f"| {result.date} | {row.config.replace('|', chr(92) + '|')} |" in section
    data = json.loads(path.read_text())
    if "rows" in data:  # not a suite's own output: it says where its figures come from
        assert data.get("source") and data.get("suite") and data.get("date")
        assert len(data["rows"]) == len(result.rows)


def test_the_table_holds_every_row_once():
    text = render(RESULTS)
    table_rows = [line for line in text.splitlines() if line.startswith("| 20")]
    total = sum(len(read_result(p).rows) for p in RESULTS.glob("*.json"))
    assert len(table_rows) == total


def test_figures_read_as_recorded():
    assert format_figure(1051) == "1,051"
    assert format_figure(0.051) == "0.051"
    assert format_figure({"median": 1.07, "min": 0.9, "max": 1.1}) == "1.07 [0.90-1.10]"
    assert format_figure({"median": 3112, "min": 168, "max": 4203, "n": 5}) == "3,112 [168-4,203]"
    assert format_figure({"min": 39, "max": 57}) == "39-57"
    assert format_figure([0.85, 0.7]) == "0.85, 0.70"
    assert format_figure([45, {"min": 81, "max": 135}]) == "45, 81-135"
    assert format_figure(None) == "-"


def _write(folder: pathlib.Path, name: str, data) -> pathlib.Path:
    path = folder / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("name, data, says", [
    ("newsuite_2026-12-05.json", {"table": "printed"}, "no extractor for suite 'newsuite'"),
    ("nodate.json", {"suite": "x", "rows": [{"config": "c", "ours": 1}]}, "no suite and date"),
    ("x_2026-12-05.json", {"rows": [{"config": "c"}]}, "has no figure"),
    ("x_2026-12-05.json", {"rows": [{"config": "c", "ours": {"median": 1}}]}, "median/min/max"),
    ("x_2026-12-05.json", {"rows": [{"config": "c", "ours": "fast"}]}, "not a number"),
    ("x_2026-12-05.json", {"rows": []}, "no rows"),
    ("spec_policy_2026-12-05.json", {"settings": {}}, "KeyError"),
    ("x_2026-12-05.json", [1, 2], "not a JSON object"),
])
def test_a_file_it_cannot_read_is_an_error_naming_it(tmp_path, name, data, says):
    path = _write(tmp_path, name, data)
    with pytest.raises(ResultsError, match=name.replace(".", r"\.")) as e:
        read_result(path)
    assert says in str(e.value)
    with pytest.raises(ResultsError):  # and the whole table refuses to render without it
        render(tmp_path)


def test_a_broken_json_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "x_2026-12-05.json").write_text("{not json")
    with pytest.raises(ResultsError, match=r"x_2026-12-05\.json"):
        render(tmp_path)


def test_an_empty_results_folder_is_an_error(tmp_path):
    with pytest.raises(ResultsError, match="no results files"):
        render(tmp_path)


def test_suite_and_date_come_from_the_file_name_when_the_json_lacks_them(tmp_path):
    path = _write(tmp_path, "my_suite_2026-12-05_tag.json",
                  {"rows": [{"config": "a | b", "ours": 2.5, "unit": "s"}]})
    result = read_result(path)
    assert (result.suite, result.date) == ("my_suite", "2026-12-05")
    assert "| 2026-12-05 | a \\| b | 2.5 s | - | - |" in render(tmp_path)
    assert benchmarks_table.COMMAND in render(tmp_path)
