"""Structured output with the default model (Qwen2.5-Coder-0.5B-Instruct, offline weights) on a loopback
verifier: every user-facing door returns objects of the asked shape because the grammar enforces it.

``with_structured_output`` with each method (function_calling, json_schema, json_mode), the official
``openai`` client's ``chat.completions.parse``, a required tool choice on a prompt that invites prose, and
the litellm provider's ``response_format``.
"""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from agentspec.adapters import ChatAgentSpec
from tests.integration.server import LoopbackServer, config

pytestmark = [pytest.mark.integration, pytest.mark.slow]
QWEN = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CITIES = ["Paris", "Tokyo", "Lisbon", "Nairobi", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth"]


class City(BaseModel):
    """Facts about a city."""

    name: str = Field(description="the city's name")
    country: str
    coastal: bool


@pytest.fixture(scope="module")
def qwen():
    from agentspec.models import load_model

    return load_model(QWEN, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def qwen_server(qwen):
    with LoopbackServer(qwen, config(served_model_name=QWEN)) as srv:
        yield srv


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_with_structured_output_returns_valid_objects(qwen_server, method):
    llm = ChatAgentSpec(model=QWEN, base_url=qwen_server.url, max_tokens=96, mode="server")
    schema = City if method != "json_mode" else City.model_json_schema()
    structured = llm.with_structured_output(schema, method=method, include_raw=True)
    valid = 0
    for city in CITIES:
        out = structured.invoke(f"Describe {city} with its name, country and whether it is coastal. "
                                "Answer in JSON with keys name, country, coastal.")
        parsed = out["parsed"]
        if method == "json_mode" and isinstance(parsed, dict):
            parsed = City.model_validate(parsed) if set(parsed) >= {"name", "country", "coastal"} else None
        valid += isinstance(parsed, City)
    assert valid >= 9, (method, valid)
    assert llm.profile["structured_output"] is True


def test_openai_parse_and_required_tool_choice(qwen_server):
    import openai

    client = openai.OpenAI(base_url=qwen_server.url + "/v1", api_key="none")
    done = client.chat.completions.parse(model=QWEN, max_tokens=96, response_format=City, messages=[
        {"role": "user", "content": "Describe Lisbon: its name, country and whether it is coastal."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    # a prompt that invites prose, with a required tool: the answer is a call, arguments valid
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_of_tool in ("required", named):
        reply = client.chat.completions.create(model=QWEN, max_tokens=64, tools=TOOLS, tool_choice=choice_of_tool,
                                               parallel_tool_calls=False,
                                               messages=[{"role": "user", "content": "Tell me a joke."}])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert not choice.message.content  # no prose around the call, not even the newline between calls
        assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
        assert reply.model_extra["agentspec"]["structure"] == "enforced"


def test_litellm_response_format_is_enforced(qwen_server):
    import litellm

    from agentspec.adapters.litellm import register

    register()

    reply = litellm.completion(model=f"agentspec/{QWEN}", api_base=qwen_server.url, max_tokens=96,
                               response_format=City, messages=[
                                   {"role": "user", "content": "Describe Oslo: name, country, coastal?"}])
    assert City.model_validate_json(reply.choices[0].message.content).name


def test_pipelined_edge_tool_call_equals_plain(qwen_server, qwen):
    """Edge drafting through the tool drafter (grammar + copy + the model) with the round after each one in
    flight drafted ahead: the grammar follows each hypothesis and re-follows the committed tokens when one
    fails. The call and every token equal plain greedy's; drafts made ahead were really used."""
    from agentspec.client import SpecClient
    from agentspec.drafters import ModelDrafter

    messages = [{"role": "user", "content": "What is the weather in Lisbon right now?"}]
    plain = SpecClient(qwen_server.url, tokenizer=qwen.tokenizer, mode="server-ar")
    reference = plain.generate(messages, TOOLS, max_tokens=64)
    plain.close()
    assert reference.tool_calls, "the prompt must make the target call the tool, or the grammar never engages"
    client = SpecClient(qwen_server.url, drafter=ModelDrafter(qwen), tokenizer=qwen.tokenizer, mode="edge",
                        num_draft_tokens=4, pipeline=True)
    final = client.generate(messages, TOOLS, max_tokens=64)
    client.close()
    assert final.tokens == reference.tokens
    assert [(c.name, c.arguments) for c in final.tool_calls] == [(c.name, c.arguments) for c in reference.tool_calls]
    assert final.stats.to_dict()["pipelined_rounds"] > 0
