"""The real pair at the edge: Qwen2.5-Coder-1.5B-Instruct verified on a server core, Qwen2.5-Coder-0.5B-Instruct
drafting on the client's core, on BFCL tool-calling prompts (issue 23, item 2).

Run: ``python -m benchmarks.pair`` (alone on the machine; ~25 minutes on 2 cores with native bf16) or
``--quick`` (3 prompts). Writes ``benchmarks/results/pair.json`` (``pair_quick.json``).

One ``agentspec-verifier`` serving the 1.5B in ``--dtype`` (default bfloat16: the 1.5B needs > 8.5 GB to load
in float32 here) pinned to core 1 with ``taskset`` and one thread, as a server machine of its own; this
client pinned to core 0 with one thread, as the agent's machine. Greedy, tool_choice ``auto`` (what an agent
sends), one API key and one client per method (the copy indexes hold that method's own answers only).
Methods, per prompt in rotated order, after an untimed warm-up of each on a prompt outside the set:

* ``plain`` — server-ar: one target pass per token (the reference);
* ``server`` — the verifier drafts (grammar + copy, no draft model on the server);
* ``edge_grammar`` — the client drafts with grammar + copy + n-gram (no model);
* ``edge_0.5b`` — the client drafts with the 0.5B merged into the same tree (grammar + copy + model);
* ``auto`` — the router chooses per segment among edge (0.5B), server and server-ar.

Decode speed: committed tokens over the wall time of the request's segments (every round as the client saw
it, loopback included; the session's open and the prompt's prefill left out), pooled over prompts. In bf16
an output may differ from plain's where the target's top two logits tie within bf16's rounding (the
computation path differs between a 1-token pass and a k-token pass); the row says which methods differ.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from agentspec import models
from agentspec.client import FinalEvent, SpecClient
from agentspec.drafters import ModelDrafter, NgramDrafter
from benchmarks import common
from benchmarks.common import log
from benchmarks.server import Verifier

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
MODE = {"plain": "server-ar", "server": "server", "edge_grammar": "edge", "edge_0.5b": "edge", "auto": "auto"}


def run_call(client: SpecClient, p: common.Prompt, mode: str, max_tokens: int) -> dict[str, Any]:
    final = None
    for ev in client.stream(list(p.messages), list(p.tools), max_tokens=max_tokens, mode=mode):
        final = ev if isinstance(ev, FinalEvent) else final
    assert final is not None
    seg = final.stats.segments
    return {"tokens": final.tokens, "calls": [(c.name, c.arguments) for c in final.tool_calls],
            "decode_s": sum(g.wall_s for g in seg), "decode_tokens": sum(g.tokens for g in seg),
            "rounds": sum(g.rounds for g in seg), "modes": [g.mode for g in seg],
            "mean_accepted_length": final.stats.mean_accepted_length}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--num-draft-tokens", type=int, default=6)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/pair")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.out = 3, args.out + "_quick"
    os.sched_setaffinity(0, {0})  # the agent's machine: core 0; the verifier is pinned to core 1
    torch.set_num_threads(1)
    prompts = common.bfcl_prompts(args.prompts, ("simple_python", "multiple", "live_simple", "live_multiple"))
    warm = common.warmup_prompt()
    drafter = models.load_model(DRAFTER, device="cpu", dtype=args.dtype)
    methods = tuple(MODE)
    keys = [a for m in methods for a in ("--api-key", f"bench-{m}")]
    t0 = time.perf_counter()
    srv = Verifier(args.dtype, *keys, threads=1, target=TARGET, cpus="1")
    load_s = time.perf_counter() - t0

    def client(m: str) -> SpecClient:
        local = ModelDrafter(drafter) if m in ("edge_0.5b", "auto") else NgramDrafter()
        return SpecClient(srv.url, api_key=f"bench-{m}", drafter=local, tokenizer=drafter.tokenizer,
                          num_draft_tokens=args.num_draft_tokens, timeout=900)

    clients = {m: client(m) for m in methods}
    rows: list[dict[str, Any]] = []
    try:
        for m in methods:
            run_call(clients[m], warm, MODE[m], 16)
        for i, p in enumerate(prompts):
            order = methods[i % len(methods):] + methods[: i % len(methods)]
            outs = {m: run_call(clients[m], p, MODE[m], args.max_new_tokens) for m in order}
            ref = outs["plain"]["tokens"]
            rows.append({"id": p.id, "tokens": len(ref), "identical": {m: o["tokens"] == ref for m, o in outs.items()},
                         "methods": {m: {k: v for k, v in o.items() if k != "tokens"} for m, o in outs.items()}})
            log(f"{i + 1}/{len(prompts)} {p.id} tokens={len(ref)} " + " ".join(
                f"{m}={o['decode_s']:.2f}s{'' if o['tokens'] == ref else '(differs)'}" for m, o in outs.items()))
        peak = srv.peak_rss()
    finally:
        srv.close()
        for c in clients.values():
            c.close()
    result = summarise(rows, args, load_s, peak)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["acceptance"], indent=1))
    return 0


def summarise(rows: list[dict[str, Any]], args: Any, load_s: float, peak_rss: int) -> dict[str, Any]:
    def per_token(m: str) -> float:
        s = sum(r["methods"][m]["decode_s"] for r in rows)
        return s / max(1, sum(r["methods"][m]["decode_tokens"] for r in rows))

    ms = {m: 1e3 * per_token(m) for m in MODE}
    speedup = {m: ms["plain"] / ms[m] for m in MODE}
    best = max(("server", "edge_grammar", "edge_0.5b"), key=speedup.__getitem__)
    accepted = {m: sum(r["methods"][m]["decode_tokens"] for r in rows) / max(1, sum(r["methods"][m]["rounds"]
                                                                                    for r in rows)) for m in MODE}
    identical = {m: sum(r["identical"][m] for r in rows) for m in MODE}
    accept = {"prompts": len(rows), "dtype": args.dtype, "identical_to_plain": identical,
              "best_fixed_mode": best, "decode_speedup_best": round(speedup[best], 3),
              "decode_speedup_edge_0.5b": round(speedup["edge_0.5b"], 3),
              "edge_0.5b_vs_edge_grammar": round(ms["edge_grammar"] / ms["edge_0.5b"], 3),
              "auto_vs_best": round(ms[best] / ms["auto"], 3),
              "targets": {"decode_speedup_best": 3.0, "auto_vs_best": 0.95}}
    return {"acceptance": accept, "ms_per_token": ms, "speedup": speedup, "tokens_per_round": accepted,
            "setup": {"target": TARGET, "drafter": DRAFTER, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                      "num_draft_tokens": args.num_draft_tokens,
                      "server": "agentspec-verifier, taskset core 1, 1 thread, no draft model",
                      "client": "core 0, 1 thread; edge drafters: grammar + copy + n-gram, or + the 0.5B",
                      "verifier_load_s": round(load_s, 1), "verifier_peak_rss_bytes": peak_rss,
                      "machine": common.machine_info()},
            "rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
