"""The ``vllm`` mode against a real OpenAI-compatible deployment on loopback — an ``agentspec-verifier``'s
``/tokenize`` and ``/v1/completions`` with ``return_token_ids``, the subset of vLLM's API the mode uses (the
same client against a live vLLM: ``tests/integration/test_vllm_live.py``, ``make test-vllm``).

Greedy output equals plain greedy alone and when the router moves a request between the deployment and the
verifier's own modes mid-answer; a deployment that dies mid-request hands the rest to the verifier."""

from __future__ import annotations

import pytest

from agentspec.client import Deployment, FinalEvent, SpecClient, TextEvent
from agentspec.drafters import ModelDrafter
from agentspec.router import ModeConfig, ModePolicy
from tests.helpers import plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "tell me about tools"}]
MAX = 40


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
    from agentspec.types import SamplingParams

    with pytest.raises(ValueError, match="presence_penalty"):
        client.generate(MESSAGES, max_tokens=4, sampling=SamplingParams(presence_penalty=0.5))
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
