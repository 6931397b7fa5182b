"""The ``agentspec/`` litellm provider against a real verifier on loopback (tiny models, fixed seeds).

Text must equal plain greedy decoding in every call style (sync/async, streamed or not); tool calls come
back in OpenAI format; usage is always reported; the provider enforces ``timeout`` itself; a Router falls
back to another deployment when the verifier is down.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from benchmarks.delay_proxy import DelayProxy
from tests.helpers import EOS, plain_greedy, tiny_model
from tests.integration.server import LoopbackServer, config
from tests.integration.test_openai_api import ANSWER, ASK, TOOLS, _memorise

pytestmark = pytest.mark.integration

PLAIN = [{"role": "user", "content": "something else"}]  # no tools: the answer is text, whatever it holds
MAX = 24


@pytest.fixture(scope="module")
def litellm_mod():
    from agentspec.adapters import litellm as adapter

    adapter.register()
    return adapter.litellm


@pytest.fixture(scope="module")
def tool_target():
    """A tiny model that answers ``ASK`` with a Hermes ``<tool_call>`` (memorised)."""
    t = tiny_model(seed=7, layers=2)
    prompt = t.tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on 2 shared cores one thread trains this tiny model ~3x faster than two
    try:
        _memorise(t.model, list(prompt) + t.tokenizer.encode(ANSWER, add_special_tokens=False) + [EOS],
                  len(prompt))
    finally:
        torch.set_num_threads(threads)
    return t


@pytest.fixture(scope="module")
def server(tool_target):
    with LoopbackServer(tool_target, config(), draft_model=tool_target) as srv:  # the target drafts for itself
        yield srv


@pytest.fixture(scope="module")
def expected(tool_target):
    """Plain greedy decoding of ``PLAIN``: the text every call style must return."""
    prompt = tool_target.tokenizer.apply_chat_template(PLAIN, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    ref = plain_greedy(tool_target, list(prompt), MAX)
    return tool_target.tokenizer.decode([t for t in ref if t != EOS], skip_special_tokens=True), len(prompt)


def _call(server, **kw):
    return {"model": "agentspec/tiny", "api_base": server.url, "max_tokens": MAX, "timeout": 60, **kw}


def _check_usage(usage, prompt_len: int | None = None) -> None:
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if prompt_len is not None:
        assert usage.prompt_tokens == prompt_len


def _joined(chunks) -> tuple[str, object]:
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in reversed(chunks) if getattr(c, "usage", None) is not None), None)
    return text, usage


def test_register_is_idempotent(litellm_mod):
    from agentspec.adapters.litellm import AgentSpecLLM, register

    assert register() is register()
    items = [i for i in litellm_mod.custom_provider_map if i["provider"] == "agentspec"]
    assert len(items) == 1 and isinstance(items[0]["custom_handler"], AgentSpecLLM)


def test_completion_equals_plain_greedy(litellm_mod, server, expected):
    text, prompt_len = expected
    resp = litellm_mod.completion(messages=PLAIN, **_call(server))
    assert resp.choices[0].message.content == text
    assert resp.choices[0].message.tool_calls is None
    _check_usage(resp.usage, prompt_len)
    assert resp._hidden_params["agentspec"]["modes"]  # SpecClient statistics ride along


def test_streaming_equals_non_stream(litellm_mod, server, expected):
    text, prompt_len = expected
    chunks = list(litellm_mod.completion(messages=PLAIN, stream=True, stream_options={"include_usage": True},
                                         **_call(server)))
    streamed, usage = _joined(chunks)
    assert streamed == text
    _check_usage(usage, prompt_len)
    rebuilt = litellm_mod.stream_chunk_builder(chunks, messages=PLAIN)
    assert rebuilt.choices[0].message.content == text
    _check_usage(rebuilt.usage, prompt_len)


async def test_acompletion_and_astreaming(litellm_mod, server, expected):
    text, prompt_len = expected
    resp = await litellm_mod.acompletion(messages=PLAIN, **_call(server))
    assert resp.choices[0].message.content == text
    _check_usage(resp.usage, prompt_len)
    stream = await litellm_mod.acompletion(messages=PLAIN, stream=True, stream_options={"include_usage": True},
                                           **_call(server))
    chunks = [c async for c in stream]
    streamed, usage = _joined(chunks)
    assert streamed == text
    _check_usage(usage, prompt_len)


def test_tool_call_non_stream_and_stream(litellm_mod, server):
    resp = litellm_mod.completion(messages=ASK, tools=TOOLS, **_call(server, max_tokens=120))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    call = choice.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    _check_usage(resp.usage)

    chunks = list(litellm_mod.completion(messages=ASK, tools=TOOLS, stream=True, **_call(server, max_tokens=120)))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert len(deltas) == 1 and json.loads(deltas[0].function.arguments) == {"city": "Paris"}  # complete, once
    rebuilt = litellm_mod.stream_chunk_builder(chunks, messages=ASK)
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert rebuilt.choices[0].message.tool_calls[0].function.name == "get_weather"
    _check_usage(rebuilt.usage)


async def test_async_stream_tool_call(litellm_mod, server):
    stream = await litellm_mod.acompletion(messages=ASK, tools=TOOLS, stream=True, **_call(server, max_tokens=120))
    chunks = [c async for c in stream]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert any(c.choices and c.choices[0].finish_reason == "tool_calls" for c in chunks)


def test_tool_choice_none_hides_tools(litellm_mod, server):
    resp = litellm_mod.completion(messages=ASK, tools=TOOLS, tool_choice="none", **_call(server))
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_unsupported_arguments_are_refused(litellm_mod, server):
    with pytest.raises(litellm_mod.BadRequestError, match="drafter"):
        litellm_mod.completion(messages=PLAIN, mode="edge", **_call(server))
    with pytest.raises(litellm_mod.BadRequestError, match="n=1"):
        litellm_mod.completion(messages=PLAIN, n=2, **_call(server))


def _delayed(server, one_way_delay_s: float):
    litellm_warm_up(server)  # litellm's own first-call set-up (about 1 s) happens before the provider runs
    return DelayProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1]), one_way_delay_s=one_way_delay_s)


def litellm_warm_up(server) -> None:
    from agentspec.adapters.litellm import litellm

    litellm.completion(messages=PLAIN, **_call(server, max_tokens=1))


@pytest.fixture()
def slow_url(server):
    """The verifier behind a 5 s one-way delay: nothing can come back within the tests' 0.5 s timeout."""
    with _delayed(server, 5.0) as proxy:
        yield f"http://127.0.0.1:{proxy.port}"


