"""Resident memory of a loaded model: how close steady-state RSS comes to the weights themselves.

``python -m benchmarks.memory`` loads each (model, dtype) case in a fresh child process (so ``VmHWM`` is that
load's peak) through :func:`agentspec.models.load_model` on the CPU with packed linears, and reads
``/proc/self/status`` at each point: before the load (torch, transformers and agentspec imported), after it
(the steady state a server keeps), and after a short greedy generation. It compares that with the weights'
own bytes as loaded (:func:`agentspec.models.resident_weight_bytes`, packed copies included).

``--baseline DIR`` measures the same cases again with the ``agentspec`` package found in ``DIR`` (e.g. an
older commit exported with ``git archive``) and reports both: what a change to loading bought.

Writes ``benchmarks/results/memory.json`` with an ``"acceptance"`` object.
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

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "memory.json"
# fp32 is left out for the 1.5B: ~7.1 GB of fp32 weights on a 24 GiB machine shared with other work
CASES = (("qwen2.5-coder-0.5b-instruct", "float32"), ("qwen2.5-coder-0.5b-instruct", "bfloat16"),
         ("qwen2.5-coder-1.5b-instruct", "bfloat16"))
PROMPT = "Write a Python function that returns the square of a number. Only the code."


def status_gb() -> dict[str, float]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) of this process, in GB (10^9 bytes)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(value.split()[0]) * 1024 / 1e9, 3)
    return out


def child(alias: str, dtype: str, threads: int) -> dict[str, Any]:
    """One case, in this (fresh) process: memory before and after loading, and after a short generation."""
    import torch
    import transformers  # noqa: F401 (imported before the first reading, like the load will)

    from agentspec import models

    torch.set_num_threads(threads)
    if alias in models.OFFLINE_MODELS:
        source = alias
        models.offline_model_path(alias)  # assemble the GGUF outside the measured load
    else:  # a baseline older than the alias: the same file, assembled by the current tree
        source = str(models.cache_dir() / "models" / f"{alias}-q4_k_m.gguf")
    before = status_gb()
    start = time.perf_counter()
    lm = models.load_model(source, device="cpu", dtype=dtype)
    load_s = time.perf_counter() - start
    loaded = status_gb()
    weights = models.resident_weight_bytes(lm.model) / 1e9
    head, embed = lm.model.get_output_embeddings(), lm.model.get_input_embeddings()
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=24, do_sample=False)
    text = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    generated = status_gb()
    return {
        "model": alias, "dtype": dtype, "agentspec_from": str(Path(models.__file__).parents[2]),
 "load_seconds": round(load_s, 1), "weights_gb": round(weights, 3),
        "packed": models.is_packed(lm.model), "head_tied": head.weight.data_ptr() == embed.weight.data_ptr(),
        "before_load": before, "after_load": loaded, "after_generate": generated,
        "rss_over_weights": round(loaded["VmRSS"] / weights, 3),
        "load_rss_over_weights": round((loaded["VmRSS"] - before["VmRSS"]) / weights, 3),
        "peak_over_weights": round(loaded["VmHWM"] / weights, 3), "sample": text,
    }


def run_case(alias: str, dtype: str, threads: int, tree: Path | None) -> dict[str, Any]:
    """``child`` in a fresh interpreter, importing ``agentspec`` from ``tree`` when given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree or ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", alias, dtype, "--threads", str(threads)]
    done = subprocess.run(cmd, cwd=tree or ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{alias} {dtype} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def line(tag: str, r: dict[str, Any]) -> str:
    """One printed line per case."""
    return (f"{tag:6s} {r['model']:28s} {r['dtype']:8s} weights {r['weights_gb']:.2f} GB | after load "
            f"VmRSS {r['after_load']['VmRSS']:.2f} GB VmHWM {r['after_load']['VmHWM']:.2f} GB | "
            f"after generate VmRSS {r['after_generate']['VmRSS']:.2f} GB | "
            f"RSS/weights {r['rss_over_weights']:.2f} "
            f"(load's own {r['load_rss_over_weights']:.2f}) | load {r['load_seconds']:.0f}s")


def main() -> None:
    """Parse the arguments, run every case (and the baseline's), print and write the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=2, metavar=("ALIAS", "DTYPE"), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    parser.add_argument("--baseline", type=Path,
                        help="a directory holding an older agentspec package to compare with")
    parser.add_argument("--models", nargs="*", help="only cases of these aliases (default: every case)")
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: %(default)s)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.threads)))
        return
    from benchmarks.common import machine_info

    cases = [c for c in CASES if not args.models or c[0] in args.models]
    results: dict[str, Any] = {"machine": machine_info(), "cases": [], "baseline": []}
    for alias, dtype in cases:
        if args.baseline is not None:
            results["baseline"].append(run_case(alias, dtype, args.threads, args.baseline.resolve()))
            print(line("before", results["baseline"][-1]), flush=True)
        results["cases"].append(run_case(alias, dtype, args.threads, None))
        print(line("after", results["cases"][-1]), flush=True)
    short = {"float32": "fp32", "bfloat16": "bf16"}
    acceptance: dict[str, Any] = {}
    for r in results["cases"]:
        key = f"{'1.5b' if '1.5b' in r['model'] else '0.5b'}_{short[r['dtype']]}"
        acceptance[f"rss_over_weights_{key}"] = r["rss_over_weights"]
        acceptance[f"load_peak_gb_{key}"] = r["after_load"]["VmHWM"]
        acceptance[f"steady_rss_gb_{key}"] = r["after_load"]["VmRSS"]
    for r in results["baseline"]:
        key = f"{'1.5b' if '1.5b' in r['model'] else '0.5b'}_{short[r['dtype']]}"
        acceptance[f"baseline_steady_rss_gb_{key}"] = r["after_load"]["VmRSS"]
        acceptance[f"baseline_load_peak_gb_{key}"] = r["after_load"]["VmHWM"]
    acceptance["no_second_copy"] = all(r["load_rss_over_weights"] < 1.15 for r in results["cases"])
    results["acceptance"] = acceptance
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({"acceptance": acceptance}, indent=2))


if __name__ == "__main__":
    main()
