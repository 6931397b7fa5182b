"""The closed-model fallback (``mode="api"`` and failover) against a real OpenAI-compatible provider.

The provider is an agentspec-verifier's own ``/v1/chat/completions`` on loopback (tiny model, served as
``fallback-llm``, behind an API key), reached through litellm's ``openai/`` provider: every argument must
arrive (the provider's answer equals a direct request with the same arguments, or its 400 surfaces), usage
and the model name are the provider's, answers stream, and a switch mid-answer sums both parts' usage.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from agentspec.adapters import ChatAgentSpec
from agentspec.client import FinalEvent, SpecClient, TextEvent
from agentspec.client.api import litellm_module
from agentspec.drafters import ModelDrafter
from agentspec.types import SamplingParams
from benchmarks.reliability import kill
from tests.helpers import plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "tell me about tools"}]
NAME, KEY, MAX = "fallback-llm", "provider-secret", 12
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def provider(target):
    with LoopbackServer(target, config(served_model_name=NAME, api_keys=(KEY,))) as srv:
        yield srv


def direct(provider, messages=MESSAGES, **body) -> dict:
    """The provider's own answer to the same arguments (no agentspec, no litellm in between)."""
    body = {"model": NAME, "messages": messages, "max_tokens": MAX, "temperature": 0.0, **body}
    r = httpx.post(f"{provider.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def api_client(provider, **kw) -> SpecClient:
    return SpecClient(mode="api", fallback_model=f"openai/{NAME}",
                      api_kwargs={"api_base": f"{provider.url}/v1", "api_key": KEY}, **kw)


def _usage(body: dict) -> dict[str, int]:
    return {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


def test_api_mode_reports_the_providers_usage_and_model(provider):
    ref = direct(provider)
    final = api_client(provider).generate(MESSAGES, max_tokens=MAX)
    assert final.text == ref["choices"][0]["message"]["content"]
    assert final.usage == _usage(ref) and final.usage["completion_tokens"] == MAX  # not 0/0/0
    assert final.model == NAME and final.finish_reason == "length"
    assert [s.mode for s in final.stats.segments] == ["api"] and final.stats.segments[0].tokens == MAX


def test_api_mode_streams_text_as_it_arrives(provider):
    events = list(api_client(provider).stream(MESSAGES, max_tokens=MAX))
    texts = [e.text for e in events if isinstance(e, TextEvent)]
    assert len(texts) > 1 and isinstance(events[-1], FinalEvent)  # several chunks, not one at the end
    assert "".join(texts) == events[-1].text == direct(provider)["choices"][0]["message"]["content"]


async def test_async_api_mode_streams_too(provider):
    client, texts = api_client(provider), []
    async for ev in client.astream(MESSAGES, max_tokens=MAX):
        if isinstance(ev, TextEvent):
            texts.append(ev.text)
        final = ev
    assert len(texts) > 1 and final.usage == _usage(direct(provider)) and final.model == NAME


def test_sampling_arguments_reach_the_provider(provider):
    """temperature, top_p and seed change the provider's sampled answer exactly as a direct request does."""
    client = api_client(provider)
    answers = {}
    for top_p, seed in ((1.0, 3), (1.0, 4), (0.5, 3)):
        sampling = SamplingParams(temperature=1.0, top_p=top_p, seed=seed)
        answers[top_p, seed] = client.generate(MESSAGES, max_tokens=MAX, sampling=sampling).text
        ref = direct(provider, temperature=1.0, top_p=top_p, seed=seed)["choices"][0]["message"]["content"]
        assert answers[top_p, seed] == ref
    assert len(set(answers.values())) == 3  # each argument made a difference, so each one arrived


def test_tool_choice_response_format_and_stop_reach_the_provider(provider):
    """The provider's own 400s prove the arguments were sent (agentspec does not validate them here)."""
    litellm, client = litellm_module(), api_client(provider)
    with pytest.raises(litellm.BadRequestError, match="not in tools"):
        client.generate(MESSAGES, TOOLS, max_tokens=MAX, tool_choice={"type": "function",
                                                                      "function": {"name": "nope"}})
    with pytest.raises(litellm.BadRequestError, match="response_format"):
        client.generate(MESSAGES, max_tokens=MAX, response_format={"type": "json_schema"})  # no schema
    text = direct(provider)["choices"][0]["message"]["content"]
    final = client.generate(MESSAGES, max_tokens=MAX, stop=[text[3:5]])
    assert final.text == text[:3] and final.finish_reason == "stop"
    stopped = direct(provider, stop=[text[3:5]])
    assert final.usage == _usage(stopped) and final.usage["completion_tokens"] < MAX  # the provider stopped


def test_a_wrong_key_in_code_is_the_providers_401(provider):
    client = SpecClient(mode="api", fallback_model=f"openai/{NAME}",
                        api_kwargs={"api_base": f"{provider.url}/v1", "api_key": "wrong"})
    with pytest.raises(litellm_module().AuthenticationError):
        client.generate(MESSAGES, max_tokens=MAX)


def test_mode_api_needs_a_fallback_model_at_construction(provider):
    with pytest.raises(ValueError, match="set fallback_model"):
        SpecClient(provider.url, mode="api")
    with pytest.raises(ValueError, match="set fallback_model"):
        ChatAgentSpec(base_url=provider.url, mode="api")
    client = SpecClient(provider.url)
    with pytest.raises(ValueError, match="set fallback_model"):
        client.generate(MESSAGES, mode="api")  # a per-call mode is checked the same way
    with pytest.raises(ValueError, match="api_kwargs must not set"):
        SpecClient(provider.url, fallback_model="openai/x", api_kwargs={"stream": False})


def test_chat_agentspec_configures_the_fallback_in_code(provider):
    model = ChatAgentSpec(mode="api", fallback_model=f"openai/{NAME}", fallback_api_base=f"{provider.url}/v1",
                          fallback_api_key=KEY, temperature=1.0, top_p=0.5, max_tokens=MAX)
    ref = direct(provider, temperature=1.0, top_p=0.5, seed=5)
    reply = model.invoke(MESSAGES[0]["content"], seed=5)
    assert reply.content == ref["choices"][0]["message"]["content"]
    assert reply.usage_metadata["input_tokens"] == ref["usage"]["prompt_tokens"]
    assert reply.usage_metadata["output_tokens"] == ref["usage"]["completion_tokens"]
    assert reply.response_metadata["model_name"] == NAME  # the model that answered, not "agentspec"
    chunks = [c for c in model.stream(MESSAGES[0]["content"], seed=5) if c.content]
    assert len(chunks) > 1 and "".join(c.content for c in chunks) == reply.content
    with pytest.raises(ValueError, match="fallback_api_base"):
        ChatAgentSpec(fallback_model="openai/x", api_kwargs={"api_base": "http://x"})


def test_async_chat_agentspec_in_api_mode(provider):
    model = ChatAgentSpec(mode="api", fallback_model=f"openai/{NAME}", fallback_api_base=f"{provider.url}/v1",
                          fallback_api_key=KEY, max_tokens=MAX)
    reply = asyncio.run(model.ainvoke(MESSAGES[0]["content"]))
    assert reply.content == direct(provider)["choices"][0]["message"]["content"]
    assert reply.response_metadata["model_name"] == NAME


def test_a_switch_mid_answer_sums_both_parts_usage(target, provider):
    """The verifier dies mid-answer; the provider continues the committed text. Usage counts both: the
    verifier's prompt and tokens plus what the provider reported for its continuation."""
    with LoopbackServer(target, config()) as verifier:
        client = SpecClient(verifier.url, drafter=ModelDrafter(target), mode="edge", segment_tokens=4,
                            retries=1, timeout=5, fallback_model=f"openai/{NAME}",
                            api_kwargs={"api_base": f"{provider.url}/v1", "api_key": KEY})
        events = []
        for ev in client.stream(MESSAGES, max_tokens=40):
            events.append(ev)
            if len(events) == 2:
                verifier.server.should_exit = True
                verifier.thread.join(timeout=10)
    final = events[-1]
    committed, spoken = len(final.tokens), target.tokenizer.decode(final.tokens, skip_special_tokens=True)
    assert committed >= 1 and [s.mode for s in final.stats.segments][-1] == "api"
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    rest = direct(provider, [*MESSAGES, {"role": "assistant", "content": spoken}], max_tokens=40 - committed)
    assert final.text == spoken + rest["choices"][0]["message"]["content"]
    assert final.usage == {"prompt_tokens": len(prompt) + rest["usage"]["prompt_tokens"],
                           "completion_tokens": committed + rest["usage"]["completion_tokens"],
                           "total_tokens": len(prompt) + committed + rest["usage"]["total_tokens"]}
    assert final.model == NAME  # the provider finished the answer


def test_penalties_and_logprobs_reach_the_provider(provider):
    """Penalties and logprobs go to the provider (its answer and logprobs equal a direct request's);
    logit_bias names the target's token ids, meaningless to another model: refused, not sent."""
    kw = {"presence_penalty": -2.0, "frequency_penalty": -2.0}  # repeat what was said: a visible change
    ref = direct(provider, logprobs=True, top_logprobs=2, **kw)
    final = api_client(provider).generate(MESSAGES, max_tokens=MAX, sampling=SamplingParams(logprobs=2, **kw))
    assert final.text == ref["choices"][0]["message"]["content"] != direct(provider)["choices"][0]["message"]["content"]
    assert [e["token"] for e in final.logprobs] == [e["token"] for e in ref["choices"][0]["logprobs"]["content"]]
    with pytest.raises(ValueError, match="logit_bias"):
        api_client(provider).generate(MESSAGES, max_tokens=MAX, sampling=SamplingParams(logit_bias={5: 1.0}))


def _fails_at(verifier: LoopbackServer, tokens: int, inside: bool) -> None:
    """``verifier`` fails (an error in its engine) once the answer has ``tokens`` tokens: as the segment that
    begins there starts (an HTTP 500), or, ``inside``, within the segment that reaches it (its error line)."""
    rounds = verifier.engine._rounds

    async def failing(session, req):
        if session.num_generated >= tokens:
            raise RuntimeError("the verifier fails here")
        async for reply in rounds(session, req):
            yield reply
            if inside and session.num_generated >= tokens:
                raise RuntimeError("the verifier fails here")

    verifier.engine._rounds = failing


def _reference(target, n: int) -> list[int]:
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    return plain_greedy(target, list(prompt), n)


@pytest.mark.parametrize("inside", [False, True], ids=["as-a-segment-begins", "inside-a-segment"])
def test_a_verifier_failing_mid_answer_hands_all_committed_text_to_the_api(target, provider, inside):
    """The verifier fails after 8 tokens whose text ends in "j", the start of the stop string "j\\n" (the char
    model never writes a newline): the client still holds that "j" back, yet it was committed, so the
    provider continues all 8 tokens' text. The answer is that text + the provider's own continuation of it,
    streamed as such. A failure inside a segment's stream (its error line, after HTTP 200) hands over like
    one as a segment begins (HTTP 500), not as an error for the caller."""
    ref, stop, committed = _reference(target, 40), ["j\n"], 8
    spoken = target.tokenizer.decode(ref[:committed])
    assert spoken.endswith("j") and "\n" not in target.tokenizer.decode(ref)
    with LoopbackServer(target, config()) as verifier:
        _fails_at(verifier, committed, inside)
        client = SpecClient(verifier.url, mode="server-ar", segment_tokens=16 if inside else 4, retries=0,
                            timeout=5, fallback_model=f"openai/{NAME}",
                            api_kwargs={"api_base": f"{provider.url}/v1", "api_key": KEY})
        events = list(client.stream(MESSAGES, max_tokens=40, stop=stop))
    final = events[-1]
    assert final.tokens == ref[:committed] and final.stats.segments[-1].mode == "api"
    assert "VerifierUnavailable" in final.stats.fallbacks[0]
    rest = direct(provider, [*MESSAGES, {"role": "assistant", "content": spoken}], max_tokens=40 - committed,
                  stop=stop)
    assert final.text == spoken + rest["choices"][0]["message"]["content"]
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == final.text


@pytest.mark.parametrize("committed", [0, 8], ids=["before-the-first-round", "mid-answer"])
def test_the_kill_loops_check_of_an_answer_the_api_finished(target, committed):
    """The reliability kill loop's check (``benchmarks/reliability/kill.py``) holds for a call the API took
    over: also when the verifier died before its first round, so nothing was committed and the provider
    answers the conversation itself (no partial answer; an empty one would be a finished, empty turn)."""
    key = kill.PROVIDER_KEY
    with (LoopbackServer(target, config(api_keys=(key,))) as provider,
          LoopbackServer(target, config()) as verifier):
        _fails_at(verifier, committed, inside=False)
        client = SpecClient(verifier.url, mode="server-ar", segment_tokens=4, retries=0, timeout=5,
                            fallback_model="openai/tiny", api_kwargs={"api_base": f"{provider.url}/v1", "api_key": key})
        events = list(client.stream(MESSAGES, max_tokens=40))
        final = events[-1]
        assert len(final.tokens) == committed and final.stats.segments[-1].mode == "api"
        assert kill._api_problem(target, MESSAGES, _reference(target, 40), final, events, provider, 40) is None
