"""Stock vs oneDNN-packed linear layers on CPU: the verify-cost curve speculation depends on.

``python -m benchmarks.cpu_linear`` loads the target once (fp32), deep-copies it and packs the copy's
linears (:func:`agentspec.models.pack_cpu_linears`), then measures on the same BFCL prompts, interleaved:

* t_v(k), the median seconds of one forward over k new tokens on a cached prompt, k = 1 … 16, and the
  curve t_v(k)/t_v(1) (what the router and the draft-length policy use);
* prefill seconds of each prompt;
* plain greedy output (64 tokens) of each model: equal, or where the two first differ.

Writes ``benchmarks/results/cpu_linear.{json,md}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch

from agentspec import models
from benchmarks import common
from benchmarks.common import log

TARGET = models.DEFAULT_TARGET


def greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Plain greedy decoding with the KV cache, one token per forward."""
    cache = models.new_cache(model)
    logits = models.forward(model, ids, cache, num_logits=1)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = models.forward(model, out[-1:], cache, num_logits=1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-k", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated; each gets a stock and a packed copy")
    p.add_argument("--out", default="benchmarks/results/cpu_linear")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    stock = models.load_model(TARGET, device="cpu", dtype="float32", pack_linears=False)
    variants: dict[str, torch.nn.Module] = {}
    for dtype in args.dtypes.split(","):
        base = stock.model if dtype == "float32" else copy.deepcopy(stock.model).to(models.DTYPES[dtype])
        packed = copy.deepcopy(base)
        models.pack_cpu_linears(packed)
        variants[f"{dtype} stock"], variants[f"{dtype} packed"] = base, packed
    prompts = common.bfcl_prompts(args.prompts)
    rendered = {pr.id: common.render(stock.tokenizer, pr) for pr in prompts}
    for model in variants.values():
        common.pretouch(model, 256)
    curves: dict[str, dict[str, dict[int, float]]] = {name: {} for name in variants}
    prefill: dict[str, dict[str, float]] = {name: {} for name in variants}
    for pid, ids in rendered.items():
        for name, model in variants.items():  # interleaved per prompt, so drift hits both alike
            prefill[name][pid] = min(common.prefill_seconds(model, ids) for _ in range(2))
            curves[name][pid] = common.verify_cost_curve(model, ids, args.max_k, args.reps)
            log(f"{pid} {name}: prefill {prefill[name][pid]:.2f} s, t_v(1) {curves[name][pid][1] * 1e3:.1f} ms, "
                f"t_v(2)/t_v(1) {curves[name][pid][2] / curves[name][pid][1]:.2f}")
    outputs = {pid: {name: greedy(model, ids, args.new_tokens) for name, model in variants.items()}
               for pid, ids in rendered.items()}
    summary = {}
    for name in variants:
        per_k = {k: statistics.median(curves[name][pid][k] for pid in rendered) for k in range(1, args.max_k + 1)}
        summary[name] = {"t_v_ms": {k: round(v * 1e3, 2) for k, v in per_k.items()},
                         "curve": {k: round(v / per_k[1], 3) for k, v in per_k.items()},
                         "prefill_s_median": round(statistics.median(prefill[name].values()), 3)}
    dtypes = args.dtypes.split(",")
    result = {
        "meta": {"model": TARGET, "dtypes": dtypes, "prompts": list(rendered),
                 "prompt_tokens": {pid: len(ids) for pid, ids in rendered.items()}, "settings": vars(args),
                 "machine": common.machine_info(),
                 "packing": {name: next((m.extra_repr() for m in model.modules()
                                         if isinstance(m, models.PackedLinear)), "stock")
                             for name, model in variants.items()}},
        "summary": summary,
        "packed_over_stock": {dtype: _ratios(summary[f"{dtype} packed"], summary[f"{dtype} stock"], args.max_k)
                              for dtype in dtypes},
        "first_difference": {dtype: {pid: _first_difference(o[f"{dtype} stock"], o[f"{dtype} packed"])
                                     for pid, o in outputs.items()} for dtype in dtypes},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    log(json.dumps({k: result[k] for k in ("packed_over_stock", "first_difference")}))
    for name in variants:
        log(name, "t_v(1) ms", summary[name]["t_v_ms"][1], "curve",
            {k: summary[name]["curve"][k] for k in (2, 4, 8, 16) if k <= args.max_k})
    return 0


def _ratios(packed: dict, stock: dict, max_k: int) -> dict[str, float]:
    """Packed time over stock time: t_v(k) for a few k, and prefill."""
    out = {f"t_v{k}": round(packed["t_v_ms"][k] / stock["t_v_ms"][k], 3) for k in (1, 2, 4, 8, 16) if k <= max_k}
    out["prefill"] = round(packed["prefill_s_median"] / stock["prefill_s_median"], 3)
    return out


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy outputs differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def markdown(result: dict) -> str:
    """The report: one row per variant, then the ratios."""
    meta, s = result["meta"], result["summary"]
    ks = [k for k in (1, 2, 3, 4, 6, 8, 12, 16) if k in next(iter(s.values()))["curve"]]
    lines = [f"# Stock vs packed CPU linears: {meta['model']}, {', '.join(meta['dtypes'])}", "",
             f"Machine: {meta['machine'].get('cpu')} ({', '.join(meta['machine'].get('cpu_flags', []))}), "
             f"{meta['machine'].get('torch_threads')} threads. Prompts (BFCL): {', '.join(meta['prompts'])} "
             f"({', '.join(str(n) for n in meta['prompt_tokens'].values())} tokens). Each cell: t_v(k) in ms "
             "(t_v(k)/t_v(1)), the median over prompts of the median of the repetitions.",
             "", "| variant | prefill s | " + " | ".join(f"t_v({k}) ms" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for name, row in s.items():
        lines.append(f"| {name} | {row['prefill_s_median']} | "
                     + " | ".join(f"{row['t_v_ms'][k]} ({row['curve'][k]}x)" for k in ks) + " |")
    lines += ["", "Packed kernels: " + json.dumps(meta["packing"]),
              "", "Packed over stock (time ratio): " + json.dumps(result["packed_over_stock"]),
              "", "First position where plain greedy (64 tokens) differs, stock vs packed (null: equal): "
              + json.dumps(result["first_difference"]), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
