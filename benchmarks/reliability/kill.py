"""The kill loop: three ``agentspec-verifier`` subprocesses (pinned to ``SERVER_CPU``) in rotation; run i
is one SpecClient call given verifiers ``[i % 3, (i + 1) % 3]``; mid-request the first (serving it) gets
``kill -9``, the call fails over to the second, and the victim restarts while the next runs use the others
(three so a restart, seconds on a small machine, overlaps two runs instead of stalling the loop).
Every output is compared with plain greedy on the same prompt; a run counts when the kill landed while
the call was still running."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from agentspec.client import SpecClient
from benchmarks.reliability.common import VerifierProcess, log, plain_greedy, save_model

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


def run(target, runs: int, root: Path, max_tokens: int = 400) -> dict[str, Any]:
    model_dir = save_model(target, root)
    servers = [VerifierProcess(model_dir).start(wait=False) for _ in range(3)]
    for s in servers:
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
    finally:
        for s in servers:
            s.stop()
    out = {"runs": mid, "not_identical": not_identical, "failure_samples": failures[:5],
           "reference_tokens": len(ref), "reference_is_plain_greedy": plain.tokens == ref,
           "one_call_s": round(call_s, 3), "kill_to_done_s_mean": _mean(failover_s),
           "restart_s_mean": _mean(restart_s), "wall_s": round(time.monotonic() - t_start, 1),
           "pinned": [s.pinned for s in servers]}
    log(f"kill loop: {mid} kills mid-request, not identical {not_identical}, wall {out['wall_s']} s")
    return out


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None
