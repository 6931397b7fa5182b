"""What an edge round's size costs on the verifier: ``verify_ms`` by draft nodes, over HTTP, one session.

``python -m benchmarks.verify_rows`` starts ``agentspec-verifier`` with the 1.5B (bf16, taskset core 1,
one thread), opens one session on a fixed 1,500-token prompt and sends edge rounds whose drafts are
binary-ish trees of 0 … 16 nodes (a pass over nodes + 1 rows: the pending token rides along), sizes
interleaved per repetition so drift hits them alike. Each round's ``timings.verify_ms`` is the server's
own pass time. Prints and writes ``benchmarks/results/verify_rows.json``: the median by nodes, its
ratio to an empty round, and the ``flat_draft_tokens`` the verifier reported from its warm-up curve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import httpx

from benchmarks import common
from benchmarks.common import log
from benchmarks.server import Verifier

TARGET = "qwen2.5-coder-1.5b-instruct"


def tree(nodes: int) -> dict[str, Any]:
    """A draft of ``nodes`` nodes, each node's parent the one at half its index (0: no draft)."""
    if nodes == 0:
        return {"tokens": []}
    return {"tokens": [11] * nodes, "parents": [-1] + [i // 2 for i in range(nodes - 1)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="0,5,10,14,15,16", help="draft sizes, comma-separated (0 … 16)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--context", type=int, default=1500, help="prompt tokens of the session")
    ap.add_argument("--out", default="benchmarks/results/verify_rows")
    args = ap.parse_args(argv)
    sizes = [int(n) for n in args.nodes.split(",")]
    if any(not 0 <= n <= 16 for n in sizes) or 0 not in sizes:
        ap.error(f"--nodes takes sizes in 0 … 16 and must include 0 (the base), got {args.nodes}")
    if args.reps < 1 or args.context < 1:
        ap.error("--reps and --context must be >= 1")
    os.sched_setaffinity(0, {0})  # the client's core; the verifier is pinned to core 1
    srv = Verifier("bfloat16", threads=1, target=TARGET, cpus="1")
    try:
        client = httpx.Client(base_url=srv.url, timeout=600)
        prompt = [(i * 7919) % 150000 for i in range(args.context)]
        info = client.post("/v1/spec/sessions", json={"prompt_ids": prompt, "max_new_tokens": 4000,
                                                        "stop_token_ids": []}).json()
        sid, base = info["session_id"], len(prompt)
        samples: dict[int, list[float]] = {n: [] for n in sizes}
        for rep in range(args.reps + 1):  # repetition 0 is a warm-up
            for n in sizes:
                body = {"base_len": base, "draft": tree(n), "sampling": {}}
                reply = client.post(f"/v1/spec/sessions/{sid}/rounds", json=body)
                if reply.is_error:
                    raise SystemExit(f"round of {n} nodes refused ({reply.status_code}): {reply.text}")
                base = reply.json()["committed_len"]
                if rep:
                    samples[n].append(reply.json()["timings"]["verify_ms"])
    finally:
        srv.close()
    median = {n: statistics.median(v) for n, v in samples.items()}
    rows = {n: {"pass_rows": n + 1, "verify_ms": round(median[n], 1), "ratio": round(median[n] / median[0], 3)}
            for n in sizes}
    for n, r in rows.items():
        log(f"{n:2d} nodes ({r['pass_rows']} rows): {r['verify_ms']} ms, x{r['ratio']}")
    result = {"acceptance": {"flat_draft_tokens_reported": info.get("flat_draft_tokens"),
                             "ratio_by_nodes": {n: r["ratio"] for n, r in rows.items()}},
              "rows": rows, "setup": {"target": TARGET, "dtype": "bfloat16", "context": args.context,
                                      "reps": args.reps, "server": "taskset core 1, 1 thread",
                                      "machine": common.machine_info()}}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["acceptance"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
