"""Reading the dict config a store, policy or routing strategy receives in `setup`.

A config is a plain `dict`; these helpers read one field with its type and bounds checked and
raise `InvalidParam` naming the owner and the field, so a typo never silently becomes a default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.store.errors import InvalidParam


def require_mapping(config: Any, owner: str) -> Mapping[str, Any]:
    if not isinstance(config, Mapping):
        raise InvalidParam(f"{owner}: config must be a dict, got {type(config).__name__}")
    return config


def get_int(
    config: Mapping[str, Any], key: str, owner: str, *, default: int | None = None,
    minimum: int | None = None,
) -> int:
    """Reads an integer field; missing without a default, wrong type or below `minimum` raise."""
    if key not in config:
        if default is None:
            raise InvalidParam(f"{owner}: config field {key!r} is required")
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(f"{owner}: config field {key!r} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidParam(f"{owner}: config field {key!r} must be >= {minimum}, got {value}")
    return value


def get_str(
    config: Mapping[str, Any], key: str, owner: str, *, default: str | None = None,
    choices: Sequence[str] | None = None,
) -> str:
    """Reads a string field; `choices` restricts it to a known set (listed in the error)."""
    if key not in config:
        if default is None:
            raise InvalidParam(f"{owner}: config field {key!r} is required")
        return default
    value = config[key]
    if not isinstance(value, str) or not value:
        raise InvalidParam(f"{owner}: config field {key!r} must be a non-empty str, got {value!r}")
    if choices is not None and value not in choices:
        raise InvalidParam(
            f"{owner}: config field {key!r} must be one of {sorted(choices)}, got {value!r}"
        )
    return value


def get_float(
    config: Mapping[str, Any], key: str, owner: str, *, default: float | None = None,
    above: float | None = None,
) -> float:
    """Reads a finite number (an int is accepted); it must be greater than `above` if given."""
    if key not in config:
        if default is None:
            raise InvalidParam(f"{owner}: config field {key!r} is required")
        return default
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidParam(f"{owner}: config field {key!r} must be a finite number, "
                           f"got {value!r}")
    if above is not None and value <= above:
        raise InvalidParam(f"{owner}: config field {key!r} must be > {above}, got {value}")
    return float(value)


def get_int_list(config: Mapping[str, Any], key: str, owner: str) -> list[int]:
    """Reads a required non-empty list of ints."""
    value = config.get(key)
    if (
        not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
    ):
        raise InvalidParam(f"{owner}: config field {key!r} must be a non-empty list of ints, "
                           f"got {value!r}")
    return list(value)


def reject_unknown(config: Mapping[str, Any], known: Sequence[str], owner: str) -> None:
    """Refuses fields this owner does not read, so a misspelt key is an error, not a default."""
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise InvalidParam(f"{owner}: unknown config field(s) {unknown}; known: {sorted(known)}")
