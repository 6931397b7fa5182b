"""Every field of every endpoint, fed garbage: each answered with a 4xx that names the problem, and the
server keeps serving (a good session opened before the barrage still produces its exact output)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import VOCAB, make_prompt, plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
PROMPT = make_prompt(0)
GOOD_ROUND = {"base_len": len(PROMPT)}


@pytest.fixture(scope="module")
def server(target):
    with LoopbackServer(target, config(max_draft_tokens=8, max_model_len=256, max_body_bytes=64 * 1024)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def session(client):
    """A good session that must be unaffected by every bad request."""
    info = client.post("/v1/spec/sessions", json={"prompt_ids": PROMPT, "max_new_tokens": 24}).json()
    return info["session_id"]


def _round(**over):
    body = json.loads(json.dumps(GOOD_ROUND))
    for k, v in over.items():
        body[k] = v
    return body


OPEN_CASES = {
    "no prompt": {},
    "both prompt and messages": {"prompt_ids": [2, 3], "messages": [{"role": "user", "content": "x"}]},
    "empty prompt": {"prompt_ids": []},
    "prompt wrong type": {"prompt_ids": "hello"},
    "prompt negative id": {"prompt_ids": [2, -1]},
    "prompt id >= vocab": {"prompt_ids": [2, VOCAB]},
    "prompt huge id": {"prompt_ids": [2, 10**30]},
    "prompt too long": {"prompt_ids": [2] * 300},
    "max_new_tokens zero": {"prompt_ids": [2, 3], "max_new_tokens": 0},
    "max_new_tokens negative": {"prompt_ids": [2, 3], "max_new_tokens": -5},
    "max_new_tokens string": {"prompt_ids": [2, 3], "max_new_tokens": "many"},
    "unknown field": {"prompt_ids": [2, 3], "bogus": 1},
    "messages not a list": {"messages": "hi"},
    "empty messages": {"messages": []},
    "stop ids negative": {"prompt_ids": [2, 3], "stop_token_ids": [-3]},
    "wrong protocol version": {"prompt_ids": [2, 3], "protocol_version": 99},
    "prompt ids as strings": {"prompt_ids": ["2", "3"]},
    "prompt ids as booleans": {"prompt_ids": [True, 3]},
    "max_new_tokens as a numeric string": {"prompt_ids": [2, 3], "max_new_tokens": "5"},
}

ROUND_CASES = {
    "missing base_len": {"draft": {"tokens": [2]}},
    "base_len zero": _round(base_len=0),
    "base_len negative": _round(base_len=-4),
    "base_len huge": _round(base_len=10**12),
    "base_len string": _round(base_len="forty"),
    "new_tokens id >= vocab": _round(new_tokens=[VOCAB + 5]),
    "new_tokens negative": _round(new_tokens=[-1]),
    "draft too long": _round(draft={"tokens": [2] * 9}),
    "draft id >= vocab": _round(draft={"tokens": [2, VOCAB]}),
    "draft not a list": _round(draft={"tokens": 5}),
    "draft float ids": _round(draft={"tokens": [2.5]}),
    "parents wrong length": _round(draft={"tokens": [2, 3], "parents": [-1]}),
    "parents cycle": _round(draft={"tokens": [2, 3], "parents": [1, 0]}),
    "parents self": _round(draft={"tokens": [2, 3], "parents": [-1, 1]}),
    "parents out of range": _round(draft={"tokens": [2, 3], "parents": [-1, 7]}),
    "parents below root": _round(draft={"tokens": [2], "parents": [-2]}),
    "q on greedy round": _round(draft={"tokens": [2], "q": [{"ids": [2], "probs": [1.0]}]}),
    "sampled without q": _round(draft={"tokens": [2]}, sampling={"temperature": 1.0}),
    "q nan": _round(draft={"tokens": [2], "q": [{"ids": [2], "probs": [float("nan")]}]},
                    sampling={"temperature": 1.0}),
    "q negative": _round(draft={"tokens": [2], "q": [{"ids": [2, 3], "probs": [0.5, -0.1]}]},
                         sampling={"temperature": 1.0}),
    "q unnormalised": _round(draft={"tokens": [2], "q": [{"ids": [2, 3], "probs": [0.9, 0.9]}]},
                             sampling={"temperature": 1.0}),
    "q misses drafted token": _round(draft={"tokens": [2], "q": [{"ids": [3], "probs": [1.0]}]},
                                     sampling={"temperature": 1.0}),
    "q length mismatch": _round(draft={"tokens": [2, 3], "q": [{"ids": [2], "probs": [1.0]}]},
                                sampling={"temperature": 1.0}),
    "q ids >= vocab": _round(draft={"tokens": [2], "q": [{"ids": [2, VOCAB], "probs": [0.5, 0.5]}]},
                             sampling={"temperature": 1.0}),
    "q duplicate ids": _round(draft={"tokens": [2], "q": [{"ids": [2, 2], "probs": [0.5, 0.5]}]},
                              sampling={"temperature": 1.0}),
    "temperature negative": _round(sampling={"temperature": -1}),
    "temperature huge": _round(sampling={"temperature": 1e9}),
    "top_p zero": _round(sampling={"top_p": 0}),
    "top_k negative": _round(sampling={"top_k": -2}),
    "unknown sampling field": _round(sampling={"beam": 4}),
    "logit_bias id >= vocab": _round(sampling={"logit_bias": {str(VOCAB): 1.0}}),
    "logit_bias not an id": _round(sampling={"logit_bias": {"x": 1.0}}),
    "logprobs > 20": _round(sampling={"logprobs": 21}),
    "penalty out of range": _round(sampling={"frequency_penalty": 2.5}),
    "temperature as a string": _round(sampling={"temperature": "0.5"}),
}

CHAT_CASES = {
    "no messages": {"model": "tiny"},
    "empty messages": {"messages": []},
    "bad role": {"messages": [{"role": "wizard", "content": "x"}]},
    "message without role": {"messages": [{"content": "x"}]},
    "max_tokens zero": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    "temperature > 2": {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
    "n = 2": {"messages": [{"role": "user", "content": "x"}], "n": 2},
    "bad tool": {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    "tool_choice unknown name": {"messages": [{"role": "user", "content": "x"}],
                                 "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                 "tool_choice": {"type": "function", "function": {"name": "g"}}},
    "tool_choice bad string": {"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"},
    "required without tools": {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
    "bad response_format": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
    "too many stops": {"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]},
    "unknown model": {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
    "seed >= 2**63": {"messages": [{"role": "user", "content": "x"}], "seed": 2**63},
    "tool_choice function not an object": {"messages": [{"role": "user", "content": "x"}],
                                           "tools": [{"type": "function", "function": {"name": "f"}}],
                                           "tool_choice": {"function": 5}},
    "tool_choice name a list": {"messages": [{"role": "user", "content": "x"}],
                                "tools": [{"type": "function", "function": {"name": "f"}}],
                                "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "stream as a string": {"messages": [{"role": "user", "content": "x"}], "stream": "yes"},
    "max_tokens as a string": {"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
    "unsupported parameter": {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.2},
}


def _still_serving(client, session):
    r = client.get(f"/v1/spec/sessions/{session}")
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200


def _assert_4xx(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"] and isinstance(err["message"], str)


@pytest.mark.parametrize("case", sorted(OPEN_CASES))
def test_open_session_rejects(client, session, case):
    r = client.post("/v1/spec/sessions", json=OPEN_CASES[case])
    _assert_4xx(r)
    _still_serving(client, session)


@pytest.mark.parametrize("case", sorted(ROUND_CASES))
def test_round_rejects(client, session, case):
    body = json.dumps(ROUND_CASES[case])  # allow_nan: the NaN case must reach the server as JSON's NaN
    r = client.post(f"/v1/spec/sessions/{session}/rounds", content=body, headers={"content-type": "application/json"})
    _assert_4xx(r)
    _still_serving(client, session)


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_chat_rejects(server, client, session, case):
    open_before = server.engine.store.num_open()
    r = client.post("/v1/chat/completions", json=CHAT_CASES[case])
    _assert_4xx(r)
    _still_serving(client, session)
    assert server.engine.store.num_open() == open_before  # a refused request leaves no session behind


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"null", b"\xff\xfe", b""])
@pytest.mark.parametrize("path", ["/v1/spec/sessions", "/v1/spec/sessions/{sid}/rounds", "/v1/chat/completions",
                                  "/v1/spec/sessions/{sid}/generate"])
def test_malformed_json(client, session, body, path):
    r = client.post(path.format(sid=session), content=body, headers={"content-type": "application/json"})
    _assert_4xx(r)
    _still_serving(client, session)


def test_deeply_nested_json_is_a_400(client, session):
    r = client.post("/v1/chat/completions", content=b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    _still_serving(client, session)


def test_tiny_top_p_keeps_the_most_likely_token(client, session):
    """top_p below float32's range used to mask every token (multinomial on NaNs: a 500)."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "temperature": 1.0, "top_p": 1e-300, "max_tokens": 4})
    greedy = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    _still_serving(client, session)


