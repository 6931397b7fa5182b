"""Agent tasks on the real pair: a LangGraph agent through ``ChatAgentSpec``, Qwen2.5-Coder-1.5B-Instruct
verified on a server core, Qwen2.5-Coder-0.5B-Instruct drafting on the agent's core (issue 23, item 4).

Run: ``python -m benchmarks.agent`` (alone on the machine; 40-75 minutes on 2 cores with native bf16) or
``--quick`` (two tasks, RTT 0 only). Writes ``benchmarks/results/agent.json`` (``agent_quick.json``).

The tasks (:mod:`benchmarks.agent_tasks`) are multi-step tool-using requests over a deterministic world
(files, orders, a mailbox, fixed currency rates), each with a check of the end state. For each injected RTT
(a :class:`~benchmarks.delay_proxy.DelayProxy` between agent and verifier), every method runs every task,
in rotated order per task, with its own API key (no method reuses another's prompt KV or copy index; with
``--repeats``, no repeat reuses another's):

* ``plain`` — ``server-ar``, one request per model call: one target pass per token (the reference);
* ``server`` — the verifier drafts (grammar + copy), one request per model call;
* ``edge_0.5b`` — the agent's machine drafts with the 0.5B merged into the grammar + copy tree;
* ``edge_0.5b_int4`` — edge_0.5b with the 0.5B's linears in int4 (weight-only, group 32: the precision its
  GGUF ships in), a quarter of the bytes per drafting step (:mod:`agentspec.models.quant`);
* ``server_0.5b_int4`` — server mode on a second verifier started with ``--draft-model`` the 0.5B and
  ``--draft-quantize int4``: the 0.5B drafting next to the target, on the target's core (co-located);
* ``edge_0.5b_sync`` — edge_0.5b with ``pipeline=False``: each round drafted after the reply before it, not
  while that round is in flight (``agent_ahead.json`` measured the two side by side before pipelining became
  the tool drafter's default, under the name ``edge_0.5b_ahead`` for the pipelined one);
* ``edge_tuned`` — the same with the 0.5B fine-tuned on the 1.5B's answers (``--tuned-drafter``, made by
  ``python -m benchmarks.train --pair``), so the edge speed-up before and after fine-tuning is measured side by side;
* ``edge_small`` — the same with the wave-1 recipe's drafter: the 1.5B's own first two layers trained on its
  answers (``--small-drafter``, made by ``python -m benchmarks.train --pair --recipe from-target``): lower
  acceptance than the 0.5B, a fraction of its cost per drafted token;
* ``server_small`` — server mode on a second verifier started with that drafter as its ``--draft-model``
  (merged into the server's grammar + copy tree): the co-located deployment, same core as the target;
* ``auto`` — the router chooses per segment among edge (``--auto-drafter``: the 0.5B by default), server and
  server-ar, its server mode on the verifier without a draft model (a co-located drafter prefills every new
  context on the target's core: server_0.5b_int4 lost to server on every task,
  ``agent_int4_colocated.log``);
* ``edge_0.5b_int4_twin`` — edge_0.5b_int4 again, its own client and API key: an A/A pair, whose ratio to
  edge_0.5b_int4 is what the VM's drift alone moves a block's ratios by (the noise floor auto's 0.95 is
  read against). Only when ``--methods`` names it.

Per task: model time (every model call's wall time, prefill and network included), steps, the modes used,
tokens per round by content kind (tool-call JSON or text) and whether the transcript (messages, tool calls,
end state) is identical to plain's. Every call asks for the top-2 logprobs of its tokens, so a run that parts
from plain's is reported with the token where it parts and both runs' top-2 margins there (a bf16 near-tie,
or a real loss), and each bf16 divergence is then judged at its own context: the target's margin there
against how far its computation path moves logits (``benchmarks/agent_ties.py``). Then the lossless check in
fp32 (plain, server, edge, auto at RTT 0) and how often the 1.5B and the 0.5B, each decoding plainly,
complete the tasks correctly.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from langchain_core.utils.function_calling import convert_to_openai_tool

from agentspec import models
from agentspec.adapters.langchain import ChatAgentSpec
from agentspec.demo import AGENT_RULES, run_agent, transcript
from agentspec.drafters import ModelDrafter
from benchmarks import agent_ties, common
from benchmarks.agent_tasks import TASKS, Task, World, final_answer
from benchmarks.common import log
from benchmarks.delay_proxy import DelayProxy
from benchmarks.server import Verifier

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MODE = {"plain": "server-ar", "server": "server", "server_small": "server", "server_0.5b_int4": "server",
        "edge_0.5b": "edge", "edge_0.5b_int4": "edge", "edge_0.5b_sync": "edge", "edge_tuned": "edge",
        "edge_small": "edge", "auto": "auto", "edge_0.5b_int4_twin": "edge"}
# which verifier a server method talks to: "main" has no draft model; the others draft with theirs, co-located
SERVER_OF = {"server_small": "small", "server_0.5b_int4": "int4"}
# the local drafters besides the 0.5B: name -> (default directory, the command that makes it), and who uses them
MADE = {"tuned": ("drafters/pair-0.5b-lora", "python -m benchmarks.train --pair"),
        "small": ("drafters/pair-1.5b-2l", "python -m benchmarks.train --pair --recipe from-target")}
USES = {"edge_tuned": "tuned", "edge_small": "small", "server_small": "small"}
ON_REQUEST = {"edge_0.5b_int4_twin"}  # diagnostics: run only when --methods names them
# one per warm-up call: auto's three would otherwise ask the same thing, and the mode tried second would copy
# the first one's answer from the copy index, a text no task gives it (server looked 4.8 tokens a round there)
WARM = ("Reply with one short sentence: what is a tool call?", "In one sentence: why do agents call tools?",
        "Name, in one short sentence, one thing a weather tool returns.")
# --system-prompt: the demo's AGENT_RULES by default. With none (the chat template's own) the 1.5B often repeats
# a call after its result; a step-by-step prompt (below) made it write long free-text plans with made-up tool
# results instead.
STEP_BY_STEP = ("Answer the user's request using the tools. Work step by step: call one tool, read its result, "
                "then either call another tool for the next missing fact or, when nothing is missing, give the "
                "final answer in plain text citing the results.")


def make_model(url: str, method: str, key: str, drafters: dict[str, Any], args: Any) -> ChatAgentSpec:
    """The agent's chat model for ``method``; plain sends each call as one request (as a plain client).
    ``drafters``: the local models, ``"0.5b"`` (edge_0.5b), ``"tuned"`` (edge_tuned), ``"small"`` (edge_small);
    auto drafts with ``args.auto_drafter``'s."""
    whole = method == "plain"
    local = {"edge_0.5b": "0.5b", "edge_0.5b_sync": "0.5b", "edge_0.5b_int4": "0.5b_int4", "auto": args.auto_drafter,
             "edge_tuned": "tuned", "edge_small": "small", "edge_0.5b_int4_twin": "0.5b_int4"}.get(method)
    return ChatAgentSpec(model=TARGET, base_url=url, api_key=key, mode=MODE[method], temperature=0,
                         max_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                         segment_tokens=args.max_new_tokens if whole else args.segment_tokens,
                         drafter=ModelDrafter(drafters[local], tree_width=args.tree_width,
                                              confidence_threshold=args.draft_confidence) if local else None,
                         tokenizer=drafters["0.5b"].tokenizer, timeout=900, logprobs=True, top_logprobs=2,
                         pipeline=False if method.endswith("_sync") else None)


