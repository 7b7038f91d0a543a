"""Progress bars for long operations (compile, convert, score), notebook-aware.

Owns the one rule for when a bar shows: `progress=True` always, `False` never, `None` (the
default of every API that takes it) only inside a Jupyter kernel and only for an operation that
lasts more than a second, so scripts, servers and tests stay quiet unless asked. In a notebook
the bar is tqdm's widget (`tqdm.auto`); where ipywidgets is missing it falls back to tqdm's text
bar instead of failing.
"""

from __future__ import annotations

import sys
from typing import Any


def in_notebook() -> bool:
    """True inside a Jupyter (ipykernel) kernel."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def enabled(progress: bool | None) -> bool:
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, got {progress!r:.40}")
    return in_notebook() if progress is None else progress


AUTO_DELAY_S = 1.0  # progress=None: a bar appears only for an operation that lasts longer


def bar(progress: bool | None, total: int, desc: str, unit: str = "it") -> Any:
    """A tqdm bar (a disabled one when `progress` says no); use it as a context manager. With
    progress=None it shows only once the operation has run AUTO_DELAY_S, so quick calls in a
    notebook leave no bar behind."""
    from tqdm import std

    if not enabled(progress):
        return std.tqdm(total=total, disable=True)
    delay = AUTO_DELAY_S if progress is None else 0.0
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, delay=delay)
    except ImportError:  # tqdm.notebook without ipywidgets
        return std.tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, delay=delay)
