"""Isolation and transactional rounds, on an in-process verifier.

* poisoned tenant: key A sends the whole bad-input matrix and a session flood while key B streams
  ``/generate`` and chat; B must see no error, output identical to its reference, and keep its idle session;
* rollback: faults injected inside a round (before the forward pass, after it, in commit before and after
  it wrote, in server drafting, a refused request after ``new_tokens``, a client gone mid-stream, a bad
  sampled draft); afterwards the session must continue exactly as a fresh reference does — greedy,
  seeded-sampled (the RNG must be put back too) and a JSON-schema answer in server mode (the grammar's
  state, the copy index and the drafters' caches too).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from typing import Any

import httpx

from agentspec.verifier_server import engine as engine_mod
from benchmarks.reliability import badinput
from benchmarks.reliability.common import (
    chat,
    client,
    finish_rounds,
    local,
    log,
    make_prompt,
    open_session,
    plain_greedy,
    stream_generate,
)

KEYS = ("key-a", "key-b")


def cross_tenant(target, duration_s: float) -> dict[str, Any]:
    """Key A attacks for ``duration_s`` (at least one pass over the matrix) while key B streams."""
    prompts = [make_prompt(30 + i, 30) for i in range(3)]
    refs = [plain_greedy(target, p, 48) for p in prompts]
    messages = [[{"role": "user", "content": f"tell me about {w}"}] for w in ("cats", "ships", "rain")]
    with local(target, api_keys=KEYS, max_sessions=16, max_draft_tokens=8, max_model_len=256,
               max_body_bytes=64 * 1024) as srv, client(srv.url, KEYS[0], 10) as a, client(srv.url, KEYS[1]) as b:
        chat_refs = [chat(b, m, 32, stream=False) for m in messages]
        idle = make_prompt(40, 30)
        idle_sid = open_session(b, idle, 24)
        a_sid = open_session(a, make_prompt(0), 24)
        stop, errors, mismatches, b_runs = threading.Event(), [], [], [0]

        def tenant_b() -> None:
            i = 0
            while not stop.is_set():
                try:
                    if i % 2 == 0:
                        got, want = stream_generate(b, prompts[i // 2 % 3], 48), refs[i // 2 % 3]
                    else:
                        got, want = chat(b, messages[i // 2 % 3], 32, stream=True), chat_refs[i // 2 % 3]
                    if got != want:
                        mismatches.append(f"run {i}: {got!r} != {want!r}")
                except Exception as e:  # any error B sees is a cross-tenant failure
                    errors.append(f"run {i}: {e}")
                i += 1
                b_runs[0] += 1

        threads = [threading.Thread(target=tenant_b, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        t0, a_requests, a_5xx, passes = time.monotonic(), 0, 0, 0
        while passes == 0 or time.monotonic() - t0 < duration_s:
            for _name, path, body in badinput.cases():
                status, _ = badinput.send_case(a, path, body, a_sid)
                a_requests += 1
                a_5xx += status is None or status >= 500
            for i in range(48):  # the flood: 3x max_sessions sessions, left idle
                a.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(100 + i, 60), "max_new_tokens": 4})
                a.post("/v1/chat/completions", json={"messages": badinput.MSG, "seed": 2**63})
                a_requests += 2
            a_sid = a.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(0), "max_new_tokens": 24}
                           ).json().get("session_id", a_sid)
            passes += 1
        stop.set()
        for t in threads:
            t.join(120)
        idle_alive = b.get(f"/v1/spec/sessions/{idle_sid}").status_code == 200
        idle_ok = idle_alive and finish_rounds(b, idle_sid, len(idle)) == plain_greedy(target, idle, 24)
        evictions_total = srv.engine.store.evictions
    out = {"b_errors": len(errors) + len(mismatches), "b_error_samples": (errors + mismatches)[:5],
           "b_runs": b_runs[0], "b_idle_session_evicted": int(not idle_alive), "b_idle_session_identical": idle_ok,
           "a_requests": a_requests, "a_5xx_or_hang": a_5xx, "a_passes": passes, "evictions_total": evictions_total,
           "wall_s": round(time.monotonic() - t0, 1)}
    log(f"cross-tenant: B runs {b_runs[0]}, B errors {out['b_errors']}, B idle session evicted "
        f"{out['b_idle_session_evicted']}, A sent {a_requests} ({a_5xx} 5xx/hangs)")
    return out


# ---- rollback ------------------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


@contextmanager
def patched(obj: Any, name: str, make):
    """Replace ``obj.name`` with ``make(original)`` for the block."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))
    try:
        yield
    finally:
        setattr(obj, name, original)