def run_task(model: ChatAgentSpec, task: Task, max_steps: int, system_prompt: str | None) -> dict[str, Any]:
    """One agent run of ``task``: per-call figures, the transcript, whether the task was done and, per AI
    message, its tokens' top-2 logprobs (to find where two runs part and how close that choice was)."""
    world = World()
    calls, messages = run_agent(model, task.prompt, world.tools(), recursion_limit=2 * max_steps,
                                system_prompt=system_prompt)
    rows = []
    for c in calls:
        seg = c.stats.get("segments", [])
        rows.append({"seconds": c.seconds, "tokens": c.tokens, "kind": "tool_call" if c.tool_calls else "answer",
                     "modes": c.stats.get("modes", []),
                     "decode_s": sum(s["wall_s"] for s in seg), "decode_tokens": sum(s["tokens"] for s in seg),
                     "rounds": sum(s["rounds"] for s in seg),
                     "catchup_s": round(sum(s["catchup_s"] for s in seg), 3),  # the 0.5B's prefills (edge)
                     # edge drafting on the critical path, and the rounds whose draft was made ahead (pipelined)
                     "draft_s": round(sum(s["draft_s"] for s in seg), 3),
                     "pipelined": sum(s["pipelined"] for s in seg),
                     # per segment: the mode, the kind it started in, tokens, rounds, drafted, wall / server / critical-path
                     # drafting / catch-up seconds, whether a probe, and what the router predicted (ms/token)
                     "segments": [[s["mode"], s["kind"], s["tokens"], s["rounds"], s["drafted"], round(s["wall_s"], 3),
                                   round(s["server_s"], 3), round(s["draft_s"], 3), round(s["catchup_s"], 3),
                                   s["probe"],
                                   {m: round(v, 1) for m, v in s["predicted_ms_per_token"].items()}]
                                  for s in seg]})
    return {"calls": rows, "model_s": sum(c.seconds for c in calls), "steps": len(calls),
            "transcript": json.dumps([transcript(messages), world.files, world.sent, world.conversions]),
            "correct": task.check(world, final_answer(messages)), "answer": final_answer(messages)[:400],
            "logprobs": [token_choices(m) for m in messages]}  # aligned with the transcript's messages


