"""Router benchmark: every mode's latency against injected round-trip time, the closed forms' predictions
of it, the break-even RTT, and how close ``auto`` stays to the best fixed mode.

Run: ``python -m benchmarks.router`` (full: SmolLM2-135M-Instruct in float32 and bfloat16, two n-gram edge
drafters, 7 RTT points, 3 prompts × 32 tokens; estimated ~40 min on 2 idle cores) or ``--quick`` (a tiny
random model, 2 RTT points, ~30 s). Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (default
``benchmarks/results/router.json``; ``--quick``: ``router_quick.json``).

Flow, per target (model × dtype), all in one process, greedy, on BFCL tool-calling prompts — by default
as step 2 of an agent loop (:func:`agent_step`: the target's own first answer is in the conversation, the
call timed out, the user asks again), where prompt lookup has something to copy; ``--no-agent-step``
measures the bare questions (n-gram E[A] ≈ 1.3 there, a break-even RTT of a few ms):

1. load the target, render the prompts, fault in memory; the plain greedy reference of every prompt
   (transformers' ``generate``) and the logit path noise that judges bf16 divergences;
2. calibration, apart from the sweep: the verify-cost curve t_v(k) (``t_ar = t_v(1)``) as served — a line
   through the verify times the server reports for every pass of the zero-delay calibration runs below
   (the offline curve, passes back to back on a quiet model thread, is reported next to it); for each edge
   drafter and for the verifier's own drafter, a *replay* of the client's / server's round loop against
   the reference (no model, no network), which gives rounds, draft and accepted lengths (α, E[A]) and
   the draft time; and, through a zero-delay proxy on the warm-up prompt, each mode's per-round loopback
   overhead (HTTP, JSON, the verifier's bookkeeping around the forward pass);
3. the sweep: per RTT a :class:`~benchmarks.delay_proxy.DelayProxy` with one-way delay RTT/2 in front of an
   in-process verifier, all open at once; for each repetition (``--reps``, default 3) and prompt, every
   RTT point in turn runs every fixed mode (``edge`` per drafter, ``server``, ``server-ar``) and ``auto``
   (a fresh client per RTT and drafter, warmed until the router has measured every mode) back to back in
   rotated order — a *block*. Interleaving the RTT points spreads the VM's drift over all of them alike.
   Then ``--extra-reps`` (default 5) more blocks run the *contenders* only: both ``auto`` routers and the
   fixed modes within ``--contender-margin`` (15 %) of the best fixed mode's tokens/s so far. Per mode the
   fastest of the base repetitions of each prompt gives its ms/token (interference on a shared 2-core VM
   only ever adds time; every mode gets as many tries); ``auto`` is compared with each fixed mode by the
   ratio of their tokens/s over the same blocks (24 blocks against a contender, 9 against the rest),
   which cancels what the runs of a block share (every run is checked for losslessness; each run's
   prompt, repetition, tokens and decode seconds are in the JSON, ``points[].runs``). Decode time is the sum of the client's segment wall times (session open and close
   left out); end-to-end time is kept too;
4. predictions from :mod:`agentspec.router`'s closed forms fed with the calibration, the break-even RTT
   (edge vs plain decoding on the server, predicted, and measured where least-squares lines through the
   measured curves cross; the interpolation between the two sweep points around it is kept too), every
   output checked against the reference, and the acceptance figures.

Draft lengths are fixed at γ on both sides (the adaptive draft-length policies are switched off), so the
closed forms apply as written; ``auto`` runs the stock :class:`~agentspec.router.ModePolicy`. Edge mode
drafts with the client's default pipelining (the next round drafted while one is in flight; the JSON
counts ``pipelined_rounds``): an n-gram lookup takes ~0.1 ms, so it hides next to nothing here and the
synchronous closed form stands.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from agentspec import models, router
from agentspec.client import SpecClient
from agentspec.drafters import NgramDrafter
from agentspec.drafters.base import Drafter
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.local import LocalVerifier
from benchmarks import common
from benchmarks.common import log
from benchmarks.delay_proxy import DelayProxy
from benchmarks.router_model import Replay, break_even, predict, probe_bound, replay

RTTS_MS = (0, 5, 10, 25, 50, 100, 200)
# Edge drafters, by name. "ngram" is also what the verifier drafts with in server mode (NgramDrafter()).
DRAFTERS: dict[str, Callable[[], Drafter]] = {
    "ngram": lambda: NgramDrafter(max_ngram=3, min_ngram=1),  # prompt lookup, longest match up to 3 tokens
    "ngram-1": lambda: NgramDrafter(max_ngram=1, min_ngram=1),  # unigram lookup: a weaker copy drafter
}
SERVER_DRAFTER = "ngram"  # server mode's drafter (Generate.drafter); DRAFTERS["ngram"] == the server's NgramDrafter()
TINY = {"tiny-a": (2, 64), "tiny-b": (4, 256)}  # --quick targets: (layers, hidden) of a random Llama


class FixedDraftLength(router.DraftLengthPolicy):
    """Always draft the full γ: the closed forms' fixed draft length (adaptive choice switched off)."""

    def choose(self, gamma_max: int, kind: str = "text") -> int:
        return max(gamma_max, 0)


