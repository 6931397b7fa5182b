"""The legacy /v1/completions endpoint: the official openai client, string and token-id prompts, echo,
logprobs, streaming, stop strings; identical greedy text with and without server-side speculation."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import EOS, plain_greedy, tiny_model
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration

PROMPT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=5)


@pytest.fixture(scope="module", params=["server-ar", "server"])
def server(request, target):
    with LoopbackServer(target, config(), draft_model=target if request.param == "server" else None) as srv:
        yield srv


def reference(target, ids: list[int], n: int) -> str:
    return target.tokenizer.decode([t for t in plain_greedy(target, ids, n) if t != EOS], skip_special_tokens=True)


def test_openai_client_completion_equals_plain_greedy(server, target):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20)
    ids = target.tokenizer.encode(PROMPT)
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert resp.choices[0].text == reference(target, ids, 20)
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 20
    assert resp.choices[0].finish_reason == "length"
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=20)
    assert by_ids.choices[0].text == resp.choices[0].text


def test_streamed_completion_and_echo(server, target):
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16).choices[0].text
    parts, usage = [], None
    for ch in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, stream=True,
                                        stream_options={"include_usage": True}):
        parts += [c.text for c in ch.choices]
        usage = ch.usage or usage
    assert "".join(parts) == whole and usage.completion_tokens == 16
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, echo=True).choices[0].text
    assert echoed == PROMPT + whole


def test_logprobs_and_stop(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": PROMPT, "max_tokens": 12, "logprobs": 2})
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == len(lp["tokens"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    cut = choice["text"][3:5]
    stopped = httpx.post(server.url + "/v1/completions", timeout=60,
                         json={"prompt": PROMPT, "max_tokens": 12, "stop": [cut]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["text"] == choice["text"][: choice["text"].index(cut)]


@pytest.mark.parametrize("body,param", [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [99999]}, "prompt"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "best_of": 2}, "best_of"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "a", "logprobs": 6}, "logprobs"),
    ({"prompt": "a", "guided_json": {}}, "guided_json"),
    ({"prompt": "a", "model": "gpt-4o"}, "model"),
])
def test_bad_completion_requests_get_a_4xx_naming_the_parameter(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert param in r.json()["error"]["message"]