@pytest.mark.parametrize("stream", [False, True])
def test_timeout_enforced_sync(litellm_mod, slow_url, stream):
    t0 = time.perf_counter()
    with pytest.raises(litellm_mod.Timeout):
        resp = litellm_mod.completion(model="agentspec/tiny", api_base=slow_url, messages=PLAIN, max_tokens=MAX,
                                      timeout=0.5, stream=stream)
        if stream:
            list(resp)
    assert time.perf_counter() - t0 < 1.5


async def test_timeout_enforced_async(litellm_mod, slow_url):
    t0 = time.perf_counter()
    with pytest.raises(litellm_mod.Timeout):
        await litellm_mod.acompletion(model="agentspec/tiny", api_base=slow_url, messages=PLAIN, max_tokens=MAX,
                                      timeout=0.5)
    assert time.perf_counter() - t0 < 1.5


def test_timeout_mid_generation_is_exact(litellm_mod, server):
    """0.5 s RTT: the session opens, generation is under way when the 1.2 s deadline passes. The Timeout
    comes at the deadline, not after the session's clean-up (another round trip) has finished."""
    with _delayed(server, 0.25) as proxy:
        t0 = time.perf_counter()
        with pytest.raises(litellm_mod.Timeout):
            list(litellm_mod.completion(model="agentspec/tiny", api_base=f"http://127.0.0.1:{proxy.port}",
                                        messages=PLAIN, max_tokens=400, timeout=1.2, stream=True))
        elapsed = time.perf_counter() - t0
    assert 1.2 <= elapsed < 1.6


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_verifier_down_is_a_connection_error(litellm_mod):
    with pytest.raises(litellm_mod.APIConnectionError):
        litellm_mod.completion(model="agentspec/tiny", api_base=_closed_port_url(), messages=PLAIN, timeout=10)


def test_router_falls_back_when_verifier_is_down(litellm_mod):
    router = litellm_mod.Router(
        model_list=[
            {"model_name": "agent", "litellm_params": {"model": "agentspec/tiny", "api_base": _closed_port_url(),
                                                       "timeout": 10}},
            {"model_name": "backup", "litellm_params": {"model": "openai/gpt-4o-mini", "api_key": "unused",
                                                        "mock_response": "fallback answer"}},
        ],
        fallbacks=[{"agent": ["backup"]}], num_retries=0)
    resp = router.completion(model="agent", messages=PLAIN)
    assert resp.choices[0].message.content == "fallback answer"


