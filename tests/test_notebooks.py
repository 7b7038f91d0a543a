"""The example notebooks (`examples/*.ipynb`) run end to end in a real Jupyter kernel (nbclient),
and the committed files carry no outputs. A cell that raises fails the test with its
traceback."""

from __future__ import annotations

import pathlib

import pytest

from tests.conftest import REPO

EXAMPLES = REPO / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def test_the_four_notebooks_are_there():
    assert [p.stem for p in NOTEBOOKS] == ["prefix_reuse", "quickstart", "scoring", "speculative"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_have_no_outputs(path: pathlib.Path):
    import nbformat

    book = nbformat.read(path, as_version=4)
    nbformat.validate(book)
    for cell in book.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (path.name, cell.id)


# 35 s to a minute each cold: run by scripts/test_slow.sh (the default run checks they are there
# and hold no outputs; the API they call is tested by the engine and scoring tests)
_SLOW_BOOKS = {"quickstart", "scoring", "speculative", "prefix_reuse"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.stem in _SLOW_BOOKS
                                  else p for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path: pathlib.Path, tmp_path, monkeypatch):
    """From a directory outside the repository, with no development data beside it (#41: the
    scoring notebook read ../shared/data)."""
    import nbformat
    from nbclient import NotebookClient

    book = nbformat.read(path, as_version=4)
    monkeypatch.delenv("NINFER_SHARED_DATA", raising=False)
    NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
