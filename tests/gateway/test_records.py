"""Reading batch inputs: any line is a request or a RecordError naming why, never a crash; files
named by flags fail as a CommandError naming the flag; the job file is written whole or not."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_jax.gateway.files import (
    CommandError,
    RecordError,
    digest_lines,
    iter_lines,
    parse_record,
    read_json,
    write_atomic,
)
from ninfer_jax.gateway.generate import jsonl_request

# Text with every code point, lone surrogates included (JSON can escape them).
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=8)


def _no_surrogate(value) -> bool:
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, list):
        return all(map(_no_surrogate, value))
    if isinstance(value, dict):
        return all(_no_surrogate(k) and _no_surrogate(v) for k, v in value.items())
    return True


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_any_line_is_a_request_or_a_record_error(line):
    try:
        request = jsonl_request(line)
    except RecordError as e:
        assert str(e)
        return
    [(key, value)] = request.items()
    assert key in ("prompt", "messages") and _no_surrogate(value)
    assert isinstance(value, str if key == "prompt" else list)


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES)
def test_a_lone_surrogate_is_refused_where_it_is_used(value):
    line = json.dumps({"prompt": "x", "unused": value, "messages_": value}).encode()
    assert jsonl_request(line) == {"prompt": "x"}  # fields the job does not read do not count
    line = json.dumps({"messages": [value]}).encode()
    if _no_surrogate(value):
        assert jsonl_request(line) == {"messages": [value]}
    else:
        with pytest.raises(RecordError, match="lone surrogate"):
            jsonl_request(line)


def test_record_errors_name_the_reason():
    cases = {b"\xc3\x28": "not UTF-8: byte 0xc3 at offset 0", b"": "not JSON",
             b"[" * 100_000: "nested too deeply", b"[1]": "must be a JSON object",
             b'{"prompt": "\\udfff"}': "prompt holds a lone surrogate '\\udfff' at character 0",
             b'{"prompt": "a", "messages": []}': "exactly one of"}
    for line, reason in cases.items():
        with pytest.raises(RecordError) as e:
            jsonl_request(line)
        assert reason in str(e.value), (line[:20], str(e.value))
    assert parse_record(b'{"a": 1}\r') == {"a": 1}


def test_lines_are_bytes_split_at_newlines_and_counted_alike(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"a": 1}\r\n\xff\n\nlast')
    assert list(iter_lines("input", path)) == [(0, b'{"a": 1}'), (1, b"\xff"), (2, b""),
                                               (3, b"last")]
    assert digest_lines("input", path)[1] == 4
    with pytest.raises(CommandError, match="--input .*No such file"):
        iter_lines("input", tmp_path / "missing")  # at once, not at the first line


def test_whole_files_fail_naming_the_flag(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "escaped.json").write_text('["\\ud800"]')
    for name, reason in [("deep.json", "not valid JSON"), ("escaped.json", "lone surrogate"),
                         (".", "Is a directory")]:
        with pytest.raises(CommandError, match=f"--messages .*{reason}"):
            read_json("messages", tmp_path / name)


def test_write_atomic_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "job.json"
    write_atomic("output", path, b"first")
    write_atomic("output", path, b"second")
    assert path.read_bytes() == b"second" and sorted(tmp_path.iterdir()) == [path]
    with pytest.raises(CommandError, match="--output .*cannot write"):
        write_atomic("output", tmp_path / "missing" / "job.json", b"x")
