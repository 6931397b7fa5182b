"""The bad-input matrix: every endpoint and field fed wrong types, out-of-range values, deep nesting, odd
tool schemas and ``tool_choice`` shapes, unknown fields, malformed JSON and huge bodies. Each case is
sent once (10 s limit: beyond it a hang); a bystander session is checked after each, and at the end it and
the session the round cases were sent to must still give their exact greedy output. Then schemathesis,
when installed, runs over the served OpenAPI."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from benchmarks.reliability.common import VOCAB, client, finish_rounds, local, log, make_prompt, plain_greedy

PROMPT = make_prompt(0)
MSG = [{"role": "user", "content": "x"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
HANG_S = 10.0


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _tool(parameters: Any) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


ODD_SCHEMAS = {
    "required 5": {"type": "object", "properties": {"a": {"type": "string"}}, "required": 5},
    "required [[1]]": {"type": "object", "properties": {"a": {"type": "string"}}, "required": [[1]]},
    "properties 5": {"type": "object", "properties": 5},
    "type nonsense": {"type": "nonsense"},
    "type a list of numbers": {"type": [1, 2]},
    "400 levels deep": _nested(400),
    "dangling $ref": {"$ref": "#/definitions/nope"},
    "empty enum": {"enum": []},
    "anyOf 5": {"anyOf": 5},
    "bad regex": {"type": "string", "pattern": "("},
    "minLength > maxLength": {"type": "string", "minLength": 9, "maxLength": 1},
    "not an object": [1, 2, 3],
}

TOOL_CHOICES = {
    "function 5": {"function": 5},
    "name a list": {"type": "function", "function": {"name": ["f"]}},
    "a number": 5,
    "a list": ["f"],
    "type only": {"type": "function"},
    "unknown type": {"type": "nope", "function": {"name": "f"}},
    "unknown name": {"type": "function", "function": {"name": "g"}},
    "bad string": "always",
    "name null": {"type": "function", "function": {"name": None}},
}


def _round(**over: Any) -> dict:
    return {"base_len": len(PROMPT), **over}


def _sampled(**draft: Any) -> dict:
    return _round(draft=draft, sampling={"temperature": 1.0})


OPEN = {
    "no prompt": {}, "both prompt and messages": {"prompt_ids": [2, 3], "messages": MSG},
    "empty prompt": {"prompt_ids": []}, "prompt wrong type": {"prompt_ids": "hello"},
    "prompt negative id": {"prompt_ids": [2, -1]}, "prompt id >= vocab": {"prompt_ids": [2, VOCAB]},
    "prompt huge id": {"prompt_ids": [2, 10**30]}, "prompt too long": {"prompt_ids": [2] * 300},
    "prompt ids strings": {"prompt_ids": ["2"]}, "prompt ids booleans": {"prompt_ids": [True, 3]},
    "prompt ids floats": {"prompt_ids": [2.0, 3.5]}, "prompt nested list": {"prompt_ids": [[2, 3]]},
    "max_new_tokens 0": {"prompt_ids": [2], "max_new_tokens": 0},
    "max_new_tokens -5": {"prompt_ids": [2], "max_new_tokens": -5},
    "max_new_tokens string": {"prompt_ids": [2], "max_new_tokens": "5"},
    "max_new_tokens 2**70": {"prompt_ids": [2], "max_new_tokens": 2**70},
    "unknown field": {"prompt_ids": [2, 3], "bogus": 1},
    "messages a string": {"messages": "hi"}, "empty messages": {"messages": []},
    "message not an object": {"messages": [5]}, "message bad role": {"messages": [{"role": "x", "content": "y"}]},
    "stop ids negative": {"prompt_ids": [2], "stop_token_ids": [-3]},
    "stop ids a string": {"prompt_ids": [2], "stop_token_ids": "1"},
    "protocol 99": {"prompt_ids": [2], "protocol_version": 99},
    "add_generation_prompt string": {"messages": MSG, "add_generation_prompt": "yes"},
    "unknown model": {"prompt_ids": [2], "model": "gpt-9"}, "model a number": {"prompt_ids": [2], "model": 5},
    "tools not a list": {"messages": MSG, "tools": {"a": 1}},
    "response_format odd": {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": 5}},
    **{f"tools schema {k}": {"messages": MSG, "tools": [_tool(v)], "max_new_tokens": 8}
       for k, v in ODD_SCHEMAS.items()},
    **{f"tool_choice {k}": {"messages": MSG, "tools": [TOOL], "tool_choice": v} for k, v in TOOL_CHOICES.items()},
}

ROUNDS = {
    "missing base_len": {"draft": {"tokens": [2]}}, "base_len 0": _round(base_len=0),
    "base_len -4": _round(base_len=-4), "base_len huge": _round(base_len=10**12),
    "base_len string": _round(base_len="forty"), "base_len float": _round(base_len=40.5),
    "base_len ahead": _round(base_len=len(PROMPT) + 3),
    "new_tokens >= vocab": _round(new_tokens=[VOCAB + 5]), "new_tokens negative": _round(new_tokens=[-1]),
    "new_tokens a string": _round(new_tokens="ab"),
    "draft too long": _round(draft={"tokens": [2] * 9}), "draft >= vocab": _round(draft={"tokens": [2, VOCAB]}),
    "draft not a list": _round(draft={"tokens": 5}), "draft float ids": _round(draft={"tokens": [2.5]}),
    "draft a list": _round(draft=[2, 3]), "draft unknown field": _round(draft={"tokens": [2], "x": 1}),
    "parents wrong length": _round(draft={"tokens": [2, 3], "parents": [-1]}),
    "parents cycle": _round(draft={"tokens": [2, 3], "parents": [1, 0]}),
    "parents self": _round(draft={"tokens": [2, 3], "parents": [-1, 1]}),
    "parents out of range": _round(draft={"tokens": [2, 3], "parents": [-1, 7]}),
    "parents below root": _round(draft={"tokens": [2], "parents": [-2]}),
    "q on greedy": _round(draft={"tokens": [2], "q": [{"ids": [2], "probs": [1.0]}]}),
    "sampled without q": _round(draft={"tokens": [2]}, sampling={"temperature": 1.0}),
    "q nan": _sampled(tokens=[2], q=[{"ids": [2], "probs": [float("nan")]}]),
    "q inf": _sampled(tokens=[2], q=[{"ids": [2], "probs": [float("inf")]}]),
    "q negative": _sampled(tokens=[2], q=[{"ids": [2, 3], "probs": [0.5, -0.1]}]),
    "q unnormalised": _sampled(tokens=[2], q=[{"ids": [2, 3], "probs": [0.9, 0.9]}]),
    "q misses token": _sampled(tokens=[2], q=[{"ids": [3], "probs": [1.0]}]),
    "q length mismatch": _sampled(tokens=[2, 3], q=[{"ids": [2], "probs": [1.0]}]),
    "q ids >= vocab": _sampled(tokens=[2], q=[{"ids": [2, VOCAB], "probs": [0.5, 0.5]}]),
    "q duplicate ids": _sampled(tokens=[2], q=[{"ids": [2, 2], "probs": [0.5, 0.5]}]),
    "q ids/probs lengths differ": _sampled(tokens=[2], q=[{"ids": [2, 3], "probs": [1.0]}]),
    "temperature -1": _round(sampling={"temperature": -1}), "temperature 1e9": _round(sampling={"temperature": 1e9}),
    "temperature string": _round(sampling={"temperature": "0.5"}), "top_p 0": _round(sampling={"top_p": 0}),
    "top_p 2": _round(sampling={"top_p": 2}), "top_k -2": _round(sampling={"top_k": -2}),
    "seed 2**63": _round(sampling={"seed": 2**63}), "seed -1": _round(sampling={"seed": -1}),
    "unknown sampling field": _round(sampling={"beam": 4}), "sampling a list": _round(sampling=[1]),
    "logit_bias >= vocab": _round(sampling={"logit_bias": {str(VOCAB): 1.0}}),
    "logit_bias not an id": _round(sampling={"logit_bias": {"x": 1.0}}),
    "logit_bias value 1e6": _round(sampling={"logit_bias": {"2": 1e6}}),
    "logprobs 21": _round(sampling={"logprobs": 21}), "penalty 2.5": _round(sampling={"frequency_penalty": 2.5}),
    "unknown field": _round(bogus=True),
}

GENERATE = {
    "mode warp": _round(mode="warp"), "max_new_tokens 0": _round(max_new_tokens=0),
    "num_draft_tokens 99": _round(num_draft_tokens=99), "num_draft_tokens -1": _round(num_draft_tokens=-1),
    "base_len ahead": _round(base_len=len(PROMPT) + 3),
    "new_tokens then refused drafter": _round(new_tokens=[5, 6], mode="server", drafter="model"),
    "drafter unknown": _round(drafter="oracle"), "sampling seed 2**63": _round(sampling={"seed": 2**63}),
    "unknown field": _round(x=1), "new_tokens >= vocab": _round(new_tokens=[VOCAB]),
}

CHAT = {
    "no messages": {"model": "tiny"}, "empty messages": {"messages": []},
    "bad role": {"messages": [{"role": "wizard", "content": "x"}]},
    "message without role": {"messages": [{"content": "x"}]}, "content a number": {"messages": [{"role": "user",
                                                                                                  "content": 5}]},
    "content parts odd": {"messages": [{"role": "user", "content": [{"type": "image", "x": 1}]}]},
    "max_tokens 0": {"messages": MSG, "max_tokens": 0}, "max_tokens string": {"messages": MSG, "max_tokens": "5"},
    "max_tokens 2**70": {"messages": MSG, "max_tokens": 2**70},
    "temperature 3": {"messages": MSG, "temperature": 3}, "top_p 0": {"messages": MSG, "top_p": 0},
    "n 2": {"messages": MSG, "n": 2}, "seed 2**63": {"messages": MSG, "seed": 2**63},
    "stream string": {"messages": MSG, "stream": "yes"}, "stream_options odd": {"messages": MSG, "stream": True,
                                                                                "stream_options": 5},
    "bad tool": {"messages": MSG, "tools": [{"type": "function"}]}, "tools a string": {"messages": MSG, "tools": "f"},
    "required without tools": {"messages": MSG, "tool_choice": "required"},
    "response_format xml": {"messages": MSG, "response_format": {"type": "xml"}},
    "response_format schema 5": {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": 5}},
    **{f"response_format schema {k}": {"messages": MSG, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": v}}} for k, v in ODD_SCHEMAS.items()},
    "too many stops": {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop a number": {"messages": MSG,
                                                                                               "stop": 5},
    "unknown model": {"model": "gpt-9", "messages": MSG}, "unsupported parameter": {"messages": MSG,
                                                                                     "repetition_penalty": 1.2},
    "logit_bias odd": {"messages": MSG, "logit_bias": {"x": "y"}}, "top_logprobs 21": {"messages": MSG,
                                                                                        "logprobs": True,
                                                                                        "top_logprobs": 21},
    **{f"tools schema {k}": {"messages": MSG, "max_tokens": 8, "tools": [_tool(v)]} for k, v in ODD_SCHEMAS.items()},
    **{f"tool_choice {k}": {"messages": MSG, "max_tokens": 8, "tools": [TOOL], "tool_choice": v}
       for k, v in TOOL_CHOICES.items()},
    "tool_choice streamed odd": {"messages": MSG, "stream": True, "tools": [_tool(ODD_SCHEMAS["required 5"])],
                                 "max_tokens": 8, "tool_choice": "required"},
}

COMPLETIONS = {
    "no prompt": {"model": "tiny"}, "empty prompt": {"prompt": ""}, "prompt batch": {"prompt": ["a", "b"]},
    "prompt ids >= vocab": {"prompt": [2, VOCAB]}, "prompt negative ids": {"prompt": [-1]},
    "prompt a number": {"prompt": 5}, "prompt a dict": {"prompt": {"a": 1}}, "max_tokens 0": {"prompt": "a",
                                                                                              "max_tokens": 0},
    "logprobs 6": {"prompt": "a", "logprobs": 6}, "best_of 2": {"prompt": "a", "best_of": 2},
    "echo string": {"prompt": "a", "echo": "yes"}, "seed 2**63": {"prompt": "a", "seed": 2**63},
    "unknown field": {"prompt": "a", "bogus": 1}, "suffix a number": {"prompt": "a", "suffix": 5},
    "prompt too long": {"prompt": [2] * 300},
}

TOKENIZE = {
    "neither": {}, "both": {"prompt": "a", "messages": MSG}, "prompt a number": {"prompt": 5},
    "messages a string": {"messages": "x"}, "tools odd": {"messages": MSG, "tools": 5},
    "unknown field": {"prompt": "a", "x": 1}, "add_generation_prompt string": {"prompt": "a",
                                                                               "add_generation_prompt": "no"},
}

DETOKENIZE = {
    "no tokens": {}, "tokens a string": {"tokens": "ab"}, "negative": {"tokens": [-1]},
    "huge id": {"tokens": [10**30]}, ">= vocab": {"tokens": [VOCAB]}, "floats": {"tokens": [2.5]},
    "booleans": {"tokens": [True]}, "unknown field": {"tokens": [2], "x": 1},
}

MALFORMED = {"not json": b"{not json", "a list": b"[1, 2]", "null": b"null", "bad utf-8": b"\xff\xfe",
             "empty": b"", "nested 5000": b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
             "nested 1000 dicts": b'{"a": ' * 1000 + b"1" + b"}" * 1000, "NaN literal": b'{"prompt_ids": NaN}',
             "huge number": b'{"prompt_ids": [1' + b"0" * 5000 + b"]}", "huge body": json.dumps(
                 {"prompt_ids": [2] * 100_000}).encode(), "duplicate keys": b'{"prompt_ids": [2], "prompt_ids": 5}'}

ENDPOINTS = {
    "/v1/spec/sessions": OPEN, "/v1/spec/sessions/{sid}/rounds": ROUNDS, "/v1/spec/sessions/{sid}/generate": GENERATE,
    "/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, "/tokenize": TOKENIZE, "/detokenize": DETOKENIZE,
}


def cases() -> list[tuple[str, str, bytes]]:
    """(name, path, raw JSON body) for every case (``{sid}``: the round-target session)."""
    out = [(f"{path} {name}", path, json.dumps(body).encode()) for path, table in ENDPOINTS.items()
           for name, body in table.items()]
    out += [(f"{path} malformed {name}", path, body) for path in ENDPOINTS for name, body in MALFORMED.items()]
    return out


def send(c: httpx.Client, path: str, body: bytes, method: str = "POST") -> tuple[int | None, str, float]:
    """(status or None on a hang, body text, seconds); a stream's error line with a 5xx code counts as 500."""
    t0 = time.monotonic()
    try:
        with c.stream(method, path, content=body, headers={"content-type": "application/json"},
                      timeout=httpx.Timeout(HANG_S)) as r:
            text = r.read().decode("utf-8", "replace")
        status = r.status_code
        if status == 200 and "internal_error" in text:
            status = 500
        return status, text, time.monotonic() - t0
    except httpx.TimeoutException:
        return None, "", time.monotonic() - t0