def once(original, before: bool):
    """``original``, except that its first call raises (before or after doing its work)."""
    fired = [False]

    def wrapper(*args: Any, **kw: Any) -> Any:
        if not fired[0]:
            fired[0] = True
            if before:
                raise Boom("injected before")
            original(*args, **kw)
            raise Boom("injected after")
        return original(*args, **kw)
    return wrapper


class FailingDrafter:
    """A server-mode drafter that raises on its first proposal (as a grammar engine may on odd input)."""

    name, drafts_forced = "failing", False

    def propose(self, ctx, k):
        raise Boom("injected in drafting")

    def reset(self):
        pass


STAGES = {
    "before forward": (engine_mod, "round_inputs", True),
    "after forward": (engine_mod.models, "forward", False),
    "in commit, before it writes": (engine_mod, "commit_round", True),
    "in commit, after it wrote": (engine_mod, "commit_round", False),
}


def _wrong_drafts(ref: list[int]) -> list[int]:
    """The reference with every 4th token wrong: drafts of 8 are partly accepted, partly rejected."""
    return [(t + 1) % 90 + 2 if i % 4 == 3 else t for i, t in enumerate(ref)]


def _greedy_fault(srv, c: httpx.Client, target, stage: str, prompt: list[int]) -> dict[str, Any]:
    ref = plain_greedy(target, prompt, 40)
    drafts = _wrong_drafts(ref)
    sid = open_session(c, prompt, 40)
    done: list[int] = []
    for _ in range(2):  # two good rounds first, with drafts
        r = c.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt) + len(done),
                                                            "draft": {"tokens": drafts[len(done): len(done) + 8]}})
        done += r.json()["tokens"]
    base = len(prompt) + len(done)
    fault_round = {"base_len": base, "draft": {"tokens": drafts[len(done): len(done) + 8]}}
    status: int | None = None
    if stage in STAGES:
        obj, name, before = STAGES[stage]
        with patched(obj, name, lambda f: once(f, before)):
            status = c.post(f"/v1/spec/sessions/{sid}/rounds", json=fault_round).status_code
    elif stage == "server drafting raises":
        with patched(srv.engine, "_server_drafter", lambda f: lambda kind, owner: FailingDrafter()):
            status = c.post(f"/v1/spec/sessions/{sid}/generate", json={"base_len": base, "mode": "server",
                                                                       "max_new_tokens": 8}).status_code
    elif stage == "400 after new_tokens":
        status = c.post(f"/v1/spec/sessions/{sid}/generate", json={"base_len": base, "new_tokens": [5, 6],
                                                                   "drafter": "model"}).status_code
    elif stage == "bad sampled draft (q nan)":
        status = c.post(f"/v1/spec/sessions/{sid}/rounds", content=(
            f'{{"base_len": {base}, "draft": {{"tokens": [5], "q": [{{"ids": [5], "probs": [NaN]}}]}}, '
            '"sampling": {"temperature": 1.0}}'), headers={"content-type": "application/json"}).status_code
    elif stage == "top_p 1e-300 sampled round":  # keeps only the top token: the same as greedy
        status = c.post(f"/v1/spec/sessions/{sid}/rounds", json={
            "base_len": base, "sampling": {"temperature": 1.0, "top_p": 1e-300}}).status_code
    elif stage == "client gone mid-generate":
        with c.stream("POST", f"/v1/spec/sessions/{sid}/generate",
                      json={"base_len": base, "mode": "server", "max_new_tokens": 30}) as r:
            status = r.status_code
            next(r.iter_lines())
        time.sleep(0.3)
    info = c.get(f"/v1/spec/sessions/{sid}").json()
    committed = info["committed_len"] - len(prompt)  # what the server kept must be a prefix of the reference
    rest = finish_rounds(c, sid, info["committed_len"], drafts[committed:], 8)
    same = info["committed_len"] >= len(prompt) + len(done) and rest == ref[committed:]
    return {"fault_status": status, "committed_after_fault": committed, "identical": same}


