"""The served OpenAPI describes the real API: every POST's body, the 4xx/5xx errors in the OpenAI envelope,
the non-JSON media types, and only references that resolve — so clients generated from it can call it."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served(target):
    with LoopbackServer(target, config()) as srv:
        yield srv


@pytest.fixture(scope="module")
def spec(served):
    return httpx.get(served.url + "/openapi.json", timeout=30).json()


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_every_post_declares_its_body_and_errors(spec):
    posts = {p: ops["post"] for p, ops in spec["paths"].items() if "post" in ops}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/spec/sessions", "/tokenize"} <= set(posts)
    for path, op in posts.items():
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/"), path
        assert {"400", "401", "503"} <= set(op["responses"]) and "422" not in op["responses"], path


def test_references_resolve_and_media_types_are_real(spec):
    schemas = spec["components"]["schemas"]
    for ref in _refs(spec):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    chat = schemas["ChatRequest"]["properties"]
    assert {"messages", "tools", "logprobs", "logit_bias"} <= set(chat)
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    gen = spec["paths"]["/v1/spec/sessions/{session_id}/generate"]["post"]["responses"]["200"]["content"]
    assert "application/x-ndjson" in gen
    assert "get" in spec["paths"]["/health"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_events_match_the_declared_event_schema(spec, served, path):
    """Each server-sent event of a real stream, as an SSE parser sees it ({"data": ...}), is valid for the
    schema the document gives the text/event-stream answer (schemathesis checks streams this way)."""
    import jsonschema

    schema = spec["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    body = {"max_tokens": 4, "stream": True, **({"prompt": "hi"} if path == "/v1/completions" else
                                                  {"messages": [{"role": "user", "content": "hi"}]})}
    with httpx.stream("POST", served.url + path, json=body, timeout=60) as r:
        events = [{"data": line[len("data: "):]} for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2 and events[-1] == {"data": "[DONE]"}
    for event in events:
        jsonschema.validate(event, schema)
