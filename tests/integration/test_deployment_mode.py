"""The ``vllm`` mode against a real OpenAI-compatible deployment on loopback — an ``agentspec-verifier``'s
``/tokenize`` and ``/v1/completions`` with ``return_token_ids``, the subset of vLLM's API the mode uses (the
same client against a live vLLM: ``tests/integration/test_vllm_live.py``, ``make test-vllm``).

Greedy output equals plain greedy alone and when the router moves a request between the deployment and the
verifier's own modes mid-answer; a deployment that dies mid-request hands the rest to the verifier."""

from __future__ import annotations

import httpx
import pytest

from agentspec.client import Deployment, FinalEvent, SpecClient, TextEvent
from agentspec.drafters import ModelDrafter
from agentspec.router import ModeConfig, ModePolicy
from agentspec.types import SamplingParams
from tests.helpers import plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "tell me about tools"}]
MAX = 40
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
RF = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def verifier(target):
    with LoopbackServer(target, config(), draft_model=target) as srv:
        yield srv


@pytest.fixture(scope="module")
def deployment_server(target):
    with LoopbackServer(target, config(served_model_name="tiny-deployment")) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(target):
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    return plain_greedy(target, list(prompt), MAX)


def test_vllm_mode_alone_equals_plain_greedy(deployment_server, reference, target):
    dep = Deployment(deployment_server.url + "/v1", "tiny-deployment")
    client = SpecClient(deployment=dep, segment_tokens=8)
    events = list(client.stream(MESSAGES, max_tokens=MAX))
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.tokens == reference
    assert {s.mode for s in final.stats.segments} == {"vllm"} and len(final.stats.segments) >= 2
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == final.text
    assert final.text == target.tokenizer.decode([t for t in reference if t != 1], skip_special_tokens=True)
    client.close()


def test_auto_moves_between_the_deployment_and_the_verifier_losslessly(verifier, deployment_server, reference,
                                                                       target):
    dep = Deployment(deployment_server.url, "tiny-deployment")
    policy = ModePolicy(ModeConfig(probe_every=1))
    client = SpecClient(verifier.url, drafter=ModelDrafter(target), tokenizer=target.tokenizer, deployment=dep,
                        segment_tokens=4, policy=policy)
    final = client.generate(MESSAGES, max_tokens=MAX)
    assert final.tokens == reference
    modes = [s.mode for s in final.stats.segments]
    assert "vllm" in modes and len(set(modes)) >= 2, modes  # every mode tried, then switched mid-answer
    assert policy.seconds_per_token["vllm"] > 0  # measured like every other mode
    client.close()


def test_a_deployment_that_fails_hands_the_rest_to_the_verifier(verifier, target, reference):
    dead = LoopbackServer(target, config(served_model_name="doomed"))
    dead.__enter__()
    client = SpecClient(verifier.url, deployment=Deployment(dead.url, "doomed"), mode="vllm", segment_tokens=8,
                        retries=0, timeout=5)
    stream = client.stream(MESSAGES, max_tokens=MAX)
    first = next(stream)  # the deployment's first text: one segment committed
    dead.__exit__(None, None, None)
    final = [first, *stream][-1]
    assert final.tokens == reference
    modes = [s.mode for s in final.stats.segments]
    assert modes[0] == "vllm" and "server" in modes and final.stats.fallbacks
    client.close()


def test_bad_configuration_is_refused(deployment_server):
    with pytest.raises(ValueError, match="needs deployment"):
        SpecClient(deployment_server.url, mode="vllm")
    with pytest.raises(ValueError, match="http"):
        Deployment("localhost:8000", "m")
    with pytest.raises(ValueError, match="model"):
        Deployment("http://localhost:8000", "")
    client = SpecClient(deployment=Deployment(deployment_server.url, "tiny-deployment"))
    with pytest.raises(ValueError, match="deployment serves 'tiny-deployment'"):
        client.generate(MESSAGES, max_tokens=4, model="another-model")
    client.close()


def reference_of(verifier, **request) -> FinalEvent:
    """The verifier's own plain decoding of a request (its grammar, penalties and logprobs applied)."""
    client = SpecClient(verifier.url, mode="server-ar")
    final = client.generate(MESSAGES, max_tokens=MAX, **request)
    client.close()
    return final


CHAT_REQUESTS = {  # SpecClient's arguments, and the same request in OpenAI's form
    "json_schema": ({"response_format": RF}, {"response_format": RF}),
    "named_tool": ({"tools": TOOLS, "tool_choice": NAMED}, {"tools": TOOLS, "tool_choice": NAMED}),
    "penalties": ({"sampling": SamplingParams(presence_penalty=1.2, frequency_penalty=0.8)},
                  {"presence_penalty": 1.2, "frequency_penalty": 0.8}),
    "logprobs": ({"sampling": SamplingParams(logprobs=2)}, {"logprobs": True, "top_logprobs": 2}),
}


