"""The incremental tool-call parser: the same text in any chunking gives the same text and calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.toolcalls import ToolCallParser, calls_from_json, normalise_tools

TEXTS = [
    'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n'
    '</tool_call>',
    'Here you go:\n```json\n{"name": "calc", "arguments": {"base": 10, "height": 5}}\n```\n',
    '[{"name": "f", "arguments": {"s": "é ü <tool_call>"}}, {"name": "g", "arguments": {}}]',
    "just text with a < and ``` inline code ``` and <tool no",
    "```python\nprint(1)\n```",
]


def text_and_calls(events) -> tuple[str, list[tuple[str, dict]]]:
    """The parser's events as (all text, [(name, arguments object), ...])."""
    calls = [(ev.call.name, json.loads(ev.call.arguments)) for ev in events if ev.call]
    return "".join(ev.text for ev in events), calls


def run(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    parser, events = ToolCallParser(), []
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    for a, b in zip(points, points[1:], strict=False):
        events += parser.feed(text[a:b])
    return text_and_calls(events + parser.finish())


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(range(len(TEXTS))), st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_chunking_gives_the_same_result(i, cuts):
    assert run(TEXTS[i], cuts) == run(TEXTS[i], [])


def test_expected_parses():
    assert run(TEXTS[0], []) == ("Sure. ", [("get_weather", {"city": "Paris"})])
    assert [c[0] for c in run(TEXTS[1], [])[1]] == ["a", "b"]
    assert run(TEXTS[2], [])[1] == [("calc", {"base": 10, "height": 5})]
    assert run(TEXTS[3], [])[1][0] == ("f", {"s": "é ü <tool_call>"})
    assert run(TEXTS[4], []) == (TEXTS[4], [])
    assert run(TEXTS[5], []) == (TEXTS[5], [])  # a code fence that is not a call stays text


def test_text_is_released_before_the_call_completes():
    parser = ToolCallParser()
    assert [e.text for e in parser.feed("Hello <tool")] == ["Hello "]
    assert parser.feed('_call>{"name": "f", "arguments": {}}') == []  # incomplete: nothing emitted
    events = parser.feed("</tool_call>")
    assert events[0].call.name == "f"


def test_calls_from_json_rejects_non_calls():
    assert calls_from_json({"foo": 1}) is None
    assert calls_from_json([{"name": "f", "arguments": "not json"}]) is None
    assert calls_from_json({"function": {"name": "f", "arguments": {"a": 1}}})[0].arguments == '{"a": 1}'


def test_normalise_bfcl_dict_type():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "dict", "properties": {
        "x": {"type": "dict", "properties": {}}}}}}]
    out = normalise_tools(tools)
    assert out[0]["function"]["parameters"]["type"] == "object"
    assert out[0]["function"]["parameters"]["properties"]["x"]["type"] == "object"


def test_in_structure_follows_the_committed_text():
    """The content kind the router keys its acceptance on: inside a call's JSON or not."""
    p = ToolCallParser()
    assert not p.in_structure
    p.feed("Let me look that up. <tool_call>")
    assert p.in_structure
    p.feed('{"name": "f", "arguments": {}}</tool_call>')
    assert not p.in_structure
    bare = ToolCallParser()
    bare.feed('{"name": "f"')
    assert bare.in_structure
    off = ToolCallParser(tools_enabled=False)
    off.feed("<tool_call>{")
    assert not off.in_structure


@pytest.mark.parametrize("chunks,inside", [
    (["Here it is:\n```", "json", "\n{", '"name"'], [True, True, True, True]),
    (["```", "\n", "[", "{"], [True, True, True, True]),
    (["```", "py", "thon\n", "def f():"], [True, False, False, False]),
    (["```", "js", "on5\n{"], [True, True, False]),
    (["```json\n", "Not JSON"], [True, False]),
    (["```", "\n", "def f():"], [True, True, False]),
])
def test_a_fence_is_structure_while_its_body_can_be_a_call(chunks, inside):
    """A fence counts as a call's JSON (the router's "tool" kind) while its body can still parse as one: a
    fence of code in an answer (a corrected file) is prose to the router, though held back until it closes."""
    p, seen, events = ToolCallParser(), [], []
    for c in chunks:
        events += p.feed(c)
        seen.append(p.in_structure)
    assert seen == inside
    events += p.feed("\n```") + p.finish()  # none parses as a call: all of it comes out as the text it was
    assert all(e.call is None for e in events)
    assert "".join(e.text for e in events) == "".join(chunks) + "\n```"
