"""ChatAgentSpec against real loopback verifiers: LangChain's standard integration tests, greedy
losslessness in every mode, a LangChain agent on a tiny target memorised to use a tool, error mapping.

Set AGENTSPEC_CAPABLE_LLM=1 to run the standard tests (including the ``capable_llm`` ones) against
Qwen2.5-Coder-0.5B-Instruct instead of a tiny random model.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
import torch
from langchain_core.exceptions import ModelConnectionError, ModelTimeoutError
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_tests.integration_tests import ChatModelIntegrationTests

from agentspec.adapters import ChatAgentSpec
from agentspec.adapters.langchain_errors import ToolChoiceError
from agentspec.adapters.langchain_io import to_chat_messages
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.toolcalls import render_chat
from agentspec.transport import VerifierUnavailable
from tests.helpers import EOS, plain_greedy, tiny_model
from tests.integration.conftest import capable_llm_enabled
from tests.integration.server import ALIAS, LoopbackServer, config

pytestmark = pytest.mark.integration
QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def tiny_server(target):
    with LoopbackServer(target, config(), draft_model=target) as srv:  # the target drafts for itself
        yield srv


# -- LangChain's standard integration tests ----------------------------------------------------------


@pytest.fixture(scope="module")
def standard_server(request):
    if not capable_llm_enabled():
        yield request.getfixturevalue("tiny_server")
        return
    from agentspec.models import load_model

    qwen = load_model(QWEN, device="cpu", dtype="float32")
    with LoopbackServer(qwen, config(served_model_name=QWEN)) as srv:
        yield srv


class TestChatAgentSpecStandard(ChatModelIntegrationTests):
    """Everything LangChain checks; tests that need a target that follows instructions are listed in
    ``capable_llm_tests`` (deselected unless AGENTSPEC_CAPABLE_LLM=1)."""

    capable_llm_tests = frozenset({
        "test_tool_calling", "test_tool_calling_async", "test_bind_runnables_as_tools", "test_tool_choice",
        "test_tool_calling_with_no_arguments", "test_structured_few_shot_examples", "test_structured_output",
        "test_structured_output_async", "test_structured_output_pydantic_2_v1",
        "test_structured_output_optional_param", "test_json_mode", "test_agent_loop",
        "test_unicode_tool_call_integration",
    })
    server_url = ""

    @pytest.fixture(autouse=True)
    def _server(self, standard_server):
        type(self).server_url = standard_server.url

    @property
    def chat_model_class(self) -> type[ChatAgentSpec]:
        return ChatAgentSpec

    @property
    def chat_model_params(self) -> dict[str, Any]:
        capable = capable_llm_enabled()
        return {"model": QWEN if capable else "tiny", "base_url": self.server_url, "max_tokens": 256 if capable else 16,
                "mode": "auto", "drafter": NgramDrafter(), "segment_tokens": 8}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return True  # among the verifier's served names (--served-model-name NAME ALIAS ...)

    @property
    def model_override_value(self) -> str:
        return ALIAS


# -- greedy losslessness through the adapter ---------------------------------------------------------

QUESTION = "tell me about tools"
MAX = 40


@pytest.fixture(scope="module")
def reference(target) -> tuple[str, int]:
    prompt = render_chat(target.tokenizer, to_chat_messages([HumanMessage(QUESTION)]))
    ref = plain_greedy(target, prompt, MAX)
    return target.tokenizer.decode([t for t in ref if t != EOS], skip_special_tokens=True), len(ref)


@pytest.mark.parametrize("mode, drafter", [("server-ar", None), ("server", None), ("edge", "model"),
                                           ("edge", "ngram")])
def test_output_equals_plain_greedy(tiny_server, target, wrong_drafter_model, reference, mode, drafter):
    local = {"model": ModelDrafter(wrong_drafter_model), "ngram": NgramDrafter(), None: None}[drafter]
    model = ChatAgentSpec(model="tiny", base_url=tiny_server.url, mode=mode, drafter=local,
                          tokenizer=target.tokenizer, max_tokens=MAX, segment_tokens=8)
    text, n_tokens = reference
    msg = model.invoke(QUESTION)
    assert msg.content == text and msg.usage_metadata["output_tokens"] == n_tokens
    stats = msg.response_metadata["agentspec"]
    assert set(stats["modes"]) == {mode}
    if drafter == "model":
        assert stats["accepted"] < stats["drafted"]  # drafts were rejected and rolled back
    streamed = list(model.stream(QUESTION))
    assert "".join(c.text for c in streamed) == text and streamed[-1].chunk_position == "last"


@pytest.mark.parametrize("pipeline", [True, False])
def test_pipeline_reaches_the_client(tiny_server, target, reference, pipeline):
    """``pipeline`` is the client's: edge rounds drafted while the one before is in flight, or none."""
    model = ChatAgentSpec(model="tiny", base_url=tiny_server.url, mode="edge", drafter=ModelDrafter(target),
                          tokenizer=target.tokenizer, max_tokens=MAX, pipeline=pipeline)
    msg = model.invoke(QUESTION)
    assert msg.content == reference[0]
    assert (msg.response_metadata["agentspec"]["pipelined_rounds"] > 0) is pipeline


