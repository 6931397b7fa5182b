"""The real pair on one accelerator: Qwen2.5-Coder-1.5B-Instruct as target and Qwen2.5-Coder-0.5B-Instruct
drafting, both on ``--device`` (CUDA when a GPU is lent), in-process, on BFCL tool-calling prompts (issue 23).

Runs with a bare torch + transformers + gguf install (no server stack), so it can run where nothing can be
fetched: the GGUF files and a prompts file (``--write-prompts`` makes one where BFCL is installed) are
passed as paths. Per dtype (bf16 for speed, fp32 for the lossless check), after an untimed warm-up:

* ``plain`` — one target pass per token (the reference);
* ``grammar_copy`` — agentspec's default tree without a model: grammar-forced spans + copy candidates;
* ``model_0.5b`` — the 0.5B drafting a chain;
* ``default_0.5b`` — the default tree with the 0.5B merged in (what a deployment drafts with).

Each drafting method gets a draft-length policy seeded with the target's verify-cost curve measured on
this device (synchronised). Wall times wait for the device's queued work. Decode rate: tokens after the
first round over the time after it (prefill left out); end-to-end: the whole call. Writes ``OUT.json``
with an ``"acceptance"`` object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agentspec import models, router
from agentspec.drafters.copy import SuffixIndex
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.tree import default_drafter
from agentspec.local import SpecEngine
from agentspec.toolcalls import render_chat
from agentspec.types import SamplingParams, SpecStats
from benchmarks import common
from benchmarks.common import log

METHODS = ("plain", "grammar_copy", "model_0.5b", "default_0.5b")


def write_prompts(path: Path, n: int) -> None:
    """Write ``n`` BFCL prompts plus the warm-up prompt as JSON (needs the ``bfcl-eval`` wheel)."""
    prompts = common.bfcl_prompts(n)
    rows = [{"id": p.id, "messages": list(p.messages), "tools": list(p.tools)}
            for p in [common.warmup_prompt(prompts), *prompts]]
    path.write_text(json.dumps(rows))


def build_methods(target: models.LoadedModel, drafter: models.LoadedModel, curve: dict[int, float],
                  k: int) -> dict[str, SpecEngine]:
    tok = target.tokenizer

    def policy() -> router.DraftLengthPolicy:
        return router.DraftLengthPolicy.from_calibration(curve)

    return {
        "plain": SpecEngine(target, None),
        "grammar_copy": SpecEngine(target, default_drafter(tok, index=SuffixIndex(), verify_costs=curve),
                                   num_draft_tokens=k, draft_policy=policy()),
        "model_0.5b": SpecEngine(target, ModelDrafter(drafter), num_draft_tokens=k, draft_policy=policy()),
        "default_0.5b": SpecEngine(target, default_drafter(tok, model=ModelDrafter(drafter), index=SuffixIndex(),
                                                           verify_costs=curve),
                                   num_draft_tokens=k, draft_policy=policy()),
    }


def timed_call(engine: SpecEngine, ids: list[int], tools: list[dict], max_new: int) -> dict[str, Any]:
    device = engine.target.device
    stats, tokens, first = SpecStats(), [], None
    models.synchronize(device)  # nothing queued before the clock starts; each round reads its tokens back
    t0 = time.perf_counter()
    for event in engine.stream(ids, SamplingParams(max_new_tokens=max_new), stats=stats, tools=tools):
        first = first or (time.perf_counter() - t0, len(event.tokens))
        tokens.extend(event.tokens)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "first_s": first[0] if first else wall,
            "first_tokens": first[1] if first else 0, "passes": stats.num_rounds}


def run_dtype(target: models.LoadedModel, drafter: models.LoadedModel, prompts: list[dict], args: Any,
              methods: tuple[str, ...]) -> dict[str, Any]:
    tok = target.tokenizer
    rendered = [render_chat(tok, p["messages"], p["tools"]) for p in prompts]
    curve = models.measure_verify_cost(target.model, rendered[0], args.num_draft_tokens + 1, reps=5)
    log(f"{target.dtype}: verify-cost curve (ms by tokens per pass)",
        {n: round(s * 1e3, 2) for n, s in curve.items()})
    engines = {m: e for m, e in build_methods(target, drafter, curve, args.num_draft_tokens).items() if m in methods}
    for engine in engines.values():  # warm-up on the first prompt, kept out of the measured set
        timed_call(engine, rendered[0], prompts[0]["tools"], 16)
    rows, totals = [], {m: [0.0, 0, 0.0, 0, 0] for m in engines}  # wall, tokens, decode s, decode tok, passes
    for i, (p, ids) in enumerate(zip(prompts[1:], rendered[1:], strict=True)):
        order = list(engines)[i % len(engines):] + list(engines)[: i % len(engines)]
        out = {m: timed_call(engines[m], ids, p["tools"], args.max_new_tokens) for m in order}
        ref = out["plain"]["tokens"]
        row = {"id": p["id"], "prompt_tokens": len(ids), "methods": {}}
        for m, o in out.items():
            t = totals[m]
            t[0] += o["wall_s"]
            t[1] += len(o["tokens"])
            t[2] += o["wall_s"] - o["first_s"]
            t[3] += len(o["tokens"]) - o["first_tokens"]
            t[4] += o["passes"]
            row["methods"][m] = {"tokens": len(o["tokens"]), "wall_s": round(o["wall_s"], 4), "passes": o["passes"],
                                 "identical_to_plain": o["tokens"] == ref}
        rows.append(row)
        log(p["id"], {m: (r["tokens"], r["passes"], r["identical_to_plain"]) for m, r in row["methods"].items()})
    plain = totals["plain"]
    summary = {}
    for m, (wall, n, dec_s, dec_n, passes) in totals.items():
        summary[m] = {
            "tokens": n, "target_passes": passes, "tokens_per_pass": round(n / max(passes, 1), 2),
            "decode_ms_per_token": round(1e3 * dec_s / max(dec_n, 1), 2),
            "decode_speedup": round((plain[2] / max(plain[3], 1)) / (dec_s / max(dec_n, 1)), 3) if dec_s else None,
            "e2e_speedup": round(plain[0] / wall, 3) if wall else None,
            "identical_prompts": sum(r["methods"][m]["identical_to_plain"] for r in rows), "prompts": len(rows)}
    log(f"{target.dtype}:", json.dumps(summary))
    return {"verify_cost_ms": {n: round(s * 1e3, 3) for n, s in curve.items()}, "methods": summary, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="offline alias or .gguf path")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", help="offline alias or .gguf path")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts-file", type=Path, help="JSON written by --write-prompts (default: BFCL now)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--fp32-methods", default="plain,default_0.5b", help="methods run in float32")
    ap.add_argument("--write-prompts", type=Path, help="only write the prompts file and exit")
    ap.add_argument("--out", default="benchmarks/results/gpu_pair")
    args = ap.parse_args(argv)
    if args.write_prompts:
        write_prompts(args.write_prompts, args.prompts)
        return 0
    if args.prompts_file is None:
        args.write_prompts = Path("/tmp/agentspec_gpu_pair_prompts.json")
        write_prompts(args.write_prompts, args.prompts)
        args.prompts_file = args.write_prompts
    prompts = json.loads(args.prompts_file.read_text())[: args.prompts + 1]
    device = models.resolve_device(args.device)
    setup = {"target": args.target, "drafter": args.drafter, "device": str(device), "torch": torch.__version__,
             "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
             "cpu": platform.processor() or platform.machine(), "prompts": len(prompts) - 1,
             "max_new_tokens": args.max_new_tokens, "num_draft_tokens": args.num_draft_tokens,
             "command": "python -m benchmarks.gpu_pair " + " ".join(sys.argv[1:] if argv is None else argv)}
    log("setup", setup)
    results: dict[str, Any] = {"setup": setup}
    target = drafter = None
    for dtype in sorted(args.dtypes.split(","), key=lambda d: d != "float32"):  # fp32 first: cast down after
        t0 = time.perf_counter()
        if target is None or drafter is None or device.type == "cpu":  # CPU packs its linears: load again
            target = models.load_model(args.target, device=device, dtype=dtype)
            drafter = models.load_model(args.drafter, device=device, dtype=dtype)
        else:  # one dequantisation of each GGUF; the bf16 weights are the fp32 ones rounded, as a load gives
            target, drafter = (dataclasses.replace(m, model=m.model.to(models.DTYPES[dtype]),
                                                   dtype=models.DTYPES[dtype]) for m in (target, drafter))
        log(f"{dtype}: both models ready in {time.perf_counter() - t0:.1f} s")
        methods = METHODS if dtype == "bfloat16" else tuple(args.fp32_methods.split(","))
        results[dtype] = run_dtype(target, drafter, prompts, args, methods)
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=1))  # what is done survives a timeout
    results["acceptance"] = acceptance(results)
    log("acceptance", json.dumps(results["acceptance"]))
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1))
    return 0


def acceptance(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"device": results["setup"]["device"], "gpu": results["setup"]["gpu"]}
    for dtype, tag in (("bfloat16", "bf16"), ("float32", "fp32")):
        if dtype not in results:
            continue
        ms = {m: s for m, s in results[dtype]["methods"].items() if m != "plain"}
        best = max(ms, key=lambda m: ms[m]["decode_speedup"] or 0)
        out[f"best_method_{tag}"] = best
        out[f"decode_speedup_{tag}"] = ms[best]["decode_speedup"]
        out[f"e2e_speedup_{tag}"] = ms[best]["e2e_speedup"]
        out[f"identical_{tag}"] = {m: f"{s['identical_prompts']}/{s['prompts']}" for m, s in ms.items()}
    if "float32" in results:
        out["lossless_fp32"] = all(s["identical_prompts"] == s["prompts"]
                                   for s in results["float32"]["methods"].values())
    return out


if __name__ == "__main__":
    raise SystemExit(main())