def test_paths_and_methods(client):
    assert client.head("/health").status_code == 200
    assert client.get("/health/").status_code == 404  # no redirect to follow
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = client.options("/v1/spec/sessions/s-x")  # two routes (GET, DELETE) on one path: both named
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"


def test_huge_body_is_413(client, session):
    r = client.post("/v1/spec/sessions", json={"prompt_ids": [2] * 100_000})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    _still_serving(client, session)


def test_unknown_session_and_generate_bad_fields(client, session):
    r = client.post("/v1/spec/sessions/s-nope/rounds", json=GOOD_ROUND)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    for body in ({"base_len": len(PROMPT), "mode": "warp"}, {"base_len": len(PROMPT), "max_new_tokens": 0},
                 {"base_len": len(PROMPT), "max_rounds": 0}, {"base_len": len(PROMPT), "max_rounds": "few"},
                 {"base_len": len(PROMPT), "num_draft_tokens": 99}, {"base_len": len(PROMPT) + 3},
                 # refused after new_tokens would have been appended: the session must not keep them
                 {"base_len": len(PROMPT), "new_tokens": [5, 6], "mode": "server", "drafter": "model"}):
        _assert_4xx(client.post(f"/v1/spec/sessions/{session}/generate", json=body))
    _still_serving(client, session)


