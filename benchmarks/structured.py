"""Constrained decoding under speculation: BFCL tool calls with a required/named tool_choice and JSON-schema
answers, every mode, against masked plain decoding.

Run: ``python -m benchmarks.structured`` (alone on the machine, about an hour on 2 cores); ``--quick``: 4 + 3
prompts, a few minutes. Writes ``benchmarks/results/structured.json`` (``structured_quick.json``).

Target Qwen2.5-Coder-0.5B-Instruct (offline GGUF) in ``--dtype`` (default float32), greedy. Two
``agentspec-verifier`` processes pinned to core 1 (``taskset``, one thread: a server machine of its own), one
with jump-forward off (``--jump-forward off``), one with it on; this client pinned to core 0 (one thread,
its edge drafter: grammar + copy + n-gram merged into a tree). Prompts: BFCL ``simple_python``,
``live_simple`` (tool_choice names the only function), ``multiple`` and ``live_multiple`` (``required``), each
with ``parallel_tool_calls=False`` (one call); JSON:
BFCL ``simple_python``/``live_simple`` questions asking for the function's arguments as a JSON object,
``response_format`` = the function's parameter schema. Every request carries the same instruction, so the
constrained and the unconstrained request differ only in the grammar.

Every method has its own API key and client, so the server's and the client's cross-conversation copy
indexes hold only that method's own earlier answers (a shared index would let a method copy another method's
answer to the same prompt). Methods, per prompt in rotated order, after an untimed warm-up of each on a prompt
outside the set:

* ``masked_plain`` — server-ar, jump-forward off: one target pass per token, the argmax under the mask (the
  reference every constrained output is compared with, token for token);
* ``server_drafted`` — server mode, jump-forward off: forced tokens are drafted and verified;
* ``server`` / ``edge`` / ``auto`` — jump-forward on;
* ``plain`` / ``server_unconstrained`` / ``edge_unconstrained`` — the same request without the constraint.

Decode speed per method: committed tokens over the wall time of the request's segments (every round as the
client saw it, network included; the session's open and its prefill excluded), pooled over prompts; a speed-up is the reference's ms/token over the method's (constrained methods against
``masked_plain``, unconstrained ones against ``plain``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from agentspec.client import SpecClient
from agentspec.drafters import NgramDrafter
from agentspec.toolcalls import (
    add_instruction,
    normalise_tools,
    response_format_instruction,
    tool_choice_instruction,
)
from benchmarks import common
from benchmarks.common import log
from benchmarks.server import Verifier

TARGET = "qwen2.5-coder-0.5b-instruct"
CONSTRAINED = ("masked_plain", "server_drafted", "server", "edge", "auto")
UNCONSTRAINED = ("plain", "server_unconstrained", "edge_unconstrained")
MODE = {"masked_plain": "server-ar", "server_drafted": "server", "server_ar_jf": "server-ar", "server": "server",
        "edge": "edge", "auto": "auto", "plain": "server-ar", "server_unconstrained": "server",
        "edge_unconstrained": "edge"}
NO_JUMP = {"masked_plain", "server_drafted"}


def tool_tasks(n: int) -> list[dict[str, Any]]:
    """BFCL prompts with tool_choice named (one-function categories) or required (several functions)."""
    return [tool_task(p) for p in common.bfcl_prompts(n, ("simple_python", "multiple", "live_multiple",
                                                             "live_simple"))]


def tool_task(p: common.Prompt) -> dict[str, Any]:
    """One BFCL prompt as a constrained tool-call task: the only function named, else ``required``."""
    tools = normalise_tools([dict(t) for t in p.tools])
    named = p.category in ("simple_python", "live_simple")
    choice = {"type": "function", "function": {"name": tools[0]["function"]["name"]}} if named else "required"
    messages = add_instruction([dict(m) for m in p.messages], tool_choice_instruction(choice) or "")
    # one call each (BFCL's answers for these categories are one call): a 0.5B allowed several repeats
    # its call until the token limit, identically with and without speculation
    return {"id": p.id, "kind": "tool", "messages": messages, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": False}


def json_tasks(n: int) -> list[dict[str, Any]]:
    """BFCL questions answered as a JSON object of the function's arguments (its parameter schema)."""
    tasks = []
    for p in common.bfcl_prompts(n, ("live_simple", "simple_python")):
        fn = normalise_tools([dict(t) for t in p.tools])[0]["function"]
        schema = fn.get("parameters") or {"type": "object"}
        rf = {"type": "json_schema", "json_schema": {"name": fn["name"], "schema": schema}}
        ask = f"Give the arguments of the function `{fn['name']}` for this request as a JSON object."
        messages = add_instruction([*(dict(m) for m in p.messages), {"role": "user", "content": ask}],
                                   response_format_instruction(rf) or "")
        tasks.append({"id": "json:" + p.id, "kind": "json", "messages": messages, "response_format": rf, "schema": schema})
    return tasks