async def test_async_stream_equals_plain_greedy(tiny_server, reference):
    model = ChatAgentSpec(model="tiny", base_url=tiny_server.url, mode="server", max_tokens=MAX)
    chunks = [c async for c in model.astream(QUESTION)]
    assert "".join(c.text for c in chunks) == reference[0]
    assert sum(c.usage_metadata is not None for c in chunks) == 1


# -- an agent on a target memorised to use a tool ----------------------------------------------------


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


ASK = HumanMessage("What is 1 + 2 + 3?")
CALLS = [{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_1", "type": "tool_call"},
         {"name": "add", "args": {"a": 3, "b": 3}, "id": "call_2", "type": "tool_call"}]
STEP_2 = [ASK, AIMessage("", tool_calls=CALLS[:1]), ToolMessage("3", tool_call_id="call_1")]
STEP_3 = [*STEP_2, AIMessage("", tool_calls=CALLS[1:]), ToolMessage("6", tool_call_id="call_2")]
SCRIPT = [([ASK], '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'),
          (STEP_2, '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 3}}</tool_call>'),
          (STEP_3, "The answer is 6.")]
FINAL = "The answer is 6."


def _memorise(model: Any, pairs: list[tuple[list[int], list[int]]], max_steps: int = 400) -> None:
    """Fit ``model`` so greedy decoding of each prompt gives its answer (batch, loss on answers only)."""
    length = max(len(p) + len(a) for p, a in pairs)
    x = torch.zeros(len(pairs), length, dtype=torch.long)
    y = torch.full((len(pairs), length), -100)
    for i, (p, a) in enumerate(pairs):
        x[i, : len(p) + len(a)] = torch.tensor(p + a)
        y[i, len(p) - 1 : len(p) + len(a) - 1] = torch.tensor(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model trains faster on one thread than on two shared cores
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    try:
        for _ in range(max_steps):
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            mask = y != -100
            if loss.item() < 1e-2 and bool((logits.argmax(-1)[mask] == y[mask]).all()):
                break
    finally:
        model.eval()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agent_target():
    t = tiny_model(seed=7)
    tools = [convert_to_openai_tool(add)]
    pairs = [(render_chat(t.tokenizer, to_chat_messages(msgs), tools),
              t.tokenizer.encode(answer, add_special_tokens=False) + [EOS]) for msgs, answer in SCRIPT]
    _memorise(t.model, pairs)
    for prompt, answer in pairs:
        assert plain_greedy(t, prompt, len(answer)) == answer, "memorisation failed"
    return t


@pytest.fixture(scope="module")
def agent_server(agent_target):
    with LoopbackServer(agent_target, config()) as srv:
        yield srv


def _check_transcript(messages: list[Any]) -> None:
    kinds = [(type(m).__name__, [c["args"] for c in getattr(m, "tool_calls", [])], m.text) for m in messages]
    assert kinds == [("HumanMessage", [], ASK.text), ("AIMessage", [{"a": 1, "b": 2}], ""), ("ToolMessage", [], "3"),
                     ("AIMessage", [{"a": 3, "b": 3}], ""), ("ToolMessage", [], "6"), ("AIMessage", [], FINAL)]


@pytest.mark.parametrize("output_version", [None, "v1"])  # v1: tool calls also sit in the content blocks
def test_agent_completes_a_multi_step_tool_task(agent_server, output_version):
    from langchain.agents import create_agent

    model = ChatAgentSpec(model="tiny", base_url=agent_server.url, mode="server", max_tokens=96,
                          output_version=output_version)
    result = create_agent(model, [add]).invoke({"messages": [ASK]})
    _check_transcript(result["messages"])


async def test_agent_async(agent_server):
    from langchain.agents import create_agent

    model = ChatAgentSpec(model="tiny", base_url=agent_server.url, mode="auto", drafter=NgramDrafter(),
                          max_tokens=96)
    result = await create_agent(model, [add]).ainvoke({"messages": [ASK]})
    _check_transcript(result["messages"])


def test_agent_stream_shows_only_verified_tokens(agent_server, agent_target, wrong_drafter_model):
    """Edge mode with a drafter that is mostly wrong: the streamed text of each step is exactly the final
    message text (no rolled-back draft token ever appears), and tool calls arrive whole."""
    from langchain.agents import create_agent

    model = ChatAgentSpec(model="tiny", base_url=agent_server.url, mode="edge", max_tokens=96,
                          drafter=ModelDrafter(wrong_drafter_model), tokenizer=agent_target.tokenizer)
    streamed: dict[str, list[AIMessageChunk]] = {}
    final_state = None
    for kind, data in create_agent(model, [add]).stream({"messages": [ASK]}, stream_mode=["messages", "values"]):
        if kind == "values":
            final_state = data
        elif isinstance(data[0], AIMessageChunk):
            streamed.setdefault(data[0].id, []).append(data[0])
    answers = [m for m in final_state["messages"] if isinstance(m, AIMessage)]
    _check_transcript(final_state["messages"])
    assert len(streamed) == len(answers) == 3
    for msg in answers:
        chunks = streamed[msg.id]
        assert "".join(c.text for c in chunks) == msg.text
        tool_chunks = [tc for c in chunks for tc in c.tool_call_chunks]  # each call whole, in one chunk
        assert [(tc["name"], json.loads(tc["args"])) for tc in tool_chunks] == [
            (tc["name"], tc["args"]) for tc in msg.tool_calls]
        stats = msg.response_metadata["agentspec"]
        assert set(stats["modes"]) == {"edge"}
    assert sum(m.response_metadata["agentspec"]["drafted"] - m.response_metadata["agentspec"]["accepted"]
               for m in answers) > 0  # drafts were rejected: there was something to roll back


@pytest.mark.parametrize("streaming", [False, True])
def test_agent_through_chat_litellm(agent_server, streaming):
    """The same agent with langchain-litellm's ``ChatLiteLLM("agentspec/…")``: agentspec's litellm provider
    behind LangChain's own litellm chat model; the transcript is the memorised one, step for step."""
    from langchain.agents import create_agent
    from langchain_litellm import ChatLiteLLM

    from agentspec.adapters.litellm import register

    register()
    model = ChatLiteLLM(model="agentspec/tiny", api_base=agent_server.url, max_tokens=96, temperature=0,
                        streaming=streaming)
    result = create_agent(model, [add]).invoke({"messages": [ASK]})
    _check_transcript(result["messages"])
    assert all(m.usage_metadata["output_tokens"] > 0 for m in result["messages"] if isinstance(m, AIMessage))


def test_model_override_must_be_a_served_name(tiny_server):
    model = ChatAgentSpec(model="tiny", base_url=tiny_server.url, mode="server-ar", max_tokens=4)
    assert model.invoke("hi", model=ALIAS).response_metadata["model_name"] == ALIAS
    assert model.invoke("hi").response_metadata["model_name"] == "tiny"
    with pytest.raises(Exception, match="'other' is not served here") as info:
        model.invoke("hi", model="other")
    assert not getattr(info.value, "is_retryable", False)  # a 404: retrying the same name cannot help
    with pytest.raises(ValueError, match="non-empty string"):
        model.invoke("hi", model="")


def test_tool_choice_through_the_verifier(agent_server):
    model = ChatAgentSpec(model="tiny", base_url=agent_server.url, mode="server", max_tokens=96)
    none = model.bind_tools([add], tool_choice="none").invoke([ASK])
    auto = model.bind_tools([add]).invoke([ASK])
    assert not none.tool_calls and auto.tool_calls == [{**CALLS[0], "id": auto.tool_calls[0]["id"]}]
    assert none.usage_metadata["input_tokens"] < auto.usage_metadata["input_tokens"]  # tools were not sent
    with pytest.raises(ToolChoiceError):  # the memorised target never calls multiply
        model.bind_tools([add, multiply], tool_choice="multiply").invoke([ASK])


# -- errors ------------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_closed_port_raises_model_connection_error():
    model = ChatAgentSpec(model="tiny", base_url=f"http://127.0.0.1:{_closed_port()}", max_retries=0, timeout=2)
    with pytest.raises(ModelConnectionError) as info:
        model.invoke("hi")
    assert isinstance(info.value.__cause__, VerifierUnavailable) and info.value.is_retryable
    with pytest.raises(ModelConnectionError) as info:
        await model.ainvoke("hi")
    assert info.value.__cause__ is not None


def test_silent_server_raises_model_timeout_error():
    with socket.socket() as listener:  # accepts connections (backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        model = ChatAgentSpec(model="tiny", base_url=url, max_retries=0, timeout=0.5)
        with pytest.raises(ModelTimeoutError) as info:
            model.invoke("hi")
    assert isinstance(info.value.__cause__, VerifierUnavailable)


# -- constructor arguments ---------------------------------------------------------------------------


def test_unknown_constructor_arguments_warn_and_move_to_model_kwargs(tiny_server):
    """As ChatOpenAI: a UserWarning naming the argument, which lands in ``model_kwargs``; a call argument
    there applies to every call, anything else fails the call instead of being ignored."""
    with pytest.warns(UserWarning, match="frobnicate"):
        model = ChatAgentSpec(base_url=tiny_server.url, mode="server-ar", max_tokens=4, frobnicate=1)
    assert model.model_kwargs == {"frobnicate": 1}
    with pytest.raises(TypeError, match="frobnicate"):
        model.invoke("hi")
    with pytest.warns(UserWarning, match="top_p"):  # a field given in model_kwargs: moved to the field
        assert ChatAgentSpec(base_url=tiny_server.url, model_kwargs={"top_p": 0.9}).top_p == 0.9
    settings = {"base_url": tiny_server.url, "mode": "server-ar", "max_tokens": 8}
    fmt = {"type": "json_object"}
    plain, bound = ChatAgentSpec(**settings), ChatAgentSpec(**settings, model_kwargs={"response_format": fmt})
    answer = bound.invoke("hi").content
    assert answer == plain.invoke("hi", response_format=fmt).content != plain.invoke("hi").content
