"""The Frontend stays host-only: no module under ninfer_jax/frontend imports jax."""

from __future__ import annotations

import ast
import pathlib

import ninfer_jax.frontend


def test_no_module_imports_jax():
    package = pathlib.Path(ninfer_jax.frontend.__file__).parent
    modules = sorted(package.glob("*.py"))
    assert len(modules) >= 8
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "jax" or n.startswith("jax.") for n in names), path.name
