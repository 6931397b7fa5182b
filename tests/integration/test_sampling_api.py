"""/v1/chat/completions and the session API honour logprobs, top_logprobs, logit_bias, presence/frequency
penalties, top_k and parallel_tool_calls, or refuse a parameter by name — never accept one and ignore it.

Greedy outputs under penalties are the same in server mode (the target drafting for itself) and server-ar
(plain decoding): the processing is a function of each position's prefix, so speculation stays lossless.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from agentspec.toolcalls import add_instruction, tool_choice_instruction
from tests.helpers import EOS, tiny_model
from tests.integration.server import LoopbackServer, config
from tests.integration.test_openai_api import TOOLS, _memorise

pytestmark = pytest.mark.integration

MSGS = [{"role": "user", "content": "tell me something"}]


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def servers(target):
    with LoopbackServer(target, config()) as plain, LoopbackServer(target, config(), draft_model=target) as spec:
        yield plain, spec


def chat(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 24, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def content(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_logprobs_are_the_targets_own(servers, target):
    plain, _ = servers
    body = chat(plain.url, logprobs=True, top_logprobs=3)
    entries = body["choices"][0]["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == content(body)
    assert all(len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"] - 1e-6
               for e in entries)
    prompt = httpx.post(plain.url + "/tokenize", json={"messages": MSGS}, timeout=60).json()["tokens"]
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt], device=target.device)).logits[0, -1]
    first = torch.log_softmax(logits.float(), dim=-1).max()
    assert entries[0]["logprob"] == pytest.approx(float(first), abs=1e-4)  # greedy: the argmax's logprob
    assert chat(plain.url)["choices"][0]["logprobs"] is None


def test_streamed_logprobs_match_the_aggregate(servers):
    _, spec = servers
    whole = chat(spec.url, logprobs=True, top_logprobs=1)["choices"][0]["logprobs"]["content"]
    streamed = []
    with httpx.stream("POST", spec.url + "/v1/chat/completions", timeout=60,
                      json={"messages": MSGS, "max_tokens": 24, "stream": True, "logprobs": True,
                            "top_logprobs": 1}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                streamed += ((choices[0].get("logprobs") or {}).get("content") or []) if choices else []
    assert [e["token"] for e in streamed] == [e["token"] for e in whole]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in whole], abs=1e-5)


def test_penalties_and_bias_change_the_answer_identically_in_every_mode(servers, target):
    plain, spec = servers
    first = httpx.post(plain.url + "/tokenize", json={"prompt": content(chat(plain.url))}, timeout=60).json()
    processing = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "logit_bias": {str(first["tokens"][0]): -100}}
    outs = [content(chat(s.url, **processing)) for s in (plain, spec)]
    assert outs[0] == outs[1]
    assert outs[0] != content(chat(plain.url))
    assert target.tokenizer.decode([first["tokens"][0]]) != outs[0][:1]  # the banned token never comes first


def test_top_k_one_samples_the_greedy_answer(servers):
    plain, spec = servers
    greedy = content(chat(plain.url))
    assert {content(chat(s.url, temperature=1.0, top_k=1, seed=seed)) for s in (plain, spec)
            for seed in (1, 2, 3)} == {greedy}


def test_session_api_returns_logprobs(servers):
    plain, _ = servers
    c = httpx.Client(base_url=plain.url, timeout=60)
    info = c.post("/v1/spec/sessions", json={"prompt_ids": [5, 6, 7, 8], "max_new_tokens": 6}).json()
    r = c.post(f"/v1/spec/sessions/{info['session_id']}/rounds",
               json={"base_len": 4, "draft": {"tokens": []}, "sampling": {"logprobs": 2}})
    reply = r.json()
    assert r.status_code == 200, reply
    assert [x["token"] for x in reply["logprobs"]] == reply["tokens"] and len(reply["logprobs"][0]["top"]) == 2


@pytest.mark.parametrize("body,param", [
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"min_p": 0.1, "best_of": 2}, "best_of"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 300}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"n": 2}, "n"),
])
def test_unsupported_or_bad_parameters_get_a_400_naming_them(servers, body, param):
    plain, _ = servers
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MSGS, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


def test_parallel_tool_calls_false_stops_after_the_first_call():
    """A target that answers with two calls; with parallel_tool_calls=False the answer ends at the first."""
    t = tiny_model(seed=11, layers=2)
    ask = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    single = add_instruction(ask, tool_choice_instruction(None, single=True))
    calls = "".join(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}</tool_call>'
                    for c in ("Paris", "Rome"))
    prompt = t.tokenizer.apply_chat_template(single, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    _memorise(t.model, list(prompt) + t.tokenizer.encode(calls, add_special_tokens=False) + [EOS], len(prompt),
              steps=500)
    with LoopbackServer(t, config()) as srv:
        def ask_for(messages, **kw):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                           json={"messages": messages, "tools": TOOLS, "max_tokens": 200, **kw})
            return r.json()["choices"][0]

        both = ask_for(single)  # the same prompt, parallel calls allowed: the target makes two
        assert [json.loads(c["function"]["arguments"])["city"] for c in both["message"]["tool_calls"]] == \
            ["Paris", "Rome"]
        one = ask_for(ask, parallel_tool_calls=False)
        assert len(one["message"]["tool_calls"]) == 1 and one["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("rf", [{"type": "json_object"},
                                {"type": "json_schema", "json_schema": {"name": "city", "schema": {
                                    "type": "object", "properties": {"city": {"type": "string"}}}}}])
def test_response_format_is_shown_to_the_model_and_enforced(servers, rf):
    """The instruction is in the prompt and the grammar decides the form: even a random tiny target answers
    with JSON valid for the schema, in both servers (plain and speculative) alike."""
    import jsonschema

    plain, spec = servers
    bare, asked = chat(plain.url), chat(plain.url, response_format=rf, max_tokens=200)
    assert asked["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"]  # the instruction is in the prompt
    assert asked["agentspec"]["structure"] == "enforced" and bare["agentspec"]["structure"] is None
    text = content(asked)
    assert text.startswith("{") and content(chat(spec.url, response_format=rf, max_tokens=200)) == text
    if asked["choices"][0]["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), rf.get("json_schema", {}).get("schema", {"type": "object"}))


PROCESSING = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "logit_bias": {"70": -100.0}}


@pytest.mark.parametrize("mode", ["server-ar", "server", "edge"])
def test_chat_agentspec_honours_the_sampling_fields_in_every_mode(servers, mode):
    """The same processed answer and the target's logprobs through ChatAgentSpec as from the endpoint,
    edge mode (the client's n-gram drafts verified under the processing) included."""
    from agentspec.adapters.langchain import ChatAgentSpec
    from agentspec.drafters import NgramDrafter

    plain, spec = servers
    want = chat(plain.url, logprobs=True, top_logprobs=2, **PROCESSING)
    llm = ChatAgentSpec(model="tiny", base_url=spec.url, max_tokens=24, mode=mode,
                        drafter=NgramDrafter() if mode == "edge" else None,
                        logit_bias={70: -100.0}, logprobs=True, top_logprobs=2)
    msg = llm.invoke(MSGS[0]["content"], presence_penalty=1.2, frequency_penalty=0.8)
    assert msg.content == content(want)
    got = msg.response_metadata["logprobs"]["content"]
    assert [e["token"] for e in got] == [e["token"] for e in want["choices"][0]["logprobs"]["content"]]
    assert [e["logprob"] for e in got] == pytest.approx(
        [e["logprob"] for e in want["choices"][0]["logprobs"]["content"]], abs=1e-4)


def test_litellm_provider_honours_the_sampling_fields(servers):
    from agentspec.adapters import litellm as adapter

    adapter.register()
    plain, _ = servers
    want = chat(plain.url, logprobs=True, top_logprobs=1, **PROCESSING)
    resp = adapter.litellm.completion(model="agentspec/tiny", api_base=plain.url, messages=MSGS, max_tokens=24,
                                      logprobs=True, top_logprobs=1, timeout=60, **PROCESSING)
    assert resp.choices[0].message.content == content(want)
    assert [e["token"] for e in resp.choices[0].logprobs["content"]] == \
        [e["token"] for e in want["choices"][0]["logprobs"]["content"]]
    with pytest.raises(adapter.litellm.BadRequestError, match="repetition_penalty"):
        adapter.litellm.completion(model="agentspec/tiny", api_base=plain.url, messages=MSGS, max_tokens=4,
                                   repetition_penalty=1.1, timeout=60)


def test_openai_client_reads_logprobs(servers):
    from openai import OpenAI

    plain, _ = servers
    client = OpenAI(base_url=plain.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))
    resp = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, logprobs=True, top_logprobs=2,
                                          presence_penalty=0.5, extra_body={"top_k": 5})
    entries = resp.choices[0].logprobs.content
    assert "".join(e.token for e in entries) == resp.choices[0].message.content
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