def test_api_key_is_sent_as_bearer(litellm_mod, target, monkeypatch):
    with LoopbackServer(target, config(api_keys=("secret",))) as srv:
        resp = litellm_mod.completion(messages=PLAIN, api_key="secret", **_call(srv, max_tokens=4))
        assert resp.usage.completion_tokens > 0
        monkeypatch.setenv("AGENTSPEC_API_KEY", "secret")  # the default when no api_key is given
        assert litellm_mod.completion(messages=PLAIN, **_call(srv, max_tokens=4)).usage.completion_tokens > 0
        with pytest.raises(litellm_mod.AuthenticationError):
            litellm_mod.completion(messages=PLAIN, api_key="wrong", **_call(srv, max_tokens=4))


# -- the API fallback's tool calls, model info, dropped parameters --------------------------------------


def _api_fallback(server, **kw):
    """A SpecClient answering through the API fallback: litellm's ``openai/`` provider on the verifier's
    own OpenAI endpoint (a real provider round trip)."""
    from agentspec.client import SpecClient

    return SpecClient(mode="api", fallback_model="openai/tiny",
                      api_kwargs={"api_base": server.url + "/v1", "api_key": "unused"}, **kw)


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_api_fallback_streams_tool_calls_as_events(server, use_async):
    from agentspec.client import FinalEvent, TextEvent, ToolCallEvent

    client = _api_fallback(server)
    if use_async:
        events = [ev async for ev in client.astream(ASK, TOOLS, max_tokens=120)]
    else:
        events = list(client.stream(ASK, TOOLS, max_tokens=120))
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.finish_reason == "tool_calls" and final.tool_calls == calls
    assert final.usage["completion_tokens"] > 0 and final.model == "tiny"


def test_chat_agentspec_streams_the_fallbacks_tool_call_chunks(server):
    from agentspec.adapters import ChatAgentSpec

    model = ChatAgentSpec(mode="api", fallback_model="openai/tiny", fallback_api_base=server.url + "/v1",
                          fallback_api_key="unused", max_tokens=120).bind_tools(TOOLS)
    chunks = list(model.stream(ASK[0]["content"]))
    assert any(c.tool_call_chunks for c in chunks) and any(c.content for c in chunks)
    message = chunks[0]
    for c in chunks[1:]:
        message += c
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert message.response_metadata["model_name"] == "tiny" and message.usage_metadata["output_tokens"] > 0


def test_model_info_is_registered(litellm_mod, server):
    """litellm knows what an ``agentspec/`` model supports and costs: before any call for the names given
    to ``register``, and after a call for the name it used."""
    from agentspec.adapters.litellm import register

    register(models=["pre-registered"])
    assert litellm_mod.supports_function_calling("agentspec/pre-registered")
    resp = litellm_mod.completion(messages=PLAIN, **_call(server, max_tokens=2))
    assert litellm_mod.supports_function_calling("agentspec/tiny")
    assert litellm_mod.get_model_info("agentspec/tiny")["supports_tool_choice"]
    assert litellm_mod.completion_cost(completion_response=resp) == 0.0  # ModelNotMappedError before


def test_first_call_prints_no_provider_list(litellm_mod, server, capfd):
    litellm_mod.completion(messages=PLAIN, **_call(server, max_tokens=2))
    list(litellm_mod.completion(messages=PLAIN, stream=True, **_call(server, max_tokens=2)))
    assert "Provider List" not in capfd.readouterr().out


def test_unsupported_parameters_are_refused_unless_dropping_was_asked(litellm_mod, server):
    """An unsupported parameter is a BadRequestError naming it; ``drop_params=True`` (per call or
    litellm-wide) drops it, as litellm does for its own providers."""
    with pytest.raises(litellm_mod.BadRequestError, match="service_tier"):
        litellm_mod.completion(messages=PLAIN, service_tier="flex", **_call(server, max_tokens=2))
    litellm_mod.completion(messages=PLAIN, service_tier="flex", drop_params=True, **_call(server, max_tokens=2))
    litellm_mod.drop_params = True
    try:
        litellm_mod.completion(messages=PLAIN, service_tier="flex", **_call(server, max_tokens=2))
    finally:
        litellm_mod.drop_params = False