def send_case(c: httpx.Client, path: str, body: bytes, sid: str) -> tuple[int | None, str]:
    """One case; a session it opened after all (e.g. with odd tools) is run in server mode, whose drafting
    reads the tools, then closed: the worse status of the two counts."""
    status, text, _ = send(c, path.format(sid=sid), body)
    if path == "/v1/spec/sessions" and status == 200:
        info = json.loads(text)
        gen = json.dumps({"base_len": info["committed_len"], "mode": "server", "max_new_tokens": 8}).encode()
        status2, text2, _ = send(c, f"/v1/spec/sessions/{info['session_id']}/generate", gen)
        c.delete(f"/v1/spec/sessions/{info['session_id']}")
        if status2 is None or status2 >= 500:
            return status2, "then server-mode generate: " + text2
    return status, text


def run(target) -> dict[str, Any]:
    ref_a, ref_b = plain_greedy(target, PROMPT, 24), plain_greedy(target, make_prompt(5), 24)
    fives, hangs, ok2xx, bystander_lost, statuses = [], [], [], 0, {}
    with local(target, max_draft_tokens=8, max_model_len=256, max_body_bytes=64 * 1024) as srv, \
            client(srv.url, timeout=HANG_S) as c:
        bystander = c.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(5), "max_new_tokens": 24}).json()
        victim = c.post("/v1/spec/sessions", json={"prompt_ids": PROMPT, "max_new_tokens": 24}).json()["session_id"]
        all_cases = cases()
        for name, path, body in all_cases:
            status, text = send_case(c, path, body, victim)
            statuses[name] = status
            if status is None:
                hangs.append(name)
            elif status >= 500:
                fives.append(f"{name}: {status} {text[:160]}")
            elif status < 300:
                ok2xx.append(name)
                if "{sid}" in path:  # it changed the round target: start it afresh
                    victim = c.post("/v1/spec/sessions", json={"prompt_ids": PROMPT,
                                                               "max_new_tokens": 24}).json()["session_id"]
            if c.get(f"/v1/spec/sessions/{bystander['session_id']}").status_code != 200 or \
                    c.get("/health").status_code != 200:
                bystander_lost += 1
        out_b = finish_rounds(c, bystander["session_id"], len(make_prompt(5)))
        out_a = finish_rounds(c, victim, len(PROMPT))
        extra = _paths_and_methods(c)
    log(f"bad input: {len(all_cases)} cases, 5xx {len(fives)}, hangs {len(hangs)}, answered 2xx {len(ok2xx)}")
    for f in fives:
        log("  5xx:", f)
    return {"cases": len(all_cases), "5xx": len(fives), "hangs": len(hangs), "five_xx_cases": fives,
            "hang_cases": hangs, "answered_2xx": ok2xx, "bystander_checks_failed": bystander_lost,
            "bystander_output_identical": out_b == ref_b, "round_target_output_identical": out_a == ref_a,
            "paths_and_methods": extra}