def _sampled_fault(c: httpx.Client, stage: str, prompt: list[int]) -> dict[str, Any]:
    """Seeded sampled rounds (no draft) with a fault at round 3: the same tokens as a fault-free session."""
    def run(fault: bool) -> list[int]:
        sid = open_session(c, prompt, 24)
        tokens: list[int] = []
        n = 0
        while True:
            body = {"base_len": len(prompt) + len(tokens), "sampling": {"temperature": 1.0, "seed": 7}}
            if fault and n == 2:
                obj, name, before = STAGES[stage]
                with patched(obj, name, lambda f, b=before: once(f, b)):
                    c.post(f"/v1/spec/sessions/{sid}/rounds", json=body)
            r = c.post(f"/v1/spec/sessions/{sid}/rounds", json=body).json()
            tokens += r["tokens"]
            n += 1
            if r["finished"]:
                return tokens
    ref = run(False)
    return {"identical": run(True) == ref}


CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "size": {"type": "integer"}},
    "required": ["city", "size"]}}}


def _generate_lines(c: httpx.Client, sid: str, base_len: int) -> tuple[list[int], bool, bool]:
    """One server-mode ``/generate`` of up to 6 tokens: the tokens its rounds committed (an error line
    ends it), whether the session ended, and whether it failed."""
    tokens, ended = [], False
    with c.stream("POST", f"/v1/spec/sessions/{sid}/generate",
                  json={"base_len": base_len, "mode": "server", "max_new_tokens": 6}) as r:
        if r.status_code != 200:
            return tokens, ended, True
        for line in r.iter_lines():
            msg = json.loads(line) if line else {}
            if "error" in msg:
                return tokens, ended, True
            tokens += msg.get("tokens", [])
            ended = ended or bool(msg.get("session_finished"))
    return tokens, ended, False


def _constrained_fault(c: httpx.Client, stage: str, prompt: list[int]) -> dict[str, Any]:
    """A JSON-schema answer in server mode (the server's grammar and copy drafts, jump-forward) with a
    fault in its third ``/generate``: it must give the fault-free session's answer, so the grammar's state,
    the copy index and the drafters' caches went back with the failed round."""
    failed: list[bool] = []

    def run(fault: bool) -> list[int]:
        r = c.post("/v1/spec/sessions", json={"prompt_ids": prompt, "max_new_tokens": 60, "response_format": CITY})
        r.raise_for_status()
        sid, tokens = r.json()["session_id"], []
        for n in range(40):
            if fault and n == 2:
                obj, name, before = STAGES[stage]
                with patched(obj, name, lambda f, b=before: once(f, b)):
                    got, ended, error = _generate_lines(c, sid, len(prompt) + len(tokens))
                failed.append(error)
            else:
                got, ended, _ = _generate_lines(c, sid, len(prompt) + len(tokens))
            tokens += got
            committed = c.get(f"/v1/spec/sessions/{sid}").json()["committed_len"]
            if committed != len(prompt) + len(tokens):  # a failed round left tokens the client never saw
                return [-1, *tokens]
            if ended:
                break
        c.delete(f"/v1/spec/sessions/{sid}")
        return tokens
    ref = run(False)
    same = run(True) == ref
    return {"identical": same and failed == [True], "fault_fired": failed == [True], "answer_tokens": len(ref)}


def rollback(target) -> dict[str, Any]:
    stages = [*STAGES, "server drafting raises", "400 after new_tokens", "bad sampled draft (q nan)",
              "top_p 1e-300 sampled round", "client gone mid-generate"]
    results: dict[str, Any] = {}
    with local(target, max_draft_tokens=8, max_model_len=256) as srv, client(srv.url) as c:
        for i, stage in enumerate(stages):
            try:
                results[f"greedy: {stage}"] = _greedy_fault(srv, c, target, stage, make_prompt(60 + i, 30))
            except Exception as e:
                results[f"greedy: {stage}"] = {"identical": False, "error": repr(e)[:300]}
        for i, stage in enumerate(STAGES):
            for kind, fault in (("sampled", _sampled_fault), ("constrained server mode", _constrained_fault)):
                try:
                    results[f"{kind}: {stage}"] = fault(c, stage, make_prompt(80 + i, 30))
                except Exception as e:
                    results[f"{kind}: {stage}"] = {"identical": False, "error": repr(e)[:300]}
    bad = [k for k, v in results.items() if not v["identical"]]
    log(f"rollback: {len(results)} faults, not rolled back {len(bad)} {bad}")
    return {"faults": len(results), "not_rolled_back": len(bad), "failing": bad, "cases": results}
