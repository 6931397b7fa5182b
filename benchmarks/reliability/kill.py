"""The kill loop: three ``agentspec-verifier`` subprocesses (pinned to ``SERVER_CPU``) in rotation; run i
is one SpecClient call given verifiers ``[i % 3, (i + 1) % 3]``; mid-request the first (serving it) gets
``kill -9``, the call fails over to the second, and the victim restarts while the next runs use the others
(three so a restart, seconds on a small machine, overlaps two runs instead of stalling the loop).
Every output is compared with plain greedy on the same prompt; a run counts when the kill landed while
the call was still running.

Then the API runs: both verifiers of a call are killed, one after the other, and the call ends on its
``fallback_model`` — a fourth verifier process serving the same target as an OpenAI-compatible provider,
through litellm. The tokens committed before the handover must be plain greedy's, and the rest must be the
provider's own answer to the conversation with that text as a partial assistant answer (none when a kill
came before the first round: then the provider's answer to the conversation itself): nothing lost or
repeated, the stream's text equal to the final text."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from agentspec.client import SpecClient, TextEvent
from benchmarks.reliability.common import VerifierProcess, log, plain_greedy, save_model

PROVIDER_KEY = "kill-loop-provider"

MESSAGES = [[{"role": "user", "content": f"write about {w} at length"}]
            for w in ("rivers", "engines", "maps", "owls", "salt", "glass")]


def _pick_prompt(target, url: str, max_tokens: int) -> tuple[list[dict], list[int]]:
    """The message whose greedy answer is longest (so a kill lands mid-request), and that answer."""
    best: tuple[list[dict], list[int]] = (MESSAGES[0], [])
    for m in MESSAGES:
        ids = httpx.post(url + "/tokenize", json={"messages": m}, timeout=30).json()["tokens"]
        ref = plain_greedy(target, ids, max_tokens)
        if len(ref) > len(best[1]):
            best = (m, ref)
    return best


def run(target, runs: int, root: Path, max_tokens: int = 400, api_runs: int = 0) -> dict[str, Any]:
    model_dir = save_model(target, root)
    servers = [VerifierProcess(model_dir).start(wait=False) for _ in range(3)]
    provider = VerifierProcess(model_dir, env={"AGENTSPEC_API_KEY": PROVIDER_KEY}).start(wait=False)
    for s in [*servers, provider]:
        s.wait_ready()
    log(f"kill loop: verifiers on ports {[s.port for s in servers]} pinned to {[s.pinned for s in servers]}")
    rng = random.Random(0)
    messages, ref = _pick_prompt(target, servers[0].url, max_tokens)
    t0 = time.monotonic()
    c = SpecClient([servers[0].url], timeout=30)
    plain = c.generate(messages, max_tokens=max_tokens)
    c.close()
    call_s = time.monotonic() - t0
    log(f"kill loop: reference {len(ref)} tokens, one call {call_s:.2f} s, identical to plain greedy: "
        f"{plain.tokens == ref}")
    mid, not_identical, failures, failover_s, restart_s = 0, 0, [], [], []
    restarters: dict[int, threading.Thread] = {}
    t_start = time.monotonic()
    try:
        for i in range(runs * 3):  # kills that land after the call ended are retried (bounded)
            if mid >= runs:
                break
            for j in (i % 3, (i + 1) % 3):  # both must be up (the third may still be restarting)
                if j in restarters:
                    restarters.pop(j).join()
            victim, other = servers[i % 3], servers[(i + 1) % 3]
            result: dict[str, Any] = {}

            def call(first: str = victim.url, second: str = other.url, result: dict = result) -> None:
                sc = SpecClient([first, second], timeout=30, retries=1)
                try:
                    result["final"] = sc.generate(messages, max_tokens=max_tokens)
                except Exception as e:  # recorded: a failed call is a run whose output is not identical
                    result["error"] = repr(e)[:300]
                finally:
                    sc.close()
                result["end"] = time.monotonic()

            th = threading.Thread(target=call)
            th.start()
            time.sleep(rng.uniform(0.15, 0.8) * call_s)
            running = th.is_alive()
            t_kill = time.monotonic()
            victim.kill()
            th.join()
            if running:
                mid += 1
                final = result.get("final")
                if final is None or final.tokens != ref:
                    not_identical += 1
                    failures.append(result.get("error") or f"run {i}: {len(final.tokens)} tokens, differ")
                else:
                    failover_s.append(result["end"] - t_kill)

            def restart(v: VerifierProcess = victim) -> None:
                t = time.monotonic()
                v.start()
                restart_s.append(time.monotonic() - t)
            restarters[i % 3] = threading.Thread(target=restart)
            restarters[i % 3].start()
            if mid and mid % 10 == 0 and running:
                log(f"kill loop: {mid} kills mid-request, {not_identical} not identical")
        for th in restarters.values():
            th.join()
        api = _api_runs(target, messages, ref, servers, provider, api_runs, call_s, rng, max_tokens)
    finally:
        for s in [*servers, provider]:
            s.stop()
    out = {"runs": mid, "not_identical": not_identical, "failure_samples": failures[:5],
           "reference_tokens": len(ref), "reference_is_plain_greedy": plain.tokens == ref,
           "one_call_s": round(call_s, 3), "kill_to_done_s_mean": _mean(failover_s),
           "restart_s_mean": _mean(restart_s), "wall_s": round(time.monotonic() - t_start, 1),
           "pinned": [s.pinned for s in servers], **api}
    log(f"kill loop: {mid} kills mid-request, not identical {not_identical}; "
        f"{api['api_runs']} calls ended on the API fallback, not identical {api['api_not_identical']}; wall {out['wall_s']} s")
    return out


def _api_runs(target, messages: list[dict], ref: list[int], servers: list[VerifierProcess],
              provider: VerifierProcess, runs: int, call_s: float, rng: random.Random,
              max_tokens: int) -> dict[str, Any]:
    """``runs`` calls whose two verifiers are both killed mid-answer, so the API fallback ends them."""
    done, not_identical, failures = 0, 0, []
    api_kwargs = {"api_base": provider.url + "/v1", "api_key": PROVIDER_KEY}
    for i in range(runs * 3):
        if done >= runs:
            break
        first, second = servers[i % 3], servers[(i + 1) % 3]
        result: dict[str, Any] = {"events": []}

        def call(result: dict = result, urls: tuple = (first.url, second.url)) -> None:
            sc = SpecClient(list(urls), timeout=30, retries=1, fallback_model="openai/tiny",
                            api_kwargs=api_kwargs)
            try:
                result["events"].extend(sc.stream(messages, max_tokens=max_tokens))
            except Exception as e:
                result["error"] = repr(e)[:300]
            finally:
                sc.close()

        th = threading.Thread(target=call)
        th.start()
        time.sleep(rng.uniform(0.1, 0.4) * call_s)
        first.kill()
        time.sleep(rng.uniform(0.1, 0.3) * call_s)
        second.kill()
        th.join()
        final = result["events"][-1] if result["events"] else None
        if final is not None and final.stats.segments[-1].mode == "api":  # the fallback took the answer over
            done += 1
            problem = _api_problem(target, messages, ref, final, result["events"], provider, max_tokens)
            if problem:
                not_identical += 1
                failures.append(f"api run {i}: {problem}")
        elif final is None:
            done, not_identical = done + 1, not_identical + 1
            failures.append(f"api run {i}: {result.get('error')}")
        for v in (first, second):
            v.start(wait=False)
        for v in (first, second):
            v.wait_ready()
    return {"api_runs": done, "api_not_identical": not_identical, "api_failure_samples": failures[:5]}


def _api_problem(target, messages: list[dict], ref: list[int], final: Any, events: list[Any],
                 provider: VerifierProcess, max_tokens: int) -> str | None:
    """What is wrong with a call the API fallback finished (None: nothing)."""
    committed = list(final.tokens)
    if committed != ref[: len(committed)]:
        return f"the {len(committed)} tokens committed before the handover are not plain greedy's"
    spoken = target.tokenizer.decode(committed, skip_special_tokens=True)
    # a kill before the first round leaves no text: then the provider answers the conversation itself (an
    # empty assistant message would be a finished, empty turn, and a new answer after it)
    partial = [{"role": "assistant", "content": spoken}] if spoken else []
    body = {"model": "tiny", "messages": [*messages, *partial],
            "max_tokens": max_tokens - len(committed), "temperature": 0.0}
    r = httpx.post(provider.url + "/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {PROVIDER_KEY}"})
    rest = r.json()["choices"][0]["message"]["content"]
    if final.text != spoken + (rest or ""):
        return f"final text is not the committed text + the provider's continuation ({len(final.text)} chars)"
    if "".join(e.text for e in events if isinstance(e, TextEvent)) != final.text:
        return "the streamed text is not the final text"
    return None


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None
