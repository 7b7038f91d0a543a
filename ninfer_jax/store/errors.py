"""The store's error model: one exception type carrying a classified code (DESIGN §11, G15).

Errors and the prefetch signal travel on separate channels (G13): a lookup that wants a prefetch
returns `None`; only a failure raises. Every message names the offending id, field, limit or path.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Classification of a store failure."""

    INVALID_PARAM = "InvalidParam"  # protocol misuse or a bad argument/config field
    NOT_FOUND = "NotFound"  # an unknown block, job, request, name or entry point
    OS_API_ERROR = "OsApiError"  # an operating-system call failed
    NO_SPACE = "NoSpace"  # a fixed-capacity pool cannot place the batch
    GENERAL = "General"  # anything else


class StoreError(Exception):
    """A classified store failure; `code` says which kind, the message says what and where."""

    code: ErrorCode = ErrorCode.GENERAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class InvalidParam(StoreError):
    code = ErrorCode.INVALID_PARAM


class NotFound(StoreError):
    code = ErrorCode.NOT_FOUND


class OsApiError(StoreError):
    code = ErrorCode.OS_API_ERROR


class NoSpace(StoreError):
    code = ErrorCode.NO_SPACE


class General(StoreError):
    code = ErrorCode.GENERAL
