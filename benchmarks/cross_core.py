"""How much one core's work slows the other's, and how much the VM's speed drifts meanwhile.

``benchmarks/agent.py`` pins the verifier to core 1 and the agent with its local drafter to core 0, as two
machines would be. On a VM the two vCPUs share the host's memory bandwidth and last-level cache (and may be
SMT siblings), so the client's drafting, which overlaps the verifier's pass in pipelined edge rounds, could
slow that pass where two machines would not; plain decoding leaves core 0 idle. And the host's other tenants
move both cores' speed from minute to minute, which falls on whichever method runs then.

``python -m benchmarks.cross_core`` measures both with memory-bound stand-ins (synthetic bf16 weights, not
the models): the verifier's pass (``--server-gb`` of weights against 8 rows, a tree of 8 tokens) on core 1
and a drafting step (``--client-gb`` against one row) on core 0, in interleaved phases (each alone, both at
once), so the drift falls on both sides of the comparison alike (measured one after the other, drift passes
for a slowdown); the per-cycle medians alone show the drift.

Writes ``benchmarks/results/cross_core.json`` with an ``"acceptance"`` object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import log, machine_info

OUT = Path(__file__).resolve().parent / "results" / "cross_core.json"
DIM, HIDDEN = 1536, 8960  # the 1.5B's MLP shape: one matrix of it is 27.5 MB in bf16


# phases of a cycle: which of (server, client) runs; alone and beside each other interleave, so the VM's drift
# (other tenants' load moving either core's speed within minutes) falls on both alike
PHASES = ((True, False), (True, True), (False, True), (True, True))


def worker(role: int, core: int, gigabytes: float, rows: int, phase_s: float, cycles: int, start_at: float
           ) -> dict[str, Any]:
    """Passes of ``rows`` bf16 rows over ``gigabytes`` of weights on ``core``, from the wall time ``start_at``
    (once its weights are made) through ``cycles`` of :data:`PHASES` of ``phase_s`` each, in the phases where
    ``role`` (0: server, 1: client) runs; the median pass alone and beside the other (a pass that spans two
    phases is not counted)."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    count = max(int(gigabytes * 1e9 / (DIM * HIDDEN * 2)), 1)
    weights = [torch.randn(HIDDEN, DIM, dtype=torch.bfloat16) for _ in range(count)]
    x = torch.randn(rows, DIM, dtype=torch.bfloat16)
    for w in weights:  # touch every page once before timing
        x @ w.T
    time.sleep(max(start_at - time.time(), 0.0))
    times: dict[bool, list[float]] = {False: [], True: []}  # beside the other?
    per_cycle: list[list[float]] = [[] for _ in range(cycles)]  # alone: how the VM's speed drifts
    def phase_of(t: float) -> int:
        return int((t - start_at) / phase_s)

    while (k := phase_of(time.time())) < cycles * len(PHASES):
        runs = PHASES[k % len(PHASES)]
        if not runs[role]:
            time.sleep(0.005)
            continue
        t0 = time.perf_counter()
        for w in weights:
            x @ w.T
        took = time.perf_counter() - t0
        if phase_of(time.time()) == k:
            times[runs[1 - role]].append(took)
            if not runs[1 - role]:
                per_cycle[k // len(PHASES)].append(took)
    def median(v: list[float]) -> float | None:
        return round(1e3 * sorted(v)[len(v) // 2], 2) if v else None

    return {"alone_ms": median(times[False]), "beside_ms": median(times[True]),
            "alone_ms_per_cycle": [median(v) for v in per_cycle], "passes": {"alone": len(times[False]),
            "beside": len(times[True])}, "gigabytes": round(count * DIM * HIDDEN * 2 / 1e9, 3)}


def spawn(*args: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "benchmarks.cross_core", "--worker", *map(str, args)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)


def collect(*procs: subprocess.Popen) -> list[dict[str, Any]]:
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"a worker failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        role, core, gigabytes, rows, phase_s, cycles, start_at = argv[1:8]
        print(json.dumps(worker(int(role), int(core), float(gigabytes), int(rows), float(phase_s), int(cycles),
                                float(start_at))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server-gb", type=float, default=3.0, help="the verifier's weights (the 1.5B in bf16: ~3.1)")
    ap.add_argument("--client-gb", type=float, default=0.6, help="the drafter's weights touched per step")
    ap.add_argument("--phase-s", type=float, default=4.0, help="seconds per phase (alone / beside)")
    ap.add_argument("--cycles", type=int, default=5, help="cycles of the four phases")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if (os.cpu_count() or 1) < 2:
        ap.error("needs two cores: the verifier's (1) and the client's (0)")
    if args.phase_s <= 0 or args.cycles < 1 or args.server_gb <= 0 or args.client_gb <= 0:
        ap.error("--phase-s, --server-gb and --client-gb take positive numbers, --cycles at least 1")
    start_at = time.time() + 25  # both have made and touched their weights by then
    server, client = collect(spawn(0, 1, args.server_gb, 8, args.phase_s, args.cycles, start_at),
                             spawn(1, 0, args.client_gb, 1, args.phase_s, args.cycles, start_at))
    accept = {"server_slowdown": round(server["beside_ms"] / server["alone_ms"], 3),
              "client_slowdown": round(client["beside_ms"] / client["alone_ms"], 3)}
    log(f"core 1 pass (verifier stand-in, {server['gigabytes']} GB x 8 rows): alone {server['alone_ms']} ms, "
        f"beside core 0's work {server['beside_ms']} ms ({accept['server_slowdown']}x)")
    log(f"core 1 alone, per cycle: {server['alone_ms_per_cycle']} ms; core 0: {client['alone_ms_per_cycle']} ms")
    log(f"core 0 step (drafter stand-in, {client['gigabytes']} GB x 1 row): alone {client['alone_ms']} ms, "
        f"beside core 1's work {client['beside_ms']} ms ({accept['client_slowdown']}x)")
    result: dict[str, Any] = {"acceptance": accept, "server": server, "client": client,
                              "setup": {**vars(args), "dtype": "bfloat16", "weights": "synthetic (torch.randn)",
                                        "threads": 1, "machine": machine_info()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