def _paths_and_methods(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/chat/completions")
    return {"HEAD /health": c.head("/health").status_code, "GET /health/": c.get("/health/").status_code,
            "GET /v1/chat/completions": r.status_code, "allow": r.headers.get("allow"),
            "unknown session": c.post("/v1/spec/sessions/s-nope/rounds", json={"base_len": 3}).status_code}


# positive_data_acceptance: data the schema allows may still be refused (token ids past the vocabulary, a
# base_len that does not match the session): the OpenAPI cannot say that. missing_required_header: no key set.
EXCLUDED_CHECKS = ("positive_data_acceptance", "missing_required_header")


def schemathesis_run(target, max_examples: int) -> dict[str, Any]:
    """schemathesis over the served OpenAPI: a failure is a 5xx, a response the schema does not describe,
    or a hang. ``None`` figures when schemathesis is not importable."""
    try:
        import schemathesis
        from schemathesis import checks as st_checks  # noqa: F401
    except ImportError as e:
        return {"failures": None, "why": f"schemathesis not importable: {e}"}
    import subprocess
    import sys
    import tempfile

    with local(target, max_draft_tokens=8, max_model_len=256, max_body_bytes=64 * 1024) as srv:
        cmd = [sys.executable, "-m", "schemathesis.cli", "--no-color", "run", f"{srv.url}/openapi.json",
               "--checks", "all", "--max-examples", str(max_examples), "--request-timeout", str(HANG_S),
               "--exclude-checks", ",".join(EXCLUDED_CHECKS),
               "--suppress-health-check", "all", "-w", "1"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              cwd=tempfile.gettempdir())  # its .schemathesis/ cache stays out of the repo
        wall = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    failures = _count_failures(text) if proc.returncode else 0  # errors (e.g. a hang) count as failures
    log(f"schemathesis: rc {proc.returncode}, failures {failures}, {wall:.0f} s")
    return {"failures": failures, "rc": proc.returncode, "wall_s": round(wall, 1), "version": schemathesis.__version__,
            "excluded_checks": EXCLUDED_CHECKS,
            "command": " ".join(cmd[2:]), "output_tail": text[-3000:]}


def _count_failures(text: str) -> int:
    import re

    fails = re.findall(r"(\d+) unique failures?", text)
    errors = re.findall(r"(\d+) errors?\b", text)
    if not fails and not errors:
        return -1  # a non-zero exit with no summary: see output_tail
    return int((fails or ["0"])[-1]) + int((errors or ["0"])[-1])