@pytest.mark.parametrize("case", CHAT_REQUESTS)
def test_answers_segments_cannot_carry_are_one_chat_completion(deployment_server, case):
    """A grammar restarts and penalties forget the answer when each segment is a new request: such an
    answer is one chat completion on the deployment, with every argument: the deployment's own answer."""
    request_, openai_form = CHAT_REQUESTS[case]
    body = {"model": "tiny-deployment", "messages": MESSAGES, "max_tokens": MAX, "temperature": 0.0, **openai_form}
    want = httpx.post(deployment_server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    client = SpecClient(deployment=Deployment(deployment_server.url, "tiny-deployment"), segment_tokens=4)
    final = client.generate(MESSAGES, max_tokens=MAX, **request_)
    assert (final.text or None) == want["message"]["content"] and final.finish_reason == want["finish_reason"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in want["message"].get("tool_calls") or ()]
    assert [(c.name, c.arguments) for c in final.tool_calls] == calls
    assert [s.mode for s in final.stats.segments] == ["vllm"] and final.model == "tiny-deployment"
    if case == "named_tool":  # the grammar went along: a random tiny target starts a call
        assert final.text.startswith("<tool_call>") or final.tool_calls, final.text
    if case == "logprobs":
        entries = want["logprobs"]["content"]
        assert [e["token"] for e in final.logprobs] == [e["token"] for e in entries] and entries
        assert [e["logprob"] for e in final.logprobs] == pytest.approx([e["logprob"] for e in entries], abs=1e-5)
    client.close()


def test_logit_bias_goes_along_with_every_segment(verifier, deployment_server):
    plain = reference_of(verifier)
    bias = SamplingParams(logit_bias={plain.tokens[0]: -100.0})  # the plain answer's first token, banned
    want = reference_of(verifier, sampling=bias)
    assert want.tokens[0] != plain.tokens[0]
    client = SpecClient(deployment=Deployment(deployment_server.url, "tiny-deployment"), segment_tokens=4)
    final = client.generate(MESSAGES, max_tokens=MAX, sampling=bias)
    assert final.tokens == want.tokens and len(final.stats.segments) >= 2
    assert {s.mode for s in final.stats.segments} == {"vllm"}
    client.close()


def test_auto_keeps_what_segments_cannot_carry_on_the_verifier(verifier, deployment_server, target):
    client = SpecClient(verifier.url, drafter=ModelDrafter(target), tokenizer=target.tokenizer, segment_tokens=4,
                        deployment=Deployment(deployment_server.url, "tiny-deployment"),
                        policy=ModePolicy(ModeConfig(probe_every=1)))
    final = client.generate(MESSAGES, max_tokens=MAX, response_format=RF)
    assert final.text == reference_of(verifier, response_format=RF).text
    assert "vllm" not in {s.mode for s in final.stats.segments}
    client.close()


def test_a_whole_answer_whose_deployment_is_down_goes_to_the_verifier(verifier, target):
    dead = LoopbackServer(target, config(served_model_name="doomed"))
    dead.__enter__()
    dead.__exit__(None, None, None)  # the port is closed: a connection refused, before any text
    client = SpecClient(verifier.url, deployment=Deployment(dead.url, "doomed"), mode="vllm", retries=0, timeout=5)
    final = client.generate(MESSAGES, max_tokens=MAX, response_format=RF)
    assert final.text == reference_of(verifier, response_format=RF).text
    assert [s.mode for s in final.stats.segments][-1] == "server" and final.stats.fallbacks
    client.close()


def test_chat_model_and_litellm_route_to_the_deployment(deployment_server, reference, target):
    from agentspec.adapters import ChatAgentSpec
    from agentspec.adapters import litellm as adapter

    text = target.tokenizer.decode([t for t in reference if t != 1], skip_special_tokens=True)
    llm = ChatAgentSpec(model="tiny-deployment", vllm_base_url=deployment_server.url, mode="vllm", max_tokens=MAX,
                        segment_tokens=8)
    msg = llm.invoke(MESSAGES[0]["content"])
    assert msg.content == text and msg.response_metadata["model_name"] == "tiny-deployment"
    with pytest.raises(ValueError, match="vllm_base_url"):
        ChatAgentSpec(model="m", base_url="http://127.0.0.1:1", mode="vllm")
    adapter.register()
    resp = adapter.litellm.completion(model="agentspec/tiny-deployment", messages=MESSAGES, max_tokens=MAX,
                                      api_base=deployment_server.url, mode="vllm",
                                      vllm_base_url=deployment_server.url)
    assert resp.choices[0].message.content == text
    assert set(resp._hidden_params["agentspec"]["modes"]) == {"vllm"}
    with pytest.raises(Exception, match="vllm_base_url"):
        adapter.litellm.completion(model="agentspec/tiny-deployment", messages=MESSAGES, max_tokens=4,
                                   api_base=deployment_server.url, mode="vllm")