def run_one(client: SpecClient, task: dict[str, Any], method: str, max_tokens: int) -> dict[str, Any]:
    constrained = method in CONSTRAINED
    kw: dict[str, Any] = {"max_tokens": max_tokens, "mode": MODE[method]}
    if task["kind"] == "tool":
        kw["tools"] = task["tools"]
        kw["tool_choice"] = task["tool_choice"] if constrained else "auto"
        kw["parallel_tool_calls"] = task["parallel_tool_calls"]
    elif constrained:
        kw["response_format"] = task["response_format"]
    t0, final = time.perf_counter(), None
    for ev in client.stream(task["messages"], **kw):
        if type(ev).__name__ == "FinalEvent":
            final = ev
    end = time.perf_counter()
    assert final is not None
    segments = final.stats.segments
    return {"tokens": final.tokens, "text": final.text, "finish": final.finish_reason,
            "calls": [(c.name, c.arguments) for c in final.tool_calls], "e2e_s": end - t0,
            # the segments' wall time: every round, the session's open (its prefill) left out
            "decode_s": sum(g.wall_s for g in segments), "decode_tokens": sum(g.tokens for g in segments),
            "server_s": sum(g.server_s for g in segments), "modes": [g.mode for g in segments],
            "rounds": sum(g.rounds for g in segments), "mean_accepted_length": final.stats.mean_accepted_length}


def valid(task: dict[str, Any], out: dict[str, Any]) -> bool:
    """Whether the answer has the asked shape: calls of the allowed tools with schema-valid arguments, or a
    JSON value valid for the schema."""
    try:
        if task["kind"] == "json":
            jsonschema.validate(json.loads(out["text"]), task["schema"])
            return True
        allowed = {t["function"]["name"]: t["function"].get("parameters") or {} for t in task["tools"]}
        choice = task["tool_choice"]
        if isinstance(choice, dict):
            allowed = {k: v for k, v in allowed.items() if k == choice["function"]["name"]}
        if not out["calls"] or out["text"].strip():
            return False
        for name, args in out["calls"]:
            jsonschema.validate(json.loads(args), allowed[name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tool-prompts", type=int, default=32)
    ap.add_argument("--json-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/structured")
    args = ap.parse_args(argv)
    if args.quick:
        args.tool_prompts, args.json_prompts, args.out = 4, 3, args.out + "_quick"
    os.sched_setaffinity(0, {0})  # the client's machine: core 0; the verifiers are pinned to core 1
    torch.set_num_threads(1)
    tasks = tool_tasks(args.tool_prompts) + json_tasks(args.json_prompts)
    warm = tool_task(common.warmup_prompt())  # a prompt no method is measured on
    from transformers import AutoTokenizer

    from agentspec.models import offline_model_path

    gguf = offline_model_path(TARGET)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    methods = CONSTRAINED + UNCONSTRAINED
    # one API key and one client per method: the server's cross-conversation copy index is per key and the
    # client's is per client, so every method drafts from its own past answers only — never from another
    # method's answer to the same prompt moments before (which would favour whichever ran later)
    keys = [a for m in methods for a in ("--api-key", f"bench-{m}")]
    servers = {False: Verifier(args.dtype, "--jump-forward", "off", *keys, threads=1, target=TARGET, cpus="1"),
               True: Verifier(args.dtype, *keys, threads=1, target=TARGET, cpus="1")}
    clients = {m: SpecClient(servers[m not in NO_JUMP].url, api_key=f"bench-{m}", drafter=NgramDrafter(),
                             tokenizer=tok, num_draft_tokens=6, timeout=600) for m in methods}
    try:
        for m in methods:  # warm-up: every method once, untimed, on a prompt that is not measured
            run_one(clients[m], warm, m, 24)
        rows: list[dict[str, Any]] = []
        partial = Path(args.out + ".rows.jsonl")  # each prompt's row as it is done (a cut run keeps them)
        partial.write_text("")
        for i, task in enumerate(tasks):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            outs = {m: run_one(clients[m], task, m, args.max_new_tokens) for m in order}
            ref = outs["masked_plain"]["tokens"]
            row = {"id": task["id"], "kind": task["kind"],
                   "identical": {m: outs[m]["tokens"] == ref for m in CONSTRAINED},
                   "valid": valid(task, outs["masked_plain"]), "finish": outs["masked_plain"]["finish"],
                   "methods": {m: {k: v for k, v in o.items() if k not in ("tokens",)} for m, o in outs.items()}}
            rows.append(row)
            with partial.open("a") as f:
                f.write(json.dumps(row) + "\n")
            log(f"{i + 1}/{len(tasks)} {task['id']} valid={row['valid']} identical={all(row['identical'].values())}"
                f" tokens={len(ref)} " + " ".join(f"{m}={o['decode_s']:.2f}s" for m, o in outs.items()))
    finally:
        for v in servers.values():
            v.close()
    result = summarise(rows, args)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["acceptance"], indent=1))
    return 0


