"""`tool_calls.parse_call` and `parse`: a call is read back only when it follows the template's
format exactly (every tag closed, nothing between parameters); anything else stays content."""

from __future__ import annotations

import pytest

from ninfer_jax.frontend.tool_calls import ToolCallStream, parse, parse_call

SCHEMAS = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "units": {"type": ["string"]}}}


def test_a_well_formed_call_reads_values_by_the_schema():
    call = parse_call("\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
                      "<parameter=days>\n3\n</parameter>\n<parameter=units>\nC\n</parameter>\n"
                      "</function>\n", SCHEMAS)
    assert call is not None and call.name == "get_weather"
    # A string parameter stays text even when it parses as JSON; others are read as JSON.
    assert call.arguments == {"city": "42", "days": 3, "units": "C"}
    assert call.arguments_json == '{"city": "42", "days": 3, "units": "C"}'


def test_unknown_functions_and_parameters_are_calls_read_as_json_when_they_parse():
    call = parse_call("<function=other>\n<parameter=x>\n[1, 2]\n</parameter>\n"
                      "<parameter=y>\nnot json\n</parameter>\n</function>", SCHEMAS)
    assert call is not None and call.name == "other"
    assert call.arguments == {"x": [1, 2], "y": "not json"}
    assert parse_call("<function=noargs>\n</function>", SCHEMAS).arguments == {}


@pytest.mark.parametrize("body", [
    # Each parameter closed, the function not: the call never ended.
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    # The function closed, a parameter not.
    "<function=get_weather>\n<parameter=city>\nParis\n</function>",
    # Text between or after parameters, or before the function.
    "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\nand then\n</function>",
    "<function=get_weather>\nhello\n<parameter=city>\nParis\n</parameter>\n</function>",
    "sure: <function=get_weather>\n</function>",
    # No name, a name across lines, text after the function.
    "<function=>\n</function>",
    "<function= \n>\n</function>",
    "<function=get_weather>\n</function>\ntrailing",
    "",
])
def test_malformed_calls_are_not_calls(body):
    assert parse_call(body, SCHEMAS) is None


def test_a_malformed_call_comes_back_whole_as_content_and_a_good_one_after_it_is_read():
    bad = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
    good = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    content, calls = parse(f"Let me check.\n{bad}\n{good}", [
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": SCHEMAS["get_weather"]}}}])
    assert content == f"Let me check.{bad}"
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"days": 2})]


def test_the_stream_releases_the_same_as_the_whole_parse_at_any_split():
    text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>\n")
    whole = parse(text, None)
    for cut in range(len(text) + 1):
        stream = ToolCallStream(None)
        pieces = stream.feed(text[:cut]) + stream.feed(text[cut:]) + stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        calls = [(c.name, c.arguments) for c in pieces if not isinstance(c, str)]
        assert (content, calls) == (whole[0], [(c.name, c.arguments) for c in whole[1]]), cut


def _forced_matcher(schema):
    from ninfer_jax.frontend.grammar import GrammarCompiler
    from ninfer_jax.frontend.tool_calls import call_grammar
    from ninfer_jax.sampling_params import StructuredOutput
    from ninfer_jax.testing import ByteTokenizer

    tok = ByteTokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": schema}, "required": ["n"]}}}]
    grammar = StructuredOutput("grammar", call_grammar(tools, "f", tok.special_tokens))
    matcher = GrammarCompiler(tok).matcher(grammar)
    assert matcher.advance(tok.encode("<tool_call>\n<function=f>\n<parameter=n>\n"))
    return tok, matcher


def _accepted(tok, matcher, text: str) -> int:
    """How many characters of `text` the matcher takes before its mask refuses one."""
    from ninfer_jax.frontend.grammar import allowed_ids

    for n, ch in enumerate(text):
        (token,) = tok.encode(ch)
        if token not in set(allowed_ids(matcher.mask()).tolist()):
            return n
        assert matcher.advance([token])
    return len(text)


@pytest.mark.parametrize(("schema", "runaway", "longest"), [
    ({"type": "integer"}, "-" + "3" * 40, 20),  # int64: a sign and 19 digits
    ({"type": ["integer", "null"]}, "9" * 40, 18),  # 999... past 2**63 - 1024 after 18
    ({"type": "number"}, "-0." + "3" * 40, 19),  # 16 digits after the point
    ({"type": "number"}, "1" * 40, 16),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": ' + "3" * 40, 25),
])
def test_a_forced_calls_numbers_end_so_the_call_closes(schema, runaway, longest):
    """A model that repeats a digit inside a forced call's number is stopped at int64 (or a
    double's digits) and the call then closes and parses: numbers are bounded in the grammar."""
    tok, matcher = _forced_matcher(schema)
    assert _accepted(tok, matcher, runaway) == longest
    rest = ("}" if runaway.startswith("{") else "") + "\n</parameter>\n</function>\n</tool_call>"
    assert _accepted(tok, matcher, rest) == len(rest) and matcher.is_accepting
