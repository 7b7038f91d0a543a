"""Files named by command-line flags, and the records of JSONL batch inputs.

Owns turning every way a file can be wrong into an error that names the flag and the path:
missing, a directory, unreadable, not UTF-8, not JSON, not writable, a full disk. A whole-file
failure is a `CommandError` (the command stops); one bad line of a JSONL input is a
`RecordError` (the batch job writes an error line for it and goes on). Inputs are read as bytes
and decoded line by line, so one line of invalid UTF-8 spoils only its own record. Strings that
JSON escapes can smuggle in (a lone surrogate such as "\\ud800") are refused where they are read,
since no tokenizer can encode them.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from ninfer_jax.errors import NinferError


class CommandError(NinferError):
    """A command cannot go on: a file named by a flag is missing, unreadable, malformed or not
    writable. The message names the flag and the path."""


class RecordError(ValueError):
    """One input record is bad; the message says why (the job goes on)."""


def os_reason(e: OSError) -> str:
    """`e` in words, without the errno prefix: "No such file or directory"."""
    return e.strerror or str(e)


def _fail(flag: str, path: str | os.PathLike, what: str) -> CommandError:
    return CommandError(f"--{flag} {str(path)!r}: {what}")


def _read_bytes(flag: str, path: str | os.PathLike) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise _fail(flag, path, f"cannot read: {os_reason(e)}") from None


def check_unicode(value: Any, field: str) -> None:
    """Refuses a lone surrogate in any string (or key) inside `value`; RecordError names where.
    Iterative, so a deeply nested value cannot exhaust the stack."""
    stack = [(value, field)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RecordError(f"{where} holds a lone surrogate {item[e.start]!r} at "
                                  f"character {e.start}; not valid Unicode") from None
        elif isinstance(item, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(item))
        elif isinstance(item, dict):
            for key, x in item.items():
                stack.append((key, f"{where} key {key!r}"))
                stack.append((x, f"{where}.{key}"))


def decode_utf8(data: bytes, what: str, error: type[Exception]) -> str:
    """`data` as strict UTF-8, or `error` naming the first bad byte's offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} is not UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                    f"({e.reason})") from None


def read_text(flag: str, path: str | os.PathLike) -> str:
    """The whole file as UTF-8 text; CommandError naming the flag otherwise."""
    return decode_utf8(_read_bytes(flag, path), f"--{flag} {str(path)!r}", CommandError)


def read_json(flag: str, path: str | os.PathLike) -> Any:
    """The file's JSON value (every string valid Unicode); CommandError naming the flag."""
    text = read_text(flag, path)
    try:
        value = json.loads(text)
        check_unicode(value, "the document")
    except (ValueError, RecursionError) as e:  # JSONDecodeError, RecordError, deep nesting
        raise _fail(flag, path, f"not valid JSON: {e}") from None
    return value


def _open_lines(flag: str, path: str | os.PathLike):
    try:
        return open(path, "rb")
    except OSError as e:
        raise _fail(flag, path, f"cannot read: {os_reason(e)}") from None


def iter_lines(flag: str, path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """(index, line) for every line of the file, as bytes without the line end. Lines end at
    b"\\n" only; a last line without one counts. The file is opened at once, so a missing or
    unreadable one fails here rather than at the first line."""
    return _lines(flag, path, _open_lines(flag, path))


def _lines(flag: str, path: str | os.PathLike, file) -> Iterator[tuple[int, bytes]]:
    with file as f:
        try:
            for index, line in enumerate(f):
                yield index, line.rstrip(b"\n").rstrip(b"\r")
        except OSError as e:
            raise _fail(flag, path, f"cannot read: {os_reason(e)}") from None


def digest_lines(flag: str, path: str | os.PathLike) -> tuple[str, int]:
    """(sha256 of the file's bytes, its number of lines as `iter_lines` counts them)."""
    h, count = hashlib.sha256(), 0
    with _open_lines(flag, path) as f:
        try:
            for count, line in enumerate(f, 1):
                h.update(line)
        except OSError as e:
            raise _fail(flag, path, f"cannot read: {os_reason(e)}") from None
    return h.hexdigest(), count


def parse_record(line: bytes) -> dict[str, Any]:
    """One JSONL line as a JSON object; RecordError when it is not UTF-8, not JSON or not an
    object. String values are checked by the caller (`check_unicode`) for the fields it uses."""
    text = decode_utf8(line, "the line", RecordError)
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"not JSON: {e}") from None
    except RecursionError:
        raise RecordError("not JSON: nested too deeply") from None
    if not isinstance(record, dict):
        raise RecordError("a record must be a JSON object")
    return record


def write_atomic(flag: str, path: str | os.PathLike, data: bytes) -> None:
    """Writes `path` whole or not at all: a temp file beside it, fsynced, renamed over it, and
    the directory fsynced. CommandError naming the flag when it cannot be written."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise _fail(flag, path, f"cannot write: {os_reason(e)}") from None