class Verifier(LocalVerifier):
    """agentspec-verifier's app over ``target`` on 127.0.0.1 (port 0), in this process; γ fixed."""

    def __init__(self, target: models.LoadedModel, gamma: int, thread: ThreadPoolExecutor) -> None:
        # one client at a time: a batching window would only add latency
        config = ServerConfig(served_model_name=target.name, default_num_draft_tokens=gamma, max_draft_tokens=gamma,
                              batch_window_s=0.0)
        super().__init__(target, config, executor=thread)
        self.engine.policies.clear()  # no adaptive γ: server mode drafts min(γ, tokens left - 1) every round

    def __enter__(self) -> Verifier:
        super().__enter__()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self


class RecordingPolicy(router.ModePolicy):
    """The stock policy, also keeping every decode pass the server reports: (γ, verify seconds)."""

    def __init__(self, passes: list[tuple[int, float]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.passes = passes

    def observe_round(self, mode: str, drafted: int, accepted: int, emitted: int, **kw: Any) -> None:
        if kw.get("verify_s", 0.0) > 0:
            self.passes.append((drafted, kw["verify_s"]))
        super().observe_round(mode, drafted, accepted, emitted, **kw)


def served_curve(passes: list[tuple[int, float]], gamma: int) -> dict[int, float]:
    """t_v(k), k = γ + 1 = 1 … gamma + 1, as served: a least-squares line through the per-γ medians of the
    passes (weighted by their counts). Offline passes run back to back on a quiet model thread; served
    ones share the CPU with HTTP, JSON and the proxy, and the closed forms should see what serving costs."""
    by_gamma: dict[int, list[float]] = {}
    for g, sec in passes:
        by_gamma.setdefault(g, []).append(sec)
    pts = [(g, statistics.median(v), len(v)) for g, v in by_gamma.items()]
    w = sum(n for _, _, n in pts)
    mx, my = sum(g * n for g, _, n in pts) / w, sum(y * n for _, y, n in pts) / w
    var = sum(n * (g - mx) ** 2 for g, _, n in pts)
    slope = max(sum(n * (g - mx) * (y - my) for g, y, n in pts) / var, 0.0) if var else 0.0
    return {g + 1: my + slope * (g - mx) for g in range(gamma + 1)}


def make_client(url: str, mode: str, drafter: str | None, args: argparse.Namespace,
                passes: list[tuple[int, float]] | None = None) -> SpecClient:
    kwargs: dict[str, Any] = {"config": router.ModeConfig(has_drafter=drafter is not None), "edge": FixedDraftLength()}
    policy = router.ModePolicy(**kwargs) if passes is None else RecordingPolicy(passes, **kwargs)
    return SpecClient(url, drafter=DRAFTERS[drafter]() if drafter else None, num_draft_tokens=args.gamma,
                      mode=mode, segment_tokens=args.segment_tokens, policy=policy, timeout=600, retries=0,
                      server_drafter=SERVER_DRAFTER)  # the verifier drafts chains with the replayed drafter


def request(client: SpecClient, prompt: common.Prompt, max_new: int) -> dict[str, Any]:
    """One chat call; decode time = Σ segment wall time (session open/prefill and close left out)."""
    t0 = time.perf_counter()
    final = client.generate([dict(m) for m in prompt.messages], [dict(t) for t in prompt.tools], max_tokens=max_new)
    e2e = time.perf_counter() - t0
    segs = final.stats.segments
    by_mode: Counter[str] = Counter()
    for s in segs:
        by_mode[s.mode] += s.tokens
    return {"prompt_id": prompt.id, "tokens": final.tokens, "e2e_s": e2e, "decode_s": sum(s.wall_s for s in segs),
            "rounds": sum(s.rounds for s in segs), "drafted": final.stats.drafted, "accepted": final.stats.accepted,
            "server_s": sum(s.server_s for s in segs), "draft_s": sum(s.draft_s for s in segs),
            "tokens_by_mode": dict(by_mode), "fallbacks": list(final.stats.fallbacks),
            "pipelined_rounds": sum(s.pipelined for s in segs)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratio of totals over prompts."""
    tokens = sum(len(r["tokens"]) for r in runs)
    decode, e2e = sum(r["decode_s"] for r in runs), sum(r["e2e_s"] for r in runs)
    by_mode: Counter[str] = Counter()
    for r in runs:
        by_mode.update(r["tokens_by_mode"])
    return {"tokens": tokens, "decode_s": decode, "e2e_s": e2e, "ms_per_token": decode / tokens * 1e3,
            "tokens_per_s": tokens / decode, "tokens_per_s_e2e": tokens / e2e,
            "rounds": sum(r["rounds"] for r in runs), "drafted": sum(r["drafted"] for r in runs),
            "accepted": sum(r["accepted"] for r in runs), "tokens_by_mode": dict(by_mode),
            "pipelined_rounds": sum(r["pipelined_rounds"] for r in runs),
            "fallbacks": [f for r in runs for f in r["fallbacks"]],
            "per_prompt": [{k: len(r["tokens"]) if k == "tokens" else r[k]
                            for k in ("prompt_id", "tokens", "decode_s", "e2e_s", "rounds", "tokens_by_mode")}
                           for r in runs]}


def paired_ratios(tries: list[dict[str, list[dict]]], auto: str, fixed: str) -> list[float]:
    """auto's tokens/s ÷ ``fixed``'s, per block (one prompt, one repetition: every mode ran back to back).
    ``tries``: per prompt, each mode's runs by repetition; a mode that was no contender ran only the base
    repetitions, and ``zip`` pairs those."""
    return [(len(a["tokens"]) / a["decode_s"]) / (len(f["tokens"]) / f["decode_s"])
            for per in tries for a, f in zip(per[auto], per[fixed], strict=False)]


def auto_vs_fixed(tries: list[dict[str, list[dict]]], drafter: str) -> dict[str, dict[str, Any]]:
    """Per fixed mode: ``ratio``, auto's tokens/s ÷ the mode's over the same blocks (total tokens ÷ total
    decode seconds, each side); ``median``, the median over blocks of the per-block ratio; and those ratios.

    One request's decode time scatters by ~7 % (s.d.) on this 2-core VM even in one mode on one prompt —
    the server-reported forward passes move with it, so it is the CPU. Pairing the runs that ran back to
    back over many blocks (the contenders' extra repetitions) cancels the drift. The ratio of totals is
    tokens/s over the prompt set, as the acceptance states it; the median of per-block ratios is not: when
    the prompts disagree on the best mode (at RTT 0 edge beat server mode by ~10 % on the two prompts an
    n-gram drafts well and lost by ~5 % on the one it drafts badly, which takes half the time) it follows
    the majority of prompts, whatever their share of the time."""
    out = {}
    for name in (f"edge:{drafter}", "server", "server-ar"):
        auto, fixed = f"auto:{drafter}", name
        pairs = [(a, f) for per in tries for a, f in zip(per[auto], per[fixed], strict=False)]
        rate = [sum(len(x[i]["tokens"]) for x in pairs) / sum(x[i]["decode_s"] for x in pairs) for i in (0, 1)]
        r = paired_ratios(tries, auto, fixed)
        out[name] = {"ratio": rate[0] / rate[1], "median": statistics.median(r), "blocks": len(r),
                     "ratios": [round(x, 4) for x in r]}
    return out


def contenders(tries: list[dict[str, list[dict]]], names: list[str], margin: float) -> list[str]:
    """The modes that get the extra repetitions: every ``auto`` and each fixed mode whose tokens/s over the
    base repetitions (total tokens ÷ total decode seconds) is within ``margin`` of the best fixed mode's."""
    tps = {n: sum(len(r["tokens"]) for per in tries for r in per[n]) / sum(r["decode_s"] for per in tries
                                                                             for r in per[n]) for n in names}
    best = max(v for n, v in tps.items() if not n.startswith("auto:"))
    return [n for n in names if n.startswith("auto:") or tps[n] >= (1 - margin) * best]


# ---- calibration and the sweep -----------------------------------------------------------------------


def overheads(port: int, warm: common.Prompt, args: argparse.Namespace, passes: list[tuple[int, float]]
              ) -> dict[str, float]:
    """Seconds per round each mode spends outside model compute and local drafting, at zero added delay;
    every timed decode pass the server reports goes into ``passes``."""
    out = {}
    with DelayProxy("127.0.0.1", port, one_way_delay_s=0.0) as proxy:
        for name, mode, drafter in fixed_modes(args.drafters):
            client = make_client(f"http://127.0.0.1:{proxy.port}", mode, drafter, args)
            request(client, warm, args.max_new_tokens)  # warm-up
            client.policy = RecordingPolicy(passes, config=router.ModeConfig(has_drafter=drafter is not None),
                                            edge=FixedDraftLength())
            r = [request(client, warm, args.max_new_tokens) for _ in range(args.overhead_reps)]
            client.close()
            out[name] = statistics.median((x["decode_s"] - x["server_s"] - x["draft_s"]) / x["rounds"] for x in r)
    return out


def fixed_modes(drafters: list[str]) -> list[tuple[str, str, str | None]]:
    """(name, client mode, edge drafter) of every fixed mode measured."""
    return [(f"edge:{d}", "edge", d) for d in drafters] + [("server", "server", None), ("server-ar", "server-ar", None)]


def warm_auto(client: SpecClient, warm: common.Prompt, max_new: int) -> int:
    """Untimed requests until the router has measured every mode (at most 4); returns how many ran."""
    for n in range(1, 5):
        request(client, warm, max_new)
        if all(m in client.policy.seconds_per_token for m in client.policy.modes):
            return n
    return 4


def sweep(port: int, rtts: list[float], prompts: list[common.Prompt], warm: common.Prompt,
          args: argparse.Namespace, tag: str, passes: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Every fixed mode and ``auto`` (one per edge drafter) on every prompt at every RTT, one delay proxy
    per RTT, all open at once. The RTT points are interleaved — for each repetition and prompt, every RTT
    point runs its modes back to back, in rotated order — so the slow drift of this VM over a half-hour
    run spreads over all points alike instead of making the later (higher-RTT) points slower. Every
    decode pass the server reports to a fixed mode's client goes into ``passes``: (γ, verify seconds)."""
    with ExitStack() as stack:
        points = []
        for rtt in rtts:
            proxy = stack.enter_context(DelayProxy("127.0.0.1", port, one_way_delay_s=rtt / 2e3))
            url = f"http://127.0.0.1:{proxy.port}"
            clients = {name: make_client(url, mode, d, args, passes) for name, mode, d in fixed_modes(args.drafters)}
            warm_requests = {}
            for d in args.drafters:  # a fresh router per RTT point, warmed at this RTT
                clients[f"auto:{d}"] = make_client(url, "auto", d, args)
                warm_requests[d] = warm_auto(clients[f"auto:{d}"], warm, args.max_new_tokens)
            for c in clients.values():
                stack.callback(c.close)
            points.append({"clients": clients, "warm_requests": warm_requests,
                           "tries": [{n: [] for n in clients} for _ in prompts]})
        names = list(points[0]["clients"])
        t0 = time.perf_counter()
        for rep in range(args.reps + args.extra_reps):
            if rep == args.reps:
                for rtt, point in zip(rtts, points, strict=True):
                    point["contenders"] = contenders(point["tries"], names, args.contender_margin)
                    log(tag, f"RTT {rtt:g} ms: extra repetitions for {point['contenders']}")
            for i, prompt in enumerate(prompts):
                for j, point in enumerate(points):
                    group = names if rep < args.reps else point["contenders"]
                    shift = (i + rep + j) % len(group)
                    for name in group[shift:] + group[:shift]:
                        point["tries"][i][name].append(request(point["clients"][name], prompt, args.max_new_tokens))
            log(tag, f"sweep repetition {rep + 1}/{args.reps + args.extra_reps} done ({time.perf_counter() - t0:.0f}s)")
        return [sweep_result(point, names, args.drafters, args.reps) for point in points]


def sweep_result(point: dict[str, Any], names: list[str], drafters: list[str], reps: int) -> dict[str, Any]:
    """One RTT point's runs: ``runs`` (the fastest of the ``reps`` base repetitions per mode and prompt, so
    that every mode's figure rests on as many tries), ``tries`` (per prompt, every mode's runs by
    repetition), ``every_run`` (all of them, prompt-major), the contenders and what each ``auto`` learnt."""
    every: dict[str, list[dict]] = {n: [r for tries in point["tries"] for r in tries[n]] for n in names}
    runs = {n: [min(tries[n][:reps], key=lambda r: r["decode_s"]) for tries in point["tries"]] for n in names}
    routers = {}
    for d in drafters:
        p = point["clients"][f"auto:{d}"].policy
        routers[d] = {"warm_requests": point["warm_requests"][d], "segments": p.segments,
                      "shadowed_modes": sorted(p.config.shadowed),
                      "probed_modes": [m for m in p.modes if m != "server-ar" and m not in p.config.shadowed],
                      "correction": dict(p.correction), "last_predictions_ms": dict(p.last_predictions),
                      "per_round": dict(p.per_round),
                      "ms_per_token_estimates": {m: s * 1e3 for m, s in p.seconds_per_token.items()}}
    return {"runs": runs, "tries": point["tries"], "every_run": every, "routers": routers,
            "contenders": point.get("contenders", names)}


def check_lossless(target: models.LoadedModel, prompts: list[common.Prompt], encoded: list[list[int]],
                   refs: list[list[int]], points: list[dict], rtts: list[float], noise: float, tie_ulps: float
                   ) -> dict[str, Any]:
    """Every run against plain greedy; a divergence is judged once per distinct output (fp32: a failure;
    bf16: a tie only within the measured logit noise, see :func:`common.check_divergence`)."""
    judged: dict[tuple[str, tuple[int, ...]], dict | None] = {}
    found, runs, identical = [], 0, 0
    outputs: dict[str, set[tuple[int, ...]]] = {p.id: set() for p in prompts}
    for rtt, point in zip(rtts, points, strict=True):
        for name, rs in point["every_run"].items():
            for r in rs:
                i = next(j for j, p in enumerate(prompts) if p.id == r["prompt_id"])
                key = (r["prompt_id"], tuple(r["tokens"]))
                outputs[r["prompt_id"]].add(key[1])
                if key not in judged:
                    judged[key] = common.check_divergence(target, prompts[i].id, encoded[i], refs[i], r["tokens"],
                                                          tie_ulps, noise)
                runs += 1
                identical += judged[key] is None
                if judged[key] is not None:
                    found.append({**judged[key], "mode": name, "rtt_ms": rtt})
    return {"runs": runs, "identical_to_plain": identical,
            "identical_across_modes": all(len(v) == 1 for v in outputs.values()),
            "real_failures": sum(d["verdict"] == "FAILURE" for d in found),
            "tie_divergences": sum(d["verdict"] == "tie" for d in found), "divergences": found}


RETRY = "That call timed out before it reached the tool. Send the same request again."


def agent_step(target: models.LoadedModel, prompt: common.Prompt, first_tokens: int) -> common.Prompt:
    """The second step of an agent loop on ``prompt``: the conversation holds the target's own greedy first
    answer (``first_tokens`` tokens) and the user's report that the call timed out, asking for it again —
    the agent-loop case edge drafting is for: what the model writes next is largely in its context."""
    ids = common.render(target.tokenizer, prompt)
    first = common.hf_generate(target, ids, common.hf_generation_config(target, first_tokens))
    answer = target.tokenizer.decode(first, skip_special_tokens=True)
    messages = (*prompt.messages, {"role": "assistant", "content": answer}, {"role": "user", "content": RETRY})
    return common.Prompt(f"{prompt.id}+retry", prompt.category, messages, prompt.tools)


def load_target(spec: str) -> models.LoadedModel:
    """``alias:dtype`` (an offline alias of :func:`agentspec.models.load_model`, or a --quick tiny model)."""
    name, _, dtype = spec.partition(":")
    if name in TINY:
        from tests.helpers import tiny_model  # random weights from a config, never downloaded

        layers, hidden = TINY[name]
        target = tiny_model(seed=10 + layers, layers=layers, hidden=hidden,
                            dtype=models.resolve_dtype(dtype or "float32"))
        target.name = name
        return target
    return models.load_model(name, device="cpu", dtype=dtype or "float32")


def bench_target(spec: str, prompts: list[common.Prompt], warm: common.Prompt, args: argparse.Namespace
                 ) -> dict[str, Any]:
    tag = f"[{spec}]"
    # Every torch op of the target runs on this one thread, the verifier's too (see models.model_thread):
    # the client side (n-gram drafters, HTTP) runs none, so the calibrated t_v(k) holds while serving.
    thread = models.model_thread()
    try:
        return _bench_target(spec, prompts, warm, args, thread, tag)
    finally:
        thread.shutdown()
        gc.unfreeze()  # the next target's turn: this one's objects may go


def _bench_target(spec: str, prompts: list[common.Prompt], warm: common.Prompt, args: argparse.Namespace,
                  thread: ThreadPoolExecutor, tag: str) -> dict[str, Any]:
    def on_model(fn: Callable[..., Any], *a: Any) -> Any:
        return models.on_thread(thread, fn, *a)

    target, load_s = on_model(common.timed, lambda: load_target(spec))
    if args.agent_step:
        prompts = [on_model(agent_step, target, p, args.first_step_tokens) for p in prompts]
        warm = on_model(agent_step, target, warm, args.first_step_tokens)
    encoded = [common.render(target.tokenizer, p) for p in prompts]
    warm_ids = common.render(target.tokenizer, warm)
    on_model(common.pretouch, target.model, max(len(x) for x in encoded) + args.max_new_tokens + args.gamma + 1)
    # 1. plain greedy references, logit path noise
    cfg = common.hf_generation_config(target, args.max_new_tokens)
    warm_ref = on_model(common.hf_generate, target, warm_ids, cfg)
    refs = [on_model(common.hf_generate, target, ids, cfg) for ids in encoded]
    noise = on_model(common.logit_path_noise, target.model, warm_ids, warm_ref, args.gamma + 1)
    gc.collect()  # as agentspec-verifier does once loaded: full collections then skip the model's objects
    gc.freeze()
    log(tag, f"loaded in {load_s:.1f}s; prompts {[len(x) for x in encoded]} tokens, references "
        f"{[len(r) for r in refs]} tokens; logit path noise max {noise['max_abs']:.3g}")
    # 2. calibration: verify-cost curve, replays, loopback overheads
    median_i = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))[len(encoded) // 2]
    offline = on_model(common.verify_cost_curve, target.model, encoded[median_i], args.gamma + 1, args.curve_reps)
    log(tag, "offline t_v(k) ms:", " ".join(f"{k}:{s * 1e3:.1f}" for k, s in offline.items()))
    with Verifier(target, args.gamma, thread) as srv:
        passes: list[tuple[int, float]] = []
        overhead = overheads(srv.port, warm, args, passes)
        start = calibrate(served_curve(passes, args.gamma), encoded, refs, overhead, args)
        log(tag, f"served t_v(k) ms before the sweep ({len(passes)} passes):", _ms(start["curve"]), "| replay:",
            "; ".join(f"{n} E[A] {r.tokens / r.rounds:.2f} γ̄ {r.drafted / r.rounds:.2f}"
                      for n, r in start["replays"].items()))
        log(tag, "loopback overhead ms/round:", {k: round(v * 1e3, 2) for k, v in overhead.items()})
        # 3. the sweep
        sweep_passes: list[tuple[int, float]] = []
        sweep_points = sweep(srv.port, args.rtts, prompts, warm, args, tag, sweep_passes)
    # each mode is replayed over the text it decoded: in bf16 a mode can diverge from plain greedy at an exact
    # top-2 tie (lossless), and from there it decodes, and drafts against, a different continuation
    texts = {name: [r["tokens"] for r in sweep_points[0]["runs"][name]] for name, _, _ in fixed_modes(args.drafters)}
    texts_agree = {name: all(r["tokens"] == texts[name][i] for point in sweep_points
                             for i, per in enumerate(point["tries"]) for r in per[name]) for name in texts}
    cal = calibrate(served_curve(sweep_passes, args.gamma), encoded, refs, overhead, args, texts)
    curve, t_ar, replays, lines = cal["curve"], cal["curve"][1], cal["replays"], cal["lines"]
    log(tag, f"served t_v(k) ms during the sweep ({len(sweep_passes)} passes):", _ms(curve))
    for rtt, point in zip(args.rtts, sweep_points, strict=True):
        ms = {n: aggregate(rs)["ms_per_token"] for n, rs in point["runs"].items()}
        log(tag, f"RTT {rtt:g} ms: ms/token " + " | ".join(
            f"{n} {v:.1f} (pred {_at(lines[n], rtt) * 1e3:.1f}; from the start's curve {_at(start['lines'][n], rtt) * 1e3:.1f})"
            if n in lines else f"{n} {v:.1f}" for n, v in ms.items()))
    lossless = on_model(check_lossless, target, prompts, encoded, refs, sweep_points, args.rtts, noise["max_abs"],
                        args.tie_ulps)
    if lossless["real_failures"]:
        log(tag, f"!!! LOSSLESSNESS FAILURE: {lossless['real_failures']} outputs differ from plain greedy")
    # 4. predictions next to measurements
    points = []
    for rtt, point in zip(args.rtts, sweep_points, strict=True):
        modes = {n: aggregate(rs) for n, rs in point["runs"].items()}
        for n, m in modes.items():
            if n in lines:
                m["predicted_ms_per_token"] = _at(lines[n], rtt) * 1e3
                m["prediction_rel_error"] = abs(m["predicted_ms_per_token"] - m["ms_per_token"]) / m["ms_per_token"]
                m["predicted_ms_per_token_start_curve"] = _at(start["lines"][n], rtt) * 1e3
                m["prediction_rel_error_start_curve"] = (abs(m["predicted_ms_per_token_start_curve"]
                                                             - m["ms_per_token"]) / m["ms_per_token"])
        best = {d: max((f"edge:{d}", "server", "server-ar"), key=lambda n: modes[n]["tokens_per_s"])
                for d in args.drafters}
        paired = {d: auto_vs_fixed(point["tries"], d) for d in args.drafters}
        points.append({"rtt_ms": rtt, "modes": modes, "best_fixed": best, "routers": point["routers"],
                       "contenders": point["contenders"],
                       "auto_vs_best": {d: min(v["ratio"] for v in paired[d].values()) for d in args.drafters},
                       "auto_vs_best_paired_against": {d: min(paired[d], key=lambda n: paired[d][n]["ratio"])
                                                       for d in args.drafters},
                       "auto_vs_best_median_of_blocks": {d: min(v["median"] for v in paired[d].values())
                                                         for d in args.drafters},
                       "runs": {n: [[i, j, len(x["tokens"]), round(x["decode_s"], 5)] for i, per in
                                    enumerate(point["tries"]) for j, x in enumerate(per[n])] for n in point["tries"][0]},
                       "auto_vs_fixed_paired": paired,
                       "auto_vs_best_fastest_reps": {d: modes[f"auto:{d}"]["tokens_per_s"]
                                                     / modes[best[d]]["tokens_per_s"] for d in args.drafters},
                       "auto_vs_best_if_only_probes": {
                           d: probe_bound(modes, d, point["routers"][d]["probed_modes"]) for d in args.drafters}})
    return {"target": spec, "model": model_info(target, load_s), "dtype": str(target.dtype).replace("torch.", ""),
            "prompt_tokens": [len(x) for x in encoded], "reference_tokens": [len(r) for r in refs],
            "logit_path_noise": noise,
            "calibration": {"verify_cost_s": curve, "verify_cost_offline_s": offline, "served_passes": len(sweep_passes),
                            "verify_cost_before_sweep_s": start["curve"], "served_passes_before_sweep": len(passes),
                            "replayed_text": "each mode's own output (first RTT point's fastest run per prompt)",
                            "replayed_text_same_in_every_run": texts_agree,
                            "replayed_text_equals_plain": {n: t == refs for n, t in texts.items()},
                            "lines_before_sweep": {n: {"ms_per_token_at_0": a * 1e3, "ms_per_token_per_ms_rtt": b}
                                                   for n, (a, b) in start["lines"].items()},
                            "t_ar_ms": t_ar * 1e3,
                            "overhead_ms_per_round": {k: v * 1e3 for k, v in overhead.items()},
                            "replay": {n: {**{k: v for k, v in asdict(r).items() if k != "gammas"},
                                            **r.closed_form_inputs()} for n, r in replays.items()},
                            "lines": {n: {"ms_per_token_at_0": a * 1e3, "ms_per_token_per_ms_rtt": b}
                                      for n, (a, b) in lines.items()}},
            "points": points, "break_even": break_even(args.drafters, replays, overhead, lines, t_ar, points),
            "lossless": lossless}


def calibrate(curve: dict[int, float], encoded: list[list[int]], refs: list[list[int]], overhead: dict[str, float],
              args: argparse.Namespace, texts: dict[str, list[list[int]]] | None = None) -> dict[str, Any]:
    """The closed forms' inputs for one served t_v(k) curve: each fixed mode's replay over the prompts (α, γ̄,
    t_d, Σ t_v) and its line ``(a, b)``: seconds per token ``a + b·RTT``. Each mode is replayed over its
    ``texts`` (per prompt), else over the plain greedy references ``refs``."""
    replays = {name: Replay() for name, _, _ in fixed_modes(args.drafters)}

    def text(name: str, i: int) -> list[int]:
        return texts[name][i] if texts else refs[i]

    for i, ids in enumerate(encoded):
        for d in args.drafters:
            replay(DRAFTERS[d](), ids, text(f"edge:{d}", i), args.gamma, args.max_new_tokens, curve, None,
                   replays[f"edge:{d}"])
        replay(DRAFTERS[SERVER_DRAFTER](), ids, text("server", i), args.gamma, args.max_new_tokens, curve,
               args.segment_tokens, replays["server"])
        replay(None, ids, text("server-ar", i), 0, args.max_new_tokens, curve, args.segment_tokens, replays["server-ar"])
    lines = {name: predict(replays[name], overhead[name], curve[1], mode) for name, mode, _ in fixed_modes(args.drafters)}
    return {"curve": curve, "replays": replays, "lines": lines}


def _at(line: tuple[float, float], rtt_ms: float) -> float:
    return line[0] + line[1] * rtt_ms / 1e3


def _ms(curve: dict[int, float]) -> str:
    return " ".join(f"{k}:{s * 1e3:.1f}" for k, s in curve.items())


def model_info(target: models.LoadedModel, load_s: float) -> dict[str, Any]:
    return {"name": target.name, "class": type(target.model).__name__,
            "params": sum(p.numel() for p in target.model.parameters()),
            "layers": target.model.config.num_hidden_layers, "dtype": str(target.dtype),
            "eos_token_ids": list(target.eos_token_ids), "load_s": round(load_s, 1)}


def acceptance(targets: dict[str, dict]) -> dict[str, Any]:
    """The issue's figures, computed from the per-point results."""
    auto = [(x, t, p["rtt_ms"], d) for t, r in targets.items() for p in r["points"] for d, x in p["auto_vs_best"].items()]
    cases = [{"target": t, "drafter": d, **{k: b[k] for k in ("predicted_ms", "measured_ms", "rel_error", "in_sweep")}}
             for t, r in targets.items() for d, b in r["break_even"].items()]
    be = [c["rel_error"] for c in cases if c["in_sweep"]]  # a crossing outside the sweep cannot be measured
    pe = [m["prediction_rel_error"] for r in targets.values() for p in r["points"] for m in p["modes"].values()
          if "prediction_rel_error" in m]
    worst = min(auto)
    out = {"auto_vs_best_min": worst[0],
           "break_even_rel_error": None if None in be or not be else max(be),
           "per_mode_prediction_rel_error_max": max(pe), "delay_method": "proxy",
           "per_mode_prediction_rel_error_max_start_curve": max(
               m["prediction_rel_error_start_curve"] for r in targets.values() for p in r["points"]
               for m in p["modes"].values() if "prediction_rel_error_start_curve" in m),
           "auto_vs_best_min_at": {"target": worst[1], "rtt_ms": worst[2], "drafter": worst[3]},
           "auto_vs_best_if_only_probes_min": min(x for r in targets.values() for p in r["points"]
                                                  for x in p["auto_vs_best_if_only_probes"].values()),
           "break_even_cases": cases,
           "lossless": all(r["lossless"]["real_failures"] == 0 for r in targets.values())}
    out["auto_vs_best_fastest_reps_min"] = min(x for r in targets.values() for p in r["points"]
                                               for x in p["auto_vs_best_fastest_reps"].values())
    out["auto_vs_best_median_of_blocks_min"] = min(x for r in targets.values() for p in r["points"]
                                                   for x in p["auto_vs_best_median_of_blocks"].values())
    out["break_even_rel_error_interpolated"] = max(
        (b["rel_error_interpolated"] for r in targets.values() for b in r["break_even"].values()
         if b["in_sweep"] and b["rel_error_interpolated"] is not None), default=None)
    out["pass"] = {"auto_vs_best": out["auto_vs_best_min"] >= 0.95,
                   "break_even": out["break_even_rel_error"] is not None and out["break_even_rel_error"] <= 0.20,
                   "per_mode_prediction": out["per_mode_prediction_rel_error_max"] <= 0.25}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny random model, RTT 0 and 50 ms, 2 prompts (< 1 min)")
    p.add_argument("--out", default=None, help="output .json path; .md and .png go next to it "
                                               "(default benchmarks/results/router.json, router_quick.json)")
    p.add_argument("--targets", default=None, help="comma-separated alias:dtype (default SmolLM2-135M fp32 and bf16)")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help=f"edge drafters, from {sorted(DRAFTERS)}")
    p.add_argument("--rtts", default=None, help=f"injected RTTs in ms (default {','.join(map(str, RTTS_MS))})")
    p.add_argument("--prompts", type=int, default=None, help="BFCL prompts (default 3)")
    p.add_argument("--categories", default=None, help="BFCL v4 categories")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 32 (two segments)")
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per round, edge and server")
    p.add_argument("--segment-tokens", type=int, default=None, help="tokens per routed segment (default 16)")
    p.add_argument("--curve-reps", type=int, default=5, help="repetitions per verify-cost point")
    p.add_argument("--reps", type=int, default=None,
                   help="blocks of every (mode, RTT) per prompt (default 3; --quick 1)")
    p.add_argument("--extra-reps", type=int, default=None,
                   help="further blocks for the contenders only: auto and the fixed modes within --contender-margin "
                        "of the best after the base repetitions (default 5; --quick 1)")
    p.add_argument("--contender-margin", type=float, default=0.15,
                   help="a fixed mode this close to the best fixed mode's tokens/s is a contender (default 0.15)")
    p.add_argument("--overhead-reps", type=int, default=None, help="timed calibration requests per mode (default 2)")
    p.add_argument("--agent-step", action=argparse.BooleanOptionalAction, default=True,
                   help="measure step 2 of an agent loop (the target's first answer, a timed-out call, a retry "
                        "request) rather than the bare BFCL question (default: on)")
    p.add_argument("--first-step-tokens", type=int, default=48, help="length of the target's first answer")
    p.add_argument("--tie-ulps", type=float, default=1.0, help="bf16 tie threshold floor, in bf16 ulps")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1: served, SmolLM2-135M decodes about as fast on 1 thread "
                        "as on 2, since the second core also runs HTTP, the proxy and the clients)")
    a = p.parse_args(argv)
    q = a.quick
    a.targets = (a.targets or ("tiny-b:float32" if q else
                               "smollm2-135m-instruct:float32,smollm2-135m-instruct:bfloat16")).split(",")
    a.drafters = a.drafters.split(",")
    a.rtts = [float(x) for x in (a.rtts or ("0,50" if q else ",".join(map(str, RTTS_MS)))).split(",")]
    a.prompts = a.prompts or (2 if q else 3)
    a.categories = (a.categories or ("simple_python,parallel" if q else ",".join(common.BFCL_CATEGORIES))).split(",")
    a.max_new_tokens = a.max_new_tokens or (24 if q else 32)
    a.segment_tokens = a.segment_tokens or (8 if q else 16)
    a.overhead_reps = a.overhead_reps or (1 if q else 2)
    a.reps = a.reps or (1 if q else 3)
    a.extra_reps = (1 if q else 5) if a.extra_reps is None else a.extra_reps
    a.out = Path(a.out or f"benchmarks/results/router{'_quick' if q else ''}.json")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    from benchmarks.router_report import tables, write_markdown, write_plot

    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    prompts = common.bfcl_prompts(args.prompts, args.categories)
    warm = common.warmup_prompt(prompts)
    log(f"targets {args.targets}, edge drafters {args.drafters}, RTTs {args.rtts} ms, γ={args.gamma}, "
        f"prompts {[p.id for p in prompts]}, {args.max_new_tokens} new tokens, delay: DelayProxy on loopback")
    settings = {k: getattr(args, k) for k in ("targets", "drafters", "rtts", "prompts", "categories",
                                              "max_new_tokens", "gamma", "segment_tokens", "curve_reps", "overhead_reps",
                                              "reps", "extra_reps", "contender_margin", "agent_step", "first_step_tokens",
                                              "tie_ulps", "threads", "quick")}
    meta = {"settings": settings, "machine": common.machine_info(), "delay_method": "proxy",
            "delay": "benchmarks.delay_proxy.DelayProxy on 127.0.0.1, one-way delay RTT/2 each direction "
                     "(tc netem is not available on this kernel)",
            "models": args.targets, "dtypes": sorted({t.partition(":")[2] or "float32" for t in args.targets}),
            "data": {"source": "bfcl_eval wheel, BFCL v4", "prompt_ids": [p.id for p in prompts],
                     "categories": args.categories, "warmup_prompt_id": warm.id,
                     "selection": "benchmarks.common.bfcl_prompts (evenly spread per category)",
                     "agent_step": (f"each question becomes step 2 of an agent loop, per target: its own greedy "
                                    f"first answer ({args.first_step_tokens} tokens), then the user: {RETRY!r}"
                                    if args.agent_step else "off: the bare BFCL question")},
            "greedy": True, "modes": ["edge", "server", "server-ar", "auto"],
            "edge_drafters": {d: repr(DRAFTERS[d]().__dict__) for d in args.drafters},
            "server_drafter": f"{SERVER_DRAFTER}: {DRAFTERS[SERVER_DRAFTER]().__dict__}",
            "not_measured": {"api": "no remote provider model offline; the router never picks it while a "
                                    "verifier works"}}
    targets = {}
    for spec in args.targets:
        targets[spec] = bench_target(spec, prompts, warm, args)
    meta["wall_s"] = time.perf_counter() - t_start
    result = {"meta": meta, "acceptance": acceptance(targets), "targets": targets}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    write_markdown(result, args.out.with_suffix(".md"))
    write_plot(result, args.out.with_suffix(".png"))
    print("\n".join(tables(result)), flush=True)
    log("acceptance:", json.dumps(result["acceptance"]))
    log(f"wrote {args.out}, .md, .png in {meta['wall_s']:.0f}s")
    return 0 if result["acceptance"]["lossless"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
