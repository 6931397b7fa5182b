"""ChatAgentSpec without a server: LangChain's standard unit tests, tool_choice forms, message conversion,
error mapping, and the event → chunk translation driven by a scripted SpecClient (network disabled)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelTimeoutError,
    OutputParserException,
)
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel

from agentspec.adapters import ChatAgentSpec
from agentspec.adapters.langchain_errors import ToolChoiceError, map_error
from agentspec.adapters.langchain_io import ToolChoice, parse_tool_choice, to_chat_messages
from agentspec.client import ClientStats, FinalEvent, PreviewEvent, SegmentStats, TextEvent, ToolCallEvent
from agentspec.toolcalls import add_instruction
from agentspec.transport import VerifierError, VerifierUnavailable

URL = "http://127.0.0.1:9"  # never contacted: construction does not connect
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("add", "mul")]


class TestChatAgentSpecStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "base_url": URL}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return {"AGENTSPEC_API_KEY": "secret-from-env"}, {"base_url": URL}, {"api_key": "secret-from-env"}


# -- scripted SpecClient -----------------------------------------------------------------------------


class ScriptedClient:
    """Stands in for SpecClient: records the call and yields a fixed list of events (or raises)."""

    def __init__(self, events: list[Any], error: BaseException | None = None) -> None:
        self.events, self.error, self.calls = events, error, []

    def stream(self, **kwargs: Any) -> Iterator[Any]:
        self.calls.append(kwargs)
        yield from self.events
        if self.error is not None:
            raise self.error

    async def astream(self, **kwargs: Any) -> AsyncIterator[Any]:
        for ev in self.stream(**kwargs):
            yield ev


def final(text: str, calls: list[ToolCallEvent] = ()) -> FinalEvent:
    stats = ClientStats([SegmentStats("edge", 5, 2, 6, 3, 0.1, 0.05, 0.01)])
    return FinalEvent(text, [5, 6, 7, 8, 9], list(calls), "tool_calls" if calls else "stop",
                      {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}, stats)


def scripted(monkeypatch, events: list[Any], error: BaseException | None = None) -> ScriptedClient:
    client = ScriptedClient(events, error)
    monkeypatch.setattr(ChatAgentSpec, "_client", lambda self: client)
    monkeypatch.setattr(ChatAgentSpec, "_aclient", lambda self: client)
    return client


CALL = ToolCallEvent(0, "call_abc", "add", '{"a": 1, "b": 2}')


def test_stream_chunks_carry_verified_events_usage_once_and_last_position(monkeypatch):
    scripted(monkeypatch, [TextEvent("Sure. "), PreviewEvent("UNVERIFIED"), CALL, final("Sure. ", [CALL])])
    chunks = list(ChatAgentSpec(model="tiny", base_url=URL).bind_tools(TOOLS).stream("hi"))
    assert "UNVERIFIED" not in "".join(c.text for c in chunks)
    assert [c.chunk_position for c in chunks][-1] == "last"
    assert sum(c.usage_metadata is not None for c in chunks) == 1
    assert [c.tool_call_chunks for c in chunks if c.tool_call_chunks] == [
        [{"name": "add", "args": '{"a": 1, "b": 2}', "id": "call_abc", "index": 0, "type": "tool_call_chunk"}]]
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert full.content == "Sure. "
    assert full.tool_calls == [{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_abc", "type": "tool_call"}]
    meta = full.response_metadata
    assert meta["model_name"] == "tiny" and meta["finish_reason"] == "tool_calls"
    assert meta["agentspec"]["modes"] == ["edge"] and meta["agentspec"]["mean_accepted_length"] == 2.5
    assert full.usage_metadata == {"input_tokens": 11, "output_tokens": 5, "total_tokens": 16}


async def test_invoke_and_ainvoke_aggregate_the_stream(monkeypatch):
    scripted(monkeypatch, [TextEvent("a"), TextEvent("b"), final("ab")])
    model = ChatAgentSpec(model="tiny", base_url=URL)
    for msg in (model.invoke("hi"), await model.ainvoke("hi")):
        assert isinstance(msg, AIMessage) and msg.content == "ab" and msg.usage_metadata["output_tokens"] == 5


def test_call_arguments_reach_the_client(monkeypatch):
    client = scripted(monkeypatch, [TextEvent("x"), final("x")])
    model = ChatAgentSpec(model="tiny", base_url=URL, temperature=0.7, seed=3, max_tokens=9, stop=["END"])
    model.invoke([SystemMessage("be brief"), HumanMessage("hi")], mode="server-ar")
    call = client.calls[-1]
    assert call["max_tokens"] == 9 and call["stop"] == ["END"] and call["mode"] == "server-ar"
    assert call["sampling"].temperature == 0.7 and call["sampling"].seed == 3
    assert call["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    model.invoke("hi", stop=["!"], max_tokens=3)
    assert client.calls[-1]["stop"] == ["!"] and client.calls[-1]["max_tokens"] == 3
    model.invoke("hi", frequency_penalty=1.0, logit_bias={5: -2.0}, logprobs=True, top_logprobs=2, top_k=4)
    s = client.calls[-1]["sampling"]
    assert (s.frequency_penalty, s.logit_bias, s.logprobs, s.top_k) == (1.0, ((5, -2.0),), 2, 4)
    with pytest.raises(TypeError, match="unsupported call arguments"):
        model.invoke("hi", repetition_penalty=1.1)
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        model.invoke("hi", top_logprobs=2)
    assert client.calls[-1]["model"] == "tiny"  # the configured name goes to the verifier, which checks it
    ChatAgentSpec(base_url=URL).invoke("hi")
    assert client.calls[-1]["model"] is None  # no name configured: the session uses the verifier's own
    model.invoke("hi", model="tiny-alias")  # an override goes to the verifier, which checks its served names
    assert client.calls[-1]["model"] == "tiny-alias"
    with pytest.raises(ValueError, match="non-empty string"):
        model.invoke("hi", model=3)


def test_tool_choice_none_hides_tools_and_required_adds_an_instruction(monkeypatch):
    client = scripted(monkeypatch, [CALL, final("", [CALL])])
    model = ChatAgentSpec(model="tiny", base_url=URL)
    model.bind_tools(TOOLS, tool_choice="none").invoke("hi")
    assert client.calls[-1]["tools"] is None
    msg = model.bind_tools(TOOLS, tool_choice="add").invoke([SystemMessage("sys"), HumanMessage("hi")])
    assert msg.tool_calls[0]["name"] == "add"
    sent = client.calls[-1]
    assert sent["tools"] == TOOLS and sent["messages"][0]["content"].startswith("sys\n\nYou must answer with a call")
    with pytest.raises(ToolChoiceError, match="'mul'"):
        model.bind_tools(TOOLS, tool_choice={"type": "function", "function": {"name": "mul"}}).invoke("hi")


def test_required_tool_call_missing_raises(monkeypatch):
    scripted(monkeypatch, [TextEvent("no"), final("no")])
    model = ChatAgentSpec(model="tiny", base_url=URL).bind_tools(TOOLS, tool_choice="any")
    with pytest.raises(ToolChoiceError) as info:
        model.invoke("hi")
    assert info.value.raw_text == "no" and not info.value.is_retryable


@pytest.mark.parametrize("choice, kind, name", [
    (None, "auto", None), ("auto", "auto", None), ("none", "none", None), ("any", "any", None),
    ("required", "any", None), (True, "any", None), ("mul", "named", "mul"),
    ({"type": "function", "function": {"name": "add"}}, "named", "add"),
])
def test_parse_tool_choice_forms(choice, kind, name):
    parsed = parse_tool_choice(choice, TOOLS)
    assert (parsed.kind, parsed.name, parsed.allowed) == (kind, name, ("add", "mul"))


@pytest.mark.parametrize("choice", ["nope", {"type": "function", "function": {}}, 3])
def test_parse_tool_choice_rejects(choice):
    with pytest.raises(ValueError):
        parse_tool_choice(choice, TOOLS)
    with pytest.raises(ValueError):
        ChatAgentSpec(model="tiny", base_url=URL).bind_tools(TOOLS, tool_choice=choice)


def test_tool_choice_check():
    two = [CALL, ToolCallEvent(1, "c2", "mul", "{}")]
    ToolChoice("any", allowed=("add",)).check([CALL], "")
    with pytest.raises(ToolChoiceError, match="one of"):
        ToolChoice("any", allowed=("add",)).check(two, "")  # a call to a tool that is not bound
    ToolChoice("named", "add").check([CALL], "")
    ToolChoice("auto").check([], "text")
    with pytest.raises(ToolChoiceError):
        ToolChoice("named", "add").check(two, "")
    with pytest.raises(ToolChoiceError):
        ToolChoice("auto", single=True).check(two, "")


def test_messages_convert_with_object_arguments_and_text_only():
    msgs = [HumanMessage("q", name="ann"),
            AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}]),
            ToolMessage("3", tool_call_id="c1")]
    out = to_chat_messages(msgs)
    assert out[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1}}
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "3"}
    assert to_chat_messages(msgs, dict_arguments=False)[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    v1 = AIMessage([{"type": "text", "text": "ok"}, {"type": "tool_call", "name": "add", "args": {"a": 1},
                                                        "id": "c1"}],
                   tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c1", "type": "tool_call"}],
                   response_metadata={"output_version": "v1"})
    assert to_chat_messages([v1])[0] == {**out[1], "content": "ok"}  # output_version="v1" content blocks
    image = HumanMessage([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(ValueError, match="text only"):
        to_chat_messages([image])
    assert add_instruction([{"role": "user", "content": "q"}], "I")[0] == {"role": "system", "content": "I"}


class Joke(BaseModel):
    setup: str
    punchline: str


@pytest.mark.parametrize("method", ["json_mode", "json_schema"])
def test_structured_output_parses_json_text(monkeypatch, method):
    client = scripted(monkeypatch, [TextEvent('```json\n{"setup": "s", "punchline": "p"}\n```'), final("")])
    model = ChatAgentSpec(model="tiny", base_url=URL)
    assert model.with_structured_output(Joke, method=method).invoke("joke") == Joke(setup="s", punchline="p")
    assert model.with_structured_output(Joke.model_json_schema(), method=method).invoke("joke") == {
        "setup": "s", "punchline": "p"}
    system = client.calls[-1]["messages"][0]
    assert system["role"] == "system" and "JSON" in system["content"]
    assert client.calls[-1]["tools"] is None
    if method == "json_schema":
        assert '"punchline"' in system["content"]


def test_structured_output_function_calling_and_raw(monkeypatch):
    call = ToolCallEvent(0, "c1", "Joke", '{"setup": "s", "punchline": "p"}')
    scripted(monkeypatch, [call, final("", [call])])
    model = ChatAgentSpec(model="tiny", base_url=URL)
    assert model.with_structured_output(Joke).invoke("joke") == Joke(setup="s", punchline="p")
    out = model.with_structured_output(Joke, method="json_mode", include_raw=True).invoke("joke")
    assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)


def test_verifier_failures_map_to_langchain_types_with_cause(monkeypatch):
    cause = VerifierUnavailable("verifier unreachable")
    cause.__cause__ = httpx.ConnectError("refused")
    scripted(monkeypatch, [TextEvent("partial")], error=cause)
    with pytest.raises(ModelConnectionError) as info:
        ChatAgentSpec(model="tiny", base_url=URL).invoke("hi")
    assert info.value.__cause__ is cause and info.value.is_retryable
    assert isinstance(info.value, VerifierUnavailable)  # agentspec callers keep working


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("error, expected", [
    (_chained(VerifierUnavailable("x"), httpx.ReadTimeout("slow")), ModelTimeoutError),
    (VerifierError("bad key", status=401), ModelAuthenticationError),
    (VerifierError("the prompt has 9000 tokens; this server's --max-model-len is 8192", status=400),
     ContextOverflowError),
    (VerifierUnavailable("boom", status=500), ModelAPIError),
    (VerifierError("slow", status=504, code="timeout"), ModelTimeoutError),
])
def test_map_error_table(error, expected):
    mapped = map_error(error)
    assert isinstance(mapped, expected) and isinstance(mapped, VerifierError)
    assert map_error(ValueError("not a model failure")) is None


def test_construction_validates_without_connecting():
    with pytest.raises(ValueError, match="base_url"):
        ChatAgentSpec(model="tiny")
    with pytest.raises(ValueError, match="drafter"):
        ChatAgentSpec(model="tiny", base_url=URL, mode="edge")
    assert ChatAgentSpec(model="tiny", base_url=[URL, URL], api_key="k")._sync_client is None


def test_adapters_import_lazily():
    code = ("import sys, agentspec.adapters; "
            "print(','.join(m for m in ('langchain_core', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
