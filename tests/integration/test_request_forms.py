"""Requests as users write them, through every surface against one real loopback verifier (issue 21):
the model name is sent and checked, content may be a list of parts, base URLs may end in ``/v1``."""

from __future__ import annotations

import httpx
import pytest
from langchain_core.messages import HumanMessage

from agentspec.adapters import ChatAgentSpec
from agentspec.adapters.langchain_errors import VerifierNotFoundError
from agentspec.client import SpecClient
from agentspec.transport import ModelNotServed
from tests.integration.server import ALIAS, LoopbackServer, config

pytestmark = pytest.mark.integration
SAY = "Say hi."
TEXT = [{"role": "user", "content": SAY}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": SAY}]}]
PNG = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
IMAGE = [{"role": "user", "content": [{"type": "text", "text": SAY}, PNG]}]
MAX = 8


@pytest.fixture(scope="module")
def srv(target):
    with LoopbackServer(target, config()) as s:
        yield s


@pytest.fixture(scope="module")
def litellm_mod():
    from agentspec.adapters import litellm as adapter

    adapter.register()
    return adapter.litellm


@pytest.fixture(scope="module")
def answer(srv) -> str:
    """The reference: SpecClient, plain string content, the verifier's own URL and name."""
    client = SpecClient(srv.url, mode="server-ar")
    try:
        text = client.generate(TEXT, max_tokens=MAX).text
        assert text  # the comparisons below mean something
        return text
    finally:
        client.close()


def _spec(url: str, messages: list[dict], **kw) -> str:
    client = SpecClient(url, mode="server-ar", retries=0)
    try:
        return client.generate(messages, max_tokens=MAX, **kw).text
    finally:
        client.close()


def _chat(**kw) -> ChatAgentSpec:
    return ChatAgentSpec(**{"mode": "server-ar", "max_tokens": MAX, "max_retries": 0, **kw})


def _lite(litellm_mod, url: str, messages: list[dict], name: str = "tiny"):
    return litellm_mod.completion(model=f"agentspec/{name}", api_base=url, messages=messages, max_tokens=MAX,
                                  timeout=60)


def _openai(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv.url + "/v1", api_key="unused", http_client=httpx.Client(timeout=60))


# -- 1. the model name is sent with every request and checked by the verifier -------------------------


def test_unknown_model_is_refused_by_every_client(srv, litellm_mod):
    with pytest.raises(ModelNotServed, match="'tiny'") as e:
        _spec(srv.url, TEXT, model="gpt-4o")
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(VerifierNotFoundError, match="gpt-4o"):
        _chat(model="gpt-4o", base_url=srv.url).invoke(SAY)
    with pytest.raises(litellm_mod.NotFoundError, match="gpt-4o"):
        _lite(litellm_mod, srv.url, TEXT, "gpt-4o")


def test_served_names_and_the_default_still_answer(srv, litellm_mod, answer):
    for name in ("tiny", ALIAS):
        reply = _chat(model=name, base_url=srv.url).invoke(SAY)
        assert reply.content == answer and reply.response_metadata["model_name"] == name
        resp = _lite(litellm_mod, srv.url, TEXT, name)
        assert resp.choices[0].message.content == answer and resp.model == name
    assert _chat(base_url=srv.url).invoke(SAY).content == answer  # no name given: the verifier's own


# -- 2. content as a list of parts ---------------------------------------------------------------------


def test_text_parts_work_on_every_surface(srv, litellm_mod, answer):
    resp = _openai(srv).chat.completions.create(model="tiny", messages=PARTS, max_tokens=MAX)
    assert resp.choices[0].message.content == answer
    assert _spec(srv.url, PARTS) == answer
    blocks = HumanMessage([{"type": "text", "text": SAY}])
    assert _chat(model="tiny", base_url=srv.url).invoke([blocks]).content == answer
    assert _lite(litellm_mod, srv.url, PARTS).choices[0].message.content == answer


def test_text_parts_are_joined_by_newlines(srv):
    two = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        ids = [http.post("/v1/spec/sessions", json={"messages": m}).json()["prompt_ids"]
               for m in (two, [{"role": "user", "content": "a\nb"}])]
    assert ids[0] == ids[1]


def test_non_text_parts_are_refused_by_name(srv, litellm_mod):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match=r"messages\[0\].*'image_url'"):
        _openai(srv).chat.completions.create(model="tiny", messages=IMAGE, max_tokens=MAX)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        r = http.post("/v1/spec/sessions", json={"messages": [{"role": "system", "content": "x"}, *IMAGE]})
    assert r.status_code == 400 and "messages[1]" in r.text and "'image_url'" in r.text
    with pytest.raises(litellm_mod.BadRequestError, match="image_url"):
        _lite(litellm_mod, srv.url, IMAGE)
    with pytest.raises(ValueError, match=r"messages\[0\].*'image_url'"):  # SpecClient: before any request
        _spec(srv.url, IMAGE)


# -- 3. base URLs as OpenAI users write them -------------------------------------------------------------


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_base_url_may_end_in_v1(srv, litellm_mod, answer, suffix):
    url = srv.url + suffix
    assert _spec(url, TEXT) == answer
    assert _chat(model="tiny", base_url=url).invoke(SAY).content == answer
    assert _lite(litellm_mod, url, TEXT).choices[0].message.content == answer


def test_tokenize_detokenize_version_and_model_endpoints(srv, target):
    """Item 8: the endpoints OpenAI-style and vLLM-style clients expect (all 404 on d3a7899)."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post("/tokenize", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["tokens"] == target.tokenizer.encode("hello", add_special_tokens=False)
        assert r.json()["count"] == 5 and r.json()["max_model_len"] > 0
        assert c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"] == "hello"
        rendered = c.post("/tokenize", json={"messages": PARTS}).json()
        opened = c.post("/v1/spec/sessions", json={"messages": TEXT}).json()
        assert rendered["tokens"] == opened["prompt_ids"]  # what a chat request really sends
        for bad in ({"prompt": "a", "messages": TEXT}, {}, {"tokens": [10**9]}):
            path = "/detokenize" if "tokens" in bad else "/tokenize"
            assert c.post(path, json=bad).status_code == 400
        assert c.get("/version").json()["version"]
        assert c.get("/v1/models/tiny").json()["id"] == "tiny"
        assert c.get(f"/v1/models/{ALIAS}").status_code == 200
        assert c.get("/v1/models/gpt-9").json()["error"]["code"] == "model_not_found"


def test_langchain_counts_tokens_with_the_targets_tokenizer(srv, target):
    """Item 7: get_num_tokens used to fetch GPT-2's tokenizer from the hub (minutes offline, then 0)."""
    from langchain_core.messages import AIMessage, SystemMessage, trim_messages

    model = ChatAgentSpec(base_url=srv.url, mode="server-ar")
    assert model.get_num_tokens("hello world") == len(target.tokenizer.encode("hello world",
                                                                               add_special_tokens=False))
    history = [SystemMessage("be brief"), HumanMessage("x" * 40), AIMessage("y" * 40), HumanMessage(SAY)]
    full = model.get_num_tokens_from_messages(history)
    assert full > 80
    kept = trim_messages(history, max_tokens=full - 30, token_counter=model, strategy="last", include_system=True)
    assert kept[0] == history[0] and kept[-1] == history[-1] and len(kept) < len(history)
