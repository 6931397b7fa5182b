"""/v1/chat/completions with the official openai client and litellm's openai/ provider, incl. streamed tool
calls. The target is a tiny model trained in the fixture to answer one request with a Hermes tool call."""

from __future__ import annotations

import json
import os

import httpx
import pytest
import torch

from tests.helpers import EOS, tiny_model
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _memorise(model, ids: list[int], start: int, steps: int = 300) -> None:
    """Fit the model to ``ids[start:]`` given ``ids[:start]`` (greedy then reproduces it)."""
    x = torch.tensor([ids])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        logits = model(input_ids=x).logits[0, start - 1 : -1]
        loss = torch.nn.functional.cross_entropy(logits.float(), x[0, start:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.eval()


@pytest.fixture(scope="module")
def tool_target():
    t = tiny_model(seed=7, layers=2)
    prompt = t.tokenizer.apply_chat_template(ASK, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    answer = t.tokenizer.encode(ANSWER, add_special_tokens=False)
    _memorise(t.model, list(prompt) + answer + [EOS], len(prompt))
    return t


@pytest.fixture(scope="module", params=["server-ar", "server"])
def server(request, tool_target):
    draft = tool_target if request.param == "server" else None  # the target drafting for itself
    with LoopbackServer(tool_target, config(), draft_model=draft) as srv:
        yield srv


def test_openai_client_tool_call(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))
    resp = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert resp.usage.completion_tokens > 0 and resp.usage.prompt_tokens > 0


def test_openai_client_streamed_tool_call(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, stream=True,
                                            stream_options={"include_usage": True})
    content, name, args, finish, usage = "", "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            assert tc.index == 0
            name += tc.function.name or "" if tc.function else ""
            args += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Sure. " and name == "get_weather" and json.loads(args) == {"city": "Paris"}
    assert finish == "tool_calls" and usage is not None and usage.total_tokens > 0


def test_plain_text_matches_greedy_decode(server, tool_target):
    from tests.helpers import plain_greedy

    msgs = [{"role": "user", "content": "something else"}]  # no tools: the output is text, whatever it holds
    prompt = tool_target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    ref = plain_greedy(tool_target, list(prompt), 20)
    expected = tool_target.tokenizer.decode([t for t in ref if t != EOS], skip_special_tokens=True)
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 20}, timeout=60)
    body = r.json()
    assert r.status_code == 200, body
    assert body["choices"][0]["message"]["content"] == expected


def test_stop_string(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"messages": ASK, "tools": TOOLS, "stop": ["<tool"], "max_tokens": 120}, timeout=60)
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Sure. "
    assert body["choices"][0]["finish_reason"] == "stop"


def test_litellm_openai_provider_parses_tool_calls(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    resp = litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="unused", messages=ASK,
                              tools=TOOLS, max_tokens=120, timeout=60)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="unused",
                                     messages=ASK, tools=TOOLS, max_tokens=120, stream=True, timeout=60))
    rebuilt = litellm.stream_chunk_builder(chunks, messages=ASK)
    call = rebuilt.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
