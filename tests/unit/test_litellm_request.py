"""litellm call arguments → agentspec Request (pure: no litellm import, no sockets)."""

from __future__ import annotations

import httpx
import pytest

from agentspec.adapters.litellm_request import UnsupportedRequest, parse_request
from agentspec.toolcalls import tool_choice_instruction

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "calculator")]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def parse(params: dict, messages: list | None = None, api_base: str | None = "http://h:1/v1", timeout=None):
    return parse_request("tiny", messages or ASK, api_base, None, params, timeout)


def test_sampling_stop_limits_and_extras():
    r = parse({"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "END", "mode": "server",
               "num_draft_tokens": 6, "stream": True}, timeout=httpx.Timeout(2.0, connect=5.0))
    assert (r.max_tokens, r.stop, r.mode, r.num_draft_tokens, r.timeout_s) == (7, ("END",), "server", 6, 5.0)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed) == (0.5, 0.9, 3)
    assert r.urls == ("http://h:1",)  # an OpenAI-style /v1 suffix is dropped
    assert parse({}, api_base="http://a:1, http://b:2/").urls == ("http://a:1", "http://b:2")


def test_tool_choice():
    assert parse({"tools": TOOLS, "tool_choice": "none"}).tools is None
    assert parse({"tools": TOOLS, "tool_choice": "auto"}).tools == TOOLS
    req = parse({"tools": TOOLS, "tool_choice": "required"})
    assert req.tools == TOOLS and req.messages[0] == {"role": "system", "content": tool_choice_instruction("required")}
    named = parse({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "calculator"}}})
    assert [t["function"]["name"] for t in named.tools] == ["calculator"]
    assert named.messages[0]["content"].endswith("a call to the function calculator.")
    with pytest.raises(UnsupportedRequest):
        parse({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})


def test_messages_become_plain_dicts():
    class Message:  # stands in for litellm's pydantic Message
        def model_dump(self):
            return {"role": "assistant", "content": None, "function_call": None, "provider_specific_fields": None,
                    "tool_calls": [{"id": "c1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}

    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    msgs = parse({}, messages=[parts, Message()]).messages
    assert msgs[0] == {"role": "user", "content": "a\nb"}  # text parts joined as everywhere (toolcalls)
    assert msgs[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("params", [{"n": 2}, {"mode": "edge"}, {"mode": "api"}, {"max_tokens": 0},
                                    {"temperature": -1}, {"response_format": {"type": "xml"}},
                                    {"response_format": {"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "strnig"}}}}])
def test_refused(params):
    with pytest.raises(UnsupportedRequest):
        parse(params)


def test_response_format_is_passed_on_with_its_instruction():
    from pydantic import BaseModel

    class City(BaseModel):
        name: str

    req = parse({"response_format": City})
    assert req.response_format["type"] == "json_schema" and req.response_format["json_schema"]["name"] == "City"
    assert any("JSON" in m["content"] for m in req.messages)  # the instruction the model sees
    assert parse({"response_format": {"type": "text"}}).response_format is None
