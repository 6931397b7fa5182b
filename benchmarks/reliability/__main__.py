"""The reliability suite (issue 20): real verifiers on loopback, no mocks.

    .venv/bin/python -m benchmarks.reliability --short   # CI: <= 5 minutes on 2 cores
    .venv/bin/python -m benchmarks.reliability           # long run -> benchmarks/results/reliability.json

Checks, in order: the bad-input matrix (bystander session after each case), schemathesis over the served
OpenAPI (when installed), the poisoned tenant, fault injection inside rounds, slow and greedy clients,
exhausted open files, head-of-line blocking behind a long prefill, the kill loop (verifier failover, then
the API fallback) and the soak. The JSON's ``acceptance`` holds
issue 20's figures, each measured here; ``settings`` says what was run (a shortened long run says so).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.reliability import badinput, kill, load, tenants
from benchmarks.reliability.common import CLIENT_CPU, SERVER_CPU, log, machine_info, pin, tiny_model

RESULTS = Path(__file__).resolve().parents[1] / "results"
SHORT = {"schemathesis_examples": 5, "cross_tenant_s": 15.0, "kill_runs": 6, "kill_api_runs": 2,
         "hol_repeats": 5,
         "hol_prompt_tokens": 2048, "prefill_chunk_tokens": 256, "soak_clients": 4, "soak_s": 60.0}
LONG = {"schemathesis_examples": 100, "cross_tenant_s": 60.0, "kill_runs": 100, "kill_api_runs": 20,
        "hol_repeats": 10,
        "hol_prompt_tokens": 4096, "prefill_chunk_tokens": 256, "soak_clients": 16, "soak_s": 600.0}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reliability", description=__doc__.split("\n")[0])
    p.add_argument("--short", action="store_true", help="the CI mode (<= 5 minutes on 2 cores)")
    p.add_argument("--out", type=Path, help="JSON path (default: results/reliability.json, or "
                                            "results/reliability_short.json with --short)")
    for k, v in LONG.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), help=f"override (long {v}, short {SHORT[k]})")
    p.add_argument("--only", nargs="*", help="run only these checks (names as in the JSON's checks)")
    p.add_argument("--check", action="store_true", help="exit 1 when a correctness figure fails (CI); "
                   "timing figures (head-of-line, RSS growth) are reported, not enforced")
    return p.parse_args()


ZERO = ("bad_input_5xx", "bad_input_hangs", "schemathesis_failures", "cross_tenant_errors", "cross_tenant_evictions",
        "rounds_not_rolled_back", "kill_loop_not_identical", "kill_loop_api_fallback_not_identical", "soak_errors")
TRUE = ("slow_body_408_in_time", "beyond_max_connections_503", "served_after_connection_flood", "fd_exhaustion_ok")


def failed(acc: dict[str, Any], checks: dict[str, dict[str, Any]]) -> list[str]:
    """The correctness figures that fail (a check that crashed fails; one not run is not judged)."""
    out = [f"{name} crashed" for name, c in checks.items() if "crashed" in c]
    out += [f"{k} = {acc[k]}" for k in ZERO if acc.get(k) not in (0, None)]
    out += [f"{k} = {acc[k]}" for k in TRUE if acc.get(k) is False]
    return out


def guarded(name: str, fn, *args: Any) -> dict[str, Any]:
    """One check; a crash is recorded as its result (its figures then stay null) rather than ending the run."""
    t0 = time.monotonic()
    log(f"== {name}")
    try:
        out = fn(*args)
    except Exception as e:
        log(f"{name} crashed: {e!r}")
        out = {"crashed": traceback.format_exc()[-2000:]}
    out["check_wall_s"] = round(time.monotonic() - t0, 1)
    return out


def acceptance(c: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def g(check: str, key: str) -> Any:
        return c.get(check, {}).get(key)
    return {
        "bad_input_5xx": g("bad_input", "5xx"), "bad_input_hangs": g("bad_input", "hangs"),
        "schemathesis_failures": g("schemathesis", "failures"),
        "cross_tenant_errors": g("cross_tenant", "b_errors"),
        "cross_tenant_evictions": g("cross_tenant", "b_idle_session_evicted"),
        "rounds_not_rolled_back": g("rollback", "not_rolled_back"),
        "kill_loop_runs": g("kill_loop", "runs"), "kill_loop_not_identical": g("kill_loop", "not_identical"),
        "kill_loop_api_fallback_runs": g("kill_loop", "api_runs"),
        "kill_loop_api_fallback_not_identical": g("kill_loop", "api_not_identical"),
        "hol_p95_wait_s": g("head_of_line", "p95_wait_s"), "hol_one_chunk_s": g("head_of_line", "one_chunk_s"),
        "hol_limit_s": g("head_of_line", "limit_s"),
        "hol_mean_chunk_s_in_long_prefill": g("head_of_line", "mean_chunk_s_in_long_prefill"),
        "hol_one_round_p95_wait_s": g("head_of_line", "round_p95_wait_s"),
        "soak_errors": g("soak", "errors"), "soak_rss_growth_frac": g("soak", "rss_growth_frac"),
        "slow_body_408_in_time": g("slow_clients", "stalled_body_ok"),
        "beyond_max_connections_503": g("slow_clients", "beyond_cap_ok"),
        "served_after_connection_flood": g("slow_clients", "server_alive"),
        "fd_exhaustion_ok": g("fd_exhaustion", "ok"),
        "fd_exhaustion_log_lines": g("fd_exhaustion", "too_many_open_files_log_lines"),
    }


def write(out_path: Path, mode: str, t0: float, pinned: str, settings: dict, overridden: dict,
          only: list[str] | None, checks: dict, planned: list[str]) -> dict[str, Any]:
    """The JSON so far (rewritten after each check, so an interrupted run keeps what it measured)."""
    result = {"mode": mode, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "wall_s": round(time.monotonic() - t0, 1), "machine": {**machine_info(), "this_process_pinning": pinned,
                                                                     "verifier_subprocess_cpu": SERVER_CPU},
              "settings": {**settings, "overridden": overridden, "only": only},
              "complete": all(n in checks for n in planned if not only or n in only),
              "acceptance": acceptance(checks), "checks": checks}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def main() -> None:
    args = parse()
    settings = dict(SHORT if args.short else LONG)
    overridden = {k: getattr(args, k) for k in settings if getattr(args, k) is not None}
    settings.update(overridden)
    mode = "short" if args.short else "long" if not overridden else "long, shortened"
    out_path = args.out or RESULTS / ("reliability_short.json" if args.short else "reliability.json")
    pinned = pin(os.getpid(), CLIENT_CPU)  # before torch starts threads: they inherit the mask
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(1)  # this process has one core; verifier subprocesses get OMP_NUM_THREADS=1
    log(f"reliability suite, {mode} mode; this process (clients, in-process verifiers): {pinned}; "
        f"verifier subprocesses: cpu {SERVER_CPU}")
    t0 = time.monotonic()
    target = tiny_model(0)
    checks: dict[str, dict[str, Any]] = {}
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        root = Path(tmp)
        plan = {
            "bad_input": (badinput.run, target),
            "schemathesis": (badinput.schemathesis_run, target, settings["schemathesis_examples"]),
            "cross_tenant": (tenants.cross_tenant, target, settings["cross_tenant_s"]),
            "rollback": (tenants.rollback, target),
            "slow_clients": (load.slow_clients, root, target),
            "fd_exhaustion": (load.fd_exhaustion, root, target),
            "head_of_line": (load.hol, root, settings["hol_repeats"], settings["hol_prompt_tokens"],
                             settings["prefill_chunk_tokens"]),
            "kill_loop": (kill.run, target, settings["kill_runs"], root, 400, settings["kill_api_runs"]),
            "soak": (load.soak, root, target, settings["soak_clients"], settings["soak_s"]),
        }
        for name, (fn, *fargs) in plan.items():
            if args.only and name not in args.only:
                continue
            checks[name] = guarded(name, fn, *fargs)
            result = write(out_path, mode, t0, pinned, settings, overridden, args.only, checks, list(plan))
    log(f"done in {result['wall_s']} s -> {out_path}")
    print(json.dumps(result["acceptance"], indent=1))
    if args.check and (bad := failed(result["acceptance"], checks)):
        raise SystemExit("reliability: failed: " + "; ".join(bad))


if __name__ == "__main__":
    main()
