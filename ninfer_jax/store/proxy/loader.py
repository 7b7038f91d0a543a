"""Stores by name: a registry of built-ins plus `module:Class` paths (seed §6.6).

`load_store(name_or_path)` returns a new, not yet set-up instance. A name containing ':' is an
import path; otherwise it is looked up in the registry (`cache`, `posix`, `redis`, and whatever
`register_store` added). Errors: unknown name -> InvalidParam listing the known names; a module
or class that cannot be found -> NotFound; a class that is not a Store -> InvalidParam; a
constructor that fails -> General.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib

from ninfer_jax.store.base import Store
from ninfer_jax.store.errors import General, InvalidParam, NotFound

_BUILTINS = {
    "cache": "ninfer_jax.store.memory:CacheStore",
    "posix": "ninfer_jax.store.posix:PosixStore",
    "redis": "ninfer_jax.store.redis_store:RedisStore",
}
_REGISTERED: dict[str, type[Store]] = {}


def register_store(name: str, cls: type[Store]) -> None:
    if name in _BUILTINS or name in _REGISTERED:
        raise InvalidParam(f"store name {name!r} is already registered")
    _REGISTERED[name] = cls


def known_stores() -> list[str]:
    return sorted({*_BUILTINS, *_REGISTERED})


def load_store(name_or_path: str) -> Store:
    if not isinstance(name_or_path, str) or not name_or_path:
        raise InvalidParam(f"store must be a registered name or 'module:Class', "
                           f"got {name_or_path!r}")
    if ":" in name_or_path:
        cls = _import_class(name_or_path)
    elif name_or_path in _REGISTERED:
        cls = _REGISTERED[name_or_path]
    elif name_or_path in _BUILTINS:
        cls = _import_class(_BUILTINS[name_or_path])
    else:
        raise InvalidParam(f"unknown store {name_or_path!r}; known: {known_stores()} "
                           "(or give a 'module:Class' path)")
    if not (isinstance(cls, type) and issubclass(cls, Store)):
        raise InvalidParam(f"{name_or_path!r} is not a Store subclass")
    try:
        return cls()
    except Exception as e:
        raise General(f"constructing store {name_or_path!r} failed: {e}") from e


def _import_class(path: str) -> type:
    module_name, _, class_name = path.partition(":")
    _check_defines(module_name, class_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise NotFound(f"store module {module_name!r} cannot be imported: {e}") from e
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise NotFound(f"store module {module_name!r} has no class {class_name!r}") from e


def _check_defines(module_name: str, class_name: str) -> None:
    """Refuses a path whose module's source does not bind `class_name` at its top level
    (a class, an import, an assignment), before importing it: a config naming the wrong module
    ('this:X') must not run that module's code."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError) as e:
        raise NotFound(f"store module {module_name!r} cannot be found: {e}") from None
    if spec is None:
        raise NotFound(f"store module {module_name!r} cannot be found")
    origin = spec.origin or ""
    if not origin.endswith(".py"):
        return  # compiled or namespace: nothing to read; the import decides
    try:
        tree = ast.parse(pathlib.Path(origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return  # let the import report it
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update(t.id for t in targets if isinstance(t, ast.Name))
    if class_name not in bound:
        raise NotFound(f"store module {module_name!r} has no class {class_name!r} (not "
                       "imported)")