def token_choices(message: Any) -> list[list[Any]] | None:
    """An AI message's tokens as ``[token, [(top-1, logprob), (top-2, logprob)]]`` (None for other messages)."""
    if message.type != "ai":
        return None
    content = (message.response_metadata.get("logprobs") or {}).get("content") or []
    return [[e["token"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]] for e in content]


def divergence(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Where ``run`` first parts from the reference run: the message, the token, and each run's top-2 choice
    there with its logprob margin (a near-zero margin is a numerical tie that bf16 rounding can flip)."""
    i = first_difference(run["transcript"], ref["transcript"])
    a = run["logprobs"][i] if i < len(run["logprobs"]) else None
    b = ref["logprobs"][i] if i < len(ref["logprobs"]) else None
    if a is None or b is None:
        return {"message": i, "token": None, "why": "the runs part outside a model's output"}
    j = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0]), min(len(a), len(b)))
    if j == min(len(a), len(b)):  # one stopped where the other went on: the stop token is not in logprobs
        return {"message": i, "token": j, "why": "one run ended its message here"}

    def side(choice: list[Any]) -> dict[str, Any]:
        (t1, l1), (t2, l2) = choice[1][0], choice[1][1]
        return {"chose": choice[0], "top2": [t1, t2], "margin": round(l1 - l2, 4)}

    return {"message": i, "token": j, "plain": side(b[j]), "this": side(a[j])}


def run_rtt(srvs: dict[str, Verifier], rtt_ms: float, methods: tuple[str, ...], tasks: tuple[Task, ...],
            drafters: dict[str, Any], args: Any, tag: str) -> dict[str, dict[str, Any]]:
    """Every method on every task at one injected RTT; returns ``{method: {task id: run}}``. ``srvs``: the
    verifier (``"main"``) and the one with a draft model (``"small"``, server_small's)."""
    with contextlib.ExitStack() as stack:
        urls = {k: f"http://127.0.0.1:{stack.enter_context(DelayProxy('127.0.0.1', v.port, rtt_ms / 2e3)).port}"
                if rtt_ms else v.url for k, v in srvs.items()}
        repeats = repeats_in(tag, args)
        # one client and API key per repeat, kept across tasks: a repeat must not copy its own earlier answer
        # from the copy indexes (the server's per key, the client's per client), which plain cannot do
        chat = [{m: make_model(urls[SERVER_OF.get(m, "main")], m, repeat_key(tag, m, rtt_ms, k), drafters, args)
                 for m in methods} for k in range(repeats)]
        for k, m in itertools.product(range(repeats), methods):  # untimed: first requests, and the router's
            for question in WARM[: 3 if m == "auto" else 1]:  # first look at each mode (auto tries an untried
                warm_up(chat[k][m], args, question)  # mode first: one short call per mode)
        runs: dict[str, dict[str, Any]] = {m: {} for m in methods}
        for i, task in enumerate(tasks):
            base = methods[i % len(methods):] + methods[: i % len(methods)]
            done: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
            for k in range(repeats):  # ABBA: each method's mean place in the order is the same
                for m in base if k % 2 == 0 else base[::-1]:
                    done[m].append(run_task(chat[k][m], task, args.max_steps, args.system_prompt))
            for m in methods:
                runs[m][task.id] = merged(done[m])
            ref = runs[methods[0]][task.id]
            log(f"rtt={rtt_ms:g}ms {task.id}: steps={ref['steps']} correct={ref['correct']} " + " ".join(
                f"{m}={runs[m][task.id]['model_s']:.1f}s"
                f"{'' if runs[m][task.id]['transcript'] == ref['transcript'] else '(differs)'}" for m in methods))
    return runs


def repeats_in(tag: str, args: Any) -> int:
    """Runs of each task per method in the ``tag`` block: ``--repeats`` in bf16, one elsewhere (fp32 checks
    losslessness, where one run is the check)."""
    return args.repeats if tag == "bf16" else 1


def repeat_key(tag: str, method: str, rtt_ms: float, k: int) -> str:
    """The API key of ``method``'s ``k``-th repeat at ``rtt_ms`` in the ``tag`` block (the first keeps the
    one-run name)."""
    return f"{tag}-{method}-{rtt_ms:g}" + (f"-r{k}" if k else "")


def merged(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """One task's runs by one method as one: the first's transcript, answer and logprobs (what the divergence
    report reads), every run's calls (pooled decode figures), and the mean model time, with each run's."""
    first = repeats[0]
    if len(repeats) == 1:
        return first
    return {**first, "model_s": sum(r["model_s"] for r in repeats) / len(repeats),
            "model_s_runs": [round(r["model_s"], 3) for r in repeats],
            "calls": [c for r in repeats for c in r["calls"]],
            "same_transcript_across_runs": all(r["transcript"] == first["transcript"] for r in repeats)}


def warm_up(model: ChatAgentSpec, args: Any, question: str = WARM[0]) -> None:
    """One short untimed call. With the agent's prefix (the default): its system prompt and the world's tools,
    which the chat template renders ahead of the user's turn, so the verifier holds their KV as it does for a
    deployed agent after its first request, and the first task does not alone pay that prefill for every
    method (``--cold-agent-prefix``: the bare call every run before this option made)."""
    if args.cold_agent_prefix:
        model.invoke(question, max_tokens=24)
        return
    messages = ([("system", args.system_prompt)] if args.system_prompt else []) + [("human", question)]
    model.bind_tools(World().tools()).invoke(messages, max_tokens=24)


def summarise_rtt(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Speed-ups against plain at one RTT: decode (pooled tokens over segment time) and per-task model time."""
    def pooled(m: str, num: str, den: str) -> float:
        calls = [c for r in runs[m].values() for c in r["calls"]]
        return sum(c[num] for c in calls) / max(1e-9, sum(c[den] for c in calls))

    ref = runs["plain"]
    out: dict[str, Any] = {}
    for m in runs:
        every = [c for r in runs[m].values() for c in r["calls"]]
        total = {k: sum(c[k] for c in every) for k in ("catchup_s", "draft_s", "pipelined", "rounds")}
        by_kind = {}  # a call's kind: a tool call (JSON arguments) or a text answer
        for k in ("tool_call", "answer"):
            calls = [c for c in every if c["kind"] == k]
            rounds = sum(c["rounds"] for c in calls)
            by_kind[k] = round(sum(c["decode_tokens"] for c in calls) / rounds, 3) if rounds else None
        modes: dict[str, int] = {}
        for c in every:
            for mode in c["modes"]:
                modes[mode] = modes.get(mode, 0) + 1
        out[m] = {"decode_ms_per_token": round(1e3 * pooled(m, "decode_s", "decode_tokens"), 2),
                  "decode_speedup": round(pooled("plain", "decode_s", "decode_tokens")
                                          / pooled(m, "decode_s", "decode_tokens"), 3),
                  "task_e2e_speedup": {t: round(ref[t]["model_s"] / r["model_s"], 3) for t, r in runs[m].items()},
                  "model_s_total": round(sum(r["model_s"] for r in runs[m].values()), 2),
                  "catchup_s_total": round(total["catchup_s"], 2), "draft_s_total": round(total["draft_s"], 2),
                  "pipelined_rounds": f"{total['pipelined']}/{total['rounds']}",
                  "tokens_per_round_by_kind": by_kind, "segments_by_mode": modes,
                  "identical_to_plain": sum(r["transcript"] == ref[t]["transcript"] for t, r in runs[m].items()),
                  "divergences": {t: divergence(r, ref[t]) for t, r in runs[m].items()
                                  if r["transcript"] != ref[t]["transcript"]}}
    fixed = [m for m in runs if m not in ("plain", "auto")]
    best = min(fixed, key=lambda m: out[m]["model_s_total"], default=None)
    if "auto" not in runs or best is None:
        return {"methods": out, "best_fixed": best, "auto_vs_best": None}
    # like for like: the tasks where auto and the best fixed mode committed the same transcript (one that parted
    # at a bf16 near-tie did other work: a longer answer's seconds are not the router's)
    same = [t for t, r in runs["auto"].items() if r["transcript"] == runs[best][t]["transcript"]]
    return {"methods": out, "best_fixed": best,
            "auto_vs_best": round(out[best]["model_s_total"] / out["auto"]["model_s_total"], 3),
            "auto_vs_best_same_transcript": round(sum(runs[best][t]["model_s"] for t in same)
                                                  / sum(runs["auto"][t]["model_s"] for t in same), 3)
            if same else None, "auto_vs_best_same_transcript_tasks": same}


def first_difference(a: str, b: str) -> int:
    """Index of the first message where two transcripts differ (their length when one extends the other)."""
    ma, mb = json.loads(a)[0], json.loads(b)[0]
    return next((i for i, (x, y) in enumerate(zip(ma, mb, strict=False)) if x != y), min(len(ma), len(mb)))


def parse_args(argv: list[str] | None = None) -> tuple[Any, tuple[Task, ...], tuple[str, ...], list[float]]:
    """The command line, checked before anything loads or pins: (args, tasks, methods, RTTs in ms)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", type=int, default=len(TASKS), help="run the first N tasks")
    ap.add_argument("--only", default="", help="comma-separated task names to run instead (a diagnosis run)")
    ap.add_argument("--rtts", default="0,20,50,100", help="injected round-trip times in ms, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=4, help="most model calls per task")
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--segment-tokens", type=int, default=32, help="server, edge and auto segments")
    ap.add_argument("--system-prompt", default="rules", help="the agent's system prompt: 'rules' (default: the "
                    "demo's AGENT_RULES), 'none' (the chat template's own), 'step-by-step' (STEP_BY_STEP) or the text")
    for key, (where, how) in MADE.items():
        users = ", ".join(m for m, k in USES.items() if k == key)
        ap.add_argument(f"--{key}-drafter", default="auto", help=f"the drafter of {users} (a directory, made by "
                        f"`{how}`; 'none' leaves them out; default 'auto': {where} if it exists, else none)")
    ap.add_argument("--auto-drafter", choices=("0.5b", "0.5b_int4", *MADE), default="0.5b",
                    help="the local drafter auto may switch to edge with")
    ap.add_argument("--methods", default="", help="comma-separated subset of the methods (plain always runs: the "
                    "reference)")
    ap.add_argument("--tree-width", type=int, default=2,
                    help="the local drafters' picks per position (ModelDrafter.tree_width): 1 a chain; 2 adds the "
                         "second pick as a sibling leaf, verified in the same pass")
    ap.add_argument("--draft-confidence", type=float, default=0.0,
                    help="the local drafters' confidence stop (ModelDrafter.confidence_threshold; 0: off)")
    ap.add_argument("--int4-draft-vocab", type=int, default=64000,
                    help="output rows the int4 0.5B drafts from: the tokenizer's added tokens and the lowest ids "
                    "(models.lowest_ids_vocab; 0: the whole vocabulary)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each task per method in bf16, in alternating order (the VM's speed drifts from "
                    "minute to minute: benchmarks/cross_core.py); a task's model time is their mean. Each repeat has its "
                    "own client and API key, so none copies an earlier run's answer")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 lossless check")
    ap.add_argument("--no-completion", action="store_true", help="skip the 0.5B's own task runs (tasks_correct)")
    ap.add_argument("--no-judge", action="store_true", help="leave bf16 divergences unjudged (no fresh target "
                    "forwards measuring each one's margin and path noise: benchmarks/agent_ties.py)")
    ap.add_argument("--cold-agent-prefix", action="store_true",
                    help="warm up without the agent's system prompt and tools: the first task pays their prefill")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/agent")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats takes a number of runs per task >= 1, got {args.repeats}")
    if args.tree_width < 1:
        ap.error(f"--tree-width takes a number of picks per position >= 1, got {args.tree_width}")
    if not 0.0 <= args.draft_confidence < 1.0:
        ap.error(f"--draft-confidence takes a probability in [0, 1) (0: off), got {args.draft_confidence}")
    if args.int4_draft_vocab < 0:
        ap.error(f"--int4-draft-vocab takes a number of rows >= 0 (0: all), got {args.int4_draft_vocab}")
    for key, (where, how) in MADE.items():
        if getattr(args, f"{key}_drafter") == "auto":  # a fresh clone has none: run without it rather than fail
            setattr(args, f"{key}_drafter", where if Path(where, "config.json").is_file() else "none")
            if getattr(args, f"{key}_drafter") == "none":
                log(f"no drafter at {where} ({how} makes one): "
                    f"{', '.join(m for m, k in USES.items() if k == key)} left out")
    args.system_prompt = {"rules": AGENT_RULES, "none": None, "step-by-step": STEP_BY_STEP}.get(
        args.system_prompt, args.system_prompt) or None
    if args.quick:
        args.tasks, args.rtts, args.no_fp32, args.out = 2, "0", True, args.out + "_quick"
    chosen = {m.strip() for m in args.methods.split(",") if m.strip()}
    if chosen - set(MODE):
        ap.error(f"--methods: unknown {sorted(chosen - set(MODE))}; choose from {', '.join(MODE)}")
    tasks = TASKS[: args.tasks]
    if args.only:
        names = {t.id for t in TASKS}
        wanted = args.only.split(",")
        if not set(wanted) <= names:
            ap.error(f"--only: unknown tasks {sorted(set(wanted) - names)}; known: {sorted(names)}")
        tasks = tuple(t for t in TASKS if t.id in wanted)
        args.tasks = len(tasks)
    methods = tuple(m for m in MODE if (m == "plain" or not chosen and m not in ON_REQUEST or m in chosen)
                    and (m not in USES or getattr(args, f"{USES[m]}_drafter") != "none"))
    if "auto" in methods and args.auto_drafter in MADE and getattr(args, f"{args.auto_drafter}_drafter") == "none":
        ap.error(f"--auto-drafter {args.auto_drafter}: there is no such drafter (see --{args.auto_drafter}-drafter)")
    try:
        rtts = [float(r) for r in args.rtts.split(",")]
    except ValueError:
        ap.error(f"--rtts takes milliseconds separated by commas, got {args.rtts!r}")
    for key in local_drafters(methods, args):
        where = getattr(args, f"{key}_drafter")
        if not Path(where, "config.json").is_file():
            ap.error(f"--{key}-drafter {where}: no drafter there; make one with `{MADE[key][1]}`, or pass "
                     f"--{key}-drafter none to leave out the methods it drafts for")
    return args, tasks, methods, rtts


def local_drafters(methods: tuple[str, ...], args: Any, client: bool = False) -> set[str]:
    """The trained drafters the chosen methods need (auto's included); ``client``: only those the agent's side
    loads (server_small's drafter lives in its verifier)."""
    used = {USES[m] for m in methods if m in USES and not (client and m == "server_small")}
    return used | ({args.auto_drafter} & set(MADE) if "auto" in methods else set())


def main(argv: list[str] | None = None) -> int:
    args, tasks, methods, rtts = parse_args(argv)
    os.sched_setaffinity(0, {0})  # the agent's machine: core 0; the verifier is pinned to core 1
    torch.set_num_threads(1)
    drafters = {"0.5b": models.load_model(DRAFTER, device="cpu", dtype="bfloat16")}
    drafter = drafters["0.5b"]
    if {"edge_0.5b_int4", "edge_0.5b_int4_twin"} & set(methods) or ("auto" in methods
                                                                   and args.auto_drafter == "0.5b_int4"):
        drafters["0.5b_int4"] = models.load_model(DRAFTER, device="cpu", dtype="bfloat16", quantize="int4",
                                                  draft_vocab=args.int4_draft_vocab or None)
    for key in local_drafters(methods, args, client=True):
        drafters[key] = models.load_model(getattr(args, f"{key}_drafter"), device="cpu", dtype="bfloat16")
    keys = [a for tag in ("bf16", "fp32", "small") for m in methods for r in rtts for k in range(repeats_in(tag, args))
            for a in ("--api-key", repeat_key(tag, m, r, k))]
    result: dict[str, Any] = {"rtt": {}, "runs": {}}
    t0 = time.perf_counter()
    with verifiers("bfloat16", keys, methods, args) as srvs:
        result["verifier_load_s"] = round(time.perf_counter() - t0, 1)
        for r in rtts:
            runs = run_rtt(srvs, r, methods, tasks, drafters, args, "bf16")
            result["rtt"][f"{r:g}"], result["runs"][f"bf16-{r:g}"] = summarise_rtt(runs), runs
            partial(result, args)
        result["verifier_peak_rss_bytes"] = srvs["main"].peak_rss()
    if not args.no_fp32:
        with verifiers("float32", keys, methods, args) as srvs:
            runs = run_rtt(srvs, 0.0, methods, tasks, drafters, args, "fp32")
            result["fp32"], result["runs"]["fp32-0"] = summarise_rtt(runs), runs
            partial(result, args)
    low = f"bf16-{min(rtts):g}"  # the lowest RTT run: 0 ms unless --rtts leaves it out
    result["plain_same_as_rtt0"] = plain_across_rtts(result["runs"], low)
    result["completion"] = None if args.no_completion else completion(result["runs"][low]["plain"], tasks, drafter,
                                                                      keys, args, min(rtts))
    if not args.no_judge:  # every server is closed: the judge's own copy of the target has the cores
        t0 = time.perf_counter()
        target = models.load_model(TARGET, device="cpu", dtype="bfloat16")
        tools = [convert_to_openai_tool(t) for t in World().tools()]
        n = agent_ties.judge_all(target, result, tools, args.system_prompt)
        result["judge_s"] = round(time.perf_counter() - t0, 1)
        log(f"judged {n} bf16 divergences in {result['judge_s']} s")
        del target
    accept = acceptance(result, rtts, args)
    for block in result["runs"].values():  # per-token logprobs served the divergence report; too big to keep
        for by_task in block.values():
            for r in by_task.values():
                r.pop("logprobs", None)
    result = {"acceptance": accept, **result, "setup": setup(args, tasks, methods)}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out + ".partial.json").unlink(missing_ok=True)
    print(json.dumps(accept, indent=1))
    return 0


@contextlib.contextmanager
def verifiers(dtype: str, keys: list[str], methods: tuple[str, ...], args: Any) -> Iterator[dict[str, Verifier]]:
    """The 1.5B's verifier on core 1 and, for server_small and server_0.5b_int4, more there with a draft model
    (the small drafter; the 0.5B in int4). One computes at a time: methods run one after another."""
    with contextlib.ExitStack() as stack:
        srvs = {"main": Verifier(dtype, *keys, threads=1, target=TARGET, cpus="1")}
        stack.callback(srvs["main"].close)
        if "server_small" in methods:
            srvs["small"] = Verifier(dtype, *keys, "--draft-model", args.small_drafter, threads=1, target=TARGET,
                                     cpus="1")
            stack.callback(srvs["small"].close)
        if "server_0.5b_int4" in methods:
            srvs["int4"] = Verifier(dtype, *keys, "--draft-model", DRAFTER, "--draft-quantize", "int4", threads=1,
                                    target=TARGET, cpus="1")
            stack.callback(srvs["int4"].close)
        yield srvs


def partial(result: dict[str, Any], args: Any) -> None:
    """The blocks run so far (``<out>.partial.json``, no acceptance yet): a long run cut short keeps them."""
    Path(args.out + ".partial.json").write_text(json.dumps(result, indent=1) + "\n")


def plain_across_rtts(runs: dict[str, Any], low: str) -> dict[str, int]:
    """Per run block, the tasks whose plain transcript equals plain's at the lowest RTT in bf16 (the network
    cannot change an answer; a bf16 near-tie can, when the verifier's computation path differs, e.g. prefix
    reuse)."""
    ref = runs[low]["plain"]
    return {block: sum(r["transcript"] == ref[t]["transcript"] for t, r in v["plain"].items())
            for block, v in runs.items()}


def completion(big: dict[str, Any], tasks: tuple[Task, ...], drafter: Any, keys: list[str], args: Any,
               rtt_ms: float) -> dict[str, Any]:
    """Tasks each model completes correctly decoding plainly (the 1.5B from its bf16 plain runs)."""
    srv = Verifier("bfloat16", *keys, threads=1, target=DRAFTER, cpus="1")
    try:
        small = ChatAgentSpec(model=DRAFTER, base_url=srv.url, api_key=f"small-plain-{rtt_ms:g}", mode="server-ar",
                              temperature=0, max_tokens=args.max_new_tokens, segment_tokens=args.max_new_tokens,
                              tokenizer=drafter.tokenizer, timeout=900)
        runs = {t.id: run_task(small, t, args.max_steps, args.system_prompt) for t in tasks}
    finally:
        srv.close()
    return {TARGET: {t: r["correct"] for t, r in big.items()}, DRAFTER: {t: r["correct"] for t, r in runs.items()},
            "answers_0.5b": {t: r["answer"] for t, r in runs.items()}}


def acceptance(result: dict[str, Any], rtts: list[float], args: Any) -> dict[str, Any]:
    low = f"{min(rtts):g}"  # decode and per-task figures at the lowest RTT run (0 ms unless --rtts leaves it out)
    at0 = result["rtt"][low]["methods"]
    fixed = [m for m in at0 if m not in ("plain", "auto")]
    best_decode = max(fixed, key=lambda m: at0[m]["decode_speedup"])
    best_e2e = result["rtt"][low]["best_fixed"]
    done = result["completion"]
    e2e = at0[best_e2e]["task_e2e_speedup"]
    same = {t: v for t, v in e2e.items() if t not in at0[best_e2e]["divergences"]}
    plain0, best0 = result["runs"][f"bf16-{low}"]["plain"], result["runs"][f"bf16-{low}"][best_e2e]
    fp32 = result.get("fp32")
    blocks = {f"bf16 rtt {r:g}ms": result["rtt"][f"{r:g}"] for r in rtts} | ({"fp32 rtt 0ms": fp32} if fp32 else {})
    divergences = [{"run": b, "method": m, "task": t, **d} for b, v in blocks.items()
                   for m, x in v["methods"].items() for t, d in x["divergences"].items()]
    return {
        "tasks": args.tasks, "rtts_ms": rtts, "decode_and_task_figures_at_rtt_ms": float(low),
        "lossless": None if fp32 is None else all(v["identical_to_plain"] == args.tasks
                                                  for v in fp32["methods"].values()),
        "identical_to_plain_fp32": None if fp32 is None else {m: v["identical_to_plain"]
                                                              for m, v in fp32["methods"].items()},
        "identical_to_plain_bf16": {f"{r:g}": {m: v["identical_to_plain"] for m, v in
                                               result["rtt"][f"{r:g}"]["methods"].items()} for r in rtts},
        "decode_speedup_bf16": at0[best_decode]["decode_speedup"], "decode_best_mode": best_decode,
        "task_e2e_speedup_bf16": min(e2e.values()), "task_e2e_best_mode": best_e2e,
        # a task whose transcript parted from plain's at a bf16 near-tie did other work: not like for like
        "task_e2e_speedup_bf16_same_transcript": min(same.values()) if same else None,
        "task_e2e_speedup_bf16_pooled": round(sum(r["model_s"] for r in plain0.values())
                                              / sum(r["model_s"] for r in best0.values()), 3),
        "auto_vs_best": {f"{r:g}": result["rtt"][f"{r:g}"]["auto_vs_best"] for r in rtts},
        "auto_vs_best_min": min((result["rtt"][f"{r:g}"]["auto_vs_best"] for r in rtts
                                 if result["rtt"][f"{r:g}"]["auto_vs_best"] is not None), default=None),
        "auto_vs_best_same_transcript": {f"{r:g}": result["rtt"][f"{r:g}"].get("auto_vs_best_same_transcript")
                                         for r in rtts},
        "tasks_correct": None if done is None else {m: sum(v.values()) for m, v in done.items()
                                                    if not m.startswith("answers")},
        "divergences": divergences,  # fp32 ones would be losses; bf16 ones should be near-ties
        "bf16_divergence_verdicts": (judged := verdicts(divergences)),
        "bf16_divergences_all_ties": None if args.no_judge else set(judged) <= {"tie"},  # every one is judged
        "bf16_divergence_margin_max": max((d["plain"]["margin"] for d in divergences
                                           if "plain" in d and d["run"].startswith("bf16")), default=None),
        "targets": {"decode_speedup_bf16": 3.0, "task_e2e_speedup_bf16": 2.0, "auto_vs_best_min": 0.95},
    }


def verdicts(divergences: list[dict[str, Any]]) -> dict[str, int]:
    """How many bf16 divergences were judged ties, failures, or could not be judged (agent_ties)."""
    out: dict[str, int] = {}
    for d in divergences:
        if d["run"].startswith("bf16") and "judged" in d:
            out[d["judged"]["verdict"]] = out.get(d["judged"]["verdict"], 0) + 1
    return out


def setup(args: Any, tasks: tuple[Task, ...], methods: tuple[str, ...]) -> dict[str, Any]:
    return {"target": TARGET, "drafter": DRAFTER, "methods": {m: MODE[m] for m in methods},
            **{f"{key}_drafter": getattr(args, f"{key}_drafter") if key in local_drafters(methods, args) else None
               for key in MADE},
            "auto_drafter": args.auto_drafter,
            "dtype": "bfloat16 (fp32: the lossless check)",
            "tasks": {t.id: t.prompt for t in tasks}, "max_new_tokens": args.max_new_tokens,
            "max_steps": args.max_steps, "system_prompt": args.system_prompt, "num_draft_tokens": args.num_draft_tokens,
            "repeats_bf16": args.repeats,
            "warm_up": "a bare call" if args.cold_agent_prefix else "the agent's system prompt and tools, then a call",
            "segment_tokens": {"plain": args.max_new_tokens, "server, edge_0.5b, auto": args.segment_tokens},
            "server": "agentspec-verifier, taskset core 1, 1 thread, no draft model (server_small and "
                      "server_0.5b_int4: one with its draft model)",
            "client": "core 0, 1 thread: the LangGraph agent and the 0.5B drafters (bf16; edge_0.5b_int4: int4 "
                      "weight-only linears, bf16 activations)",
            "int4_draft_vocab": args.int4_draft_vocab or "all",
            "tree_width": args.tree_width, "draft_confidence": args.draft_confidence,
            "rtt": "DelayProxy on loopback, half the RTT each way", "machine": common.machine_info()}


if __name__ == "__main__":
    raise SystemExit(main())