def summarise(rows: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    def rate(m: str, kind: str | None = None) -> float:
        sel = [r["methods"][m] for r in rows if kind is None or r["kind"] == kind]
        s, n = sum(o["decode_s"] for o in sel), sum(o["decode_tokens"] for o in sel)
        return s / n if n else float("nan")  # seconds per decoded token

    per_token = {m: rate(m) for m in CONSTRAINED + UNCONSTRAINED}
    speedup = {m: per_token["masked_plain"] / per_token[m] for m in CONSTRAINED}
    speedup.update({m: per_token["plain"] / per_token[m] for m in UNCONSTRAINED})
    by_kind = {k: {m: (rate("masked_plain", k) if m in CONSTRAINED else rate("plain", k)) / rate(m, k)
                   for m in CONSTRAINED + UNCONSTRAINED} for k in ("tool", "json")}
    best = max(("server", "edge", "auto"), key=lambda m: speedup[m])
    pair = {"server": "server_unconstrained", "edge": "edge_unconstrained"}
    vs_unc = {m: speedup[m] / speedup[u] for m, u in pair.items()}
    identical = all(all(r["identical"].values()) for r in rows)
    accept = {
        "identical_to_masked_plain": identical,
        "schema_valid_frac": sum(r["valid"] for r in rows) / len(rows),
        "schema_valid_frac_finished": (sum(r["valid"] for r in rows if r["finish"] != "length")
                                       / max(1, sum(r["finish"] != "length" for r in rows))),
        "tool_prompts": sum(r["kind"] == "tool" for r in rows), "json_prompts": sum(r["kind"] == "json" for r in rows),
        "best_constrained_mode": best, "speedup_vs_masked_plain": speedup[best],
        "constrained_vs_unconstrained_speedup": vs_unc.get(best, min(vs_unc.values())),
        "constrained_vs_unconstrained_speedup_min": min(vs_unc.values()),
        "jump_forward_vs_drafted_forced": per_token["server_drafted"] / per_token["server"],
        "targets": {"identical_to_masked_plain": True, "schema_valid_frac": 1.0, "speedup_vs_masked_plain": 1.3,
                    "constrained_vs_unconstrained_speedup": 1.0},
    }
    return {"acceptance": accept, "speedup": speedup, "speedup_by_kind": by_kind,
            "ms_per_token": {m: 1e3 * v for m, v in per_token.items()},
            "constrained_vs_unconstrained_by_mode": vs_unc,
            "setup": {"target": TARGET, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "server": "2 agentspec-verifier processes, taskset core 1, 1 thread (jump-forward off / on); "
                                "one API key (own cross-conversation copy index) and one client per method",
                      "client": "core 0, 1 thread; edge drafter = grammar + copy + n-gram tree",
                      "machine": common.machine_info()},
            "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