def test_good_session_kept_its_tokens(client, session, target):
    """After the whole barrage (module order: this runs last), the good session gives the exact output."""
    tokens: list[int] = []
    while True:
        r = client.post(f"/v1/spec/sessions/{session}/rounds", json={"base_len": len(PROMPT) + len(tokens)})
        assert r.status_code == 200, r.text
        tokens += r.json()["tokens"]
        if r.json()["finished"]:
            break
    assert tokens == plain_greedy(target, PROMPT, 24)


ODD_SCHEMAS = {"required 5": {"type": "object", "required": 5}, "required [[1]]": {"required": [[1]]},
               "type a list of numbers": {"type": [1, 2]}, "not an object": 5}


@pytest.mark.parametrize("case", sorted(ODD_SCHEMAS))
def test_odd_schemas_are_400s_everywhere(client, session, case):
    """Valid JSON that is not a JSON Schema, in tools or response_format, on every door: a 400 naming
    where it is, never a session whose server-mode rounds then fail with a 500."""
    bad = ODD_SCHEMAS[case]
    tools = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}}
    msgs = [{"role": "user", "content": "x"}]
    for path, body, where in [("/v1/spec/sessions", {"prompt_ids": [2, 3], "tools": tools}, "tools[0]"),
                              ("/v1/spec/sessions", {"prompt_ids": [2, 3], "response_format": rf}, "response_format"),
                              ("/v1/chat/completions", {"messages": msgs, "tools": tools}, "tools[0]"),
                              ("/v1/chat/completions", {"messages": msgs, "response_format": rf}, "response_format")]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and where in r.json()["error"]["message"], (path, r.text)
    _still_serving(client, session)


def test_a_schema_the_grammar_cannot_read_only_disables_grammar_drafts(client, session):
    """A valid schema the grammar builder does not handle still decodes (no grammar drafts, lossless)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/nowhere"}}}}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                  "max_tokens": 4})
    assert r.status_code == 200, r.text
    _still_serving(client, session)
