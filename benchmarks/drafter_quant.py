"""The 0.5B drafter in bf16, int8 and int4 (weight-only, :mod:`agentspec.models.quant`): what a drafting step
and a catch-up prefill cost, and how often each one's greedy token is the 1.5B target's.

Run: ``python -m benchmarks.drafter_quant`` (alone on the machine, ~6 minutes). Writes
``benchmarks/results/drafter_quant.json``. One core, one thread, as the agent benchmark's client. On BFCL
tool-calling prompts (tools in the chat template): the 1.5B decodes greedily; each drafter then reads the
prompt in one pass (timed: a catch-up's cost) and the target's answer one token a pass, and its top-1 at
every answer position is compared with the target's token there (the per-token acceptance a chain draft
would see); its decoding steps are timed on its own greedy continuation, after a warm-up. int4 runs twice:
as loaded by default (prefills on its kept dense weights) and with ``quantize_dense_rows=None``.
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
from benchmarks import common
from benchmarks.common import log

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
SCHEMES = (None, "int8", "int4")


def target_answers(prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The 1.5B's greedy answer to each prompt (bf16, the agent benchmark's target dtype)."""
    target = models.load_model(TARGET, device="cpu", dtype="bfloat16")
    out = []
    for ids in prompts:
        cache = models.new_cache(target.model)
        logits, answer = models.forward(target.model, ids, cache, num_logits=1)[-1], []
        for _ in range(new_tokens):
            answer.append(int(logits.argmax()))
            logits = models.forward(target.model, [answer[-1]], cache, num_logits=1)[-1]
        out.append(answer)
    return out


def measure(scheme: str | None, prompts: list[list[int]], answers: list[list[int]], steps: int,
            dense_rows: int | None = models.DENSE_ROWS) -> dict[str, Any]:
    """One drafter's agreement with the target's answers, prefill seconds and seconds per decoding step.
    ``dense_rows``: a quantised drafter's (None: no dense copies, every pass on the quantised weights)."""
    extra = {} if scheme is None else {"quantize_dense_rows": dense_rows}
    drafter, load_s = common.timed(lambda: models.load_model(DRAFTER, device="cpu", dtype="bfloat16",
                                                             quantize=scheme, **extra))
    agree = total = 0
    prefill_s = []
    for ids, answer in zip(prompts, answers, strict=True):
        cache = models.new_cache(drafter.model)
        t0 = time.perf_counter()
        models.forward(drafter.model, ids, cache, num_logits=1)
        prefill_s.append((time.perf_counter() - t0) / len(ids))
        picks = []  # position i predicts answer[i + 1]; one token a pass, as chain drafting feeds them
        for token in answer[:-1]:
            picks.append(int(models.forward(drafter.model, [token], cache, num_logits=1)[-1].argmax()))
        agree += sum(p == a for p, a in zip(picks, answer[1:], strict=True))
        total += len(answer) - 1
    step_s = []
    for ids in prompts[:2]:
        cache = models.new_cache(drafter.model)
        logits = models.forward(drafter.model, ids, cache, num_logits=1)[-1]
        for i in range(steps + 4):  # the first 4 are a warm-up
            t0 = time.perf_counter()
            logits = models.forward(drafter.model, [int(logits.argmax())], cache, num_logits=1)[-1]
            if i >= 4:
                step_s.append(time.perf_counter() - t0)
    return {"load_s": round(load_s, 1), "agreement_with_target": round(agree / total, 4), "positions": total,
            "step_ms": round(1e3 * sum(step_s) / len(step_s), 2),
            "prefill_ms_per_token": round(1e3 * sum(prefill_s) / len(prefill_s), 3),
            "resident_weight_mib": round(models.resident_weight_bytes(drafter.model) / 2**20, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=40, help="the target's answer length per prompt")
    ap.add_argument("--steps", type=int, default=24, help="timed drafting steps per prompt (two prompts)")
    ap.add_argument("--out", default="benchmarks/results/drafter_quant")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    tokenizer = models.load_model(DRAFTER, device="cpu", dtype="bfloat16").tokenizer
    chosen = common.bfcl_prompts(args.prompts)
    prompts = [common.render(tokenizer, p) for p in chosen]
    log(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens; the 1.5B answers")
    answers = target_answers(prompts, args.new_tokens)
    rows = {}
    for scheme in SCHEMES:
        rows[scheme or "bf16"] = measure(scheme, prompts, answers, args.steps)
        log(scheme or "bf16", rows[scheme or "bf16"])
    rows["int4_no_dense"] = measure("int4", prompts, answers, args.steps, dense_rows=None)
    log("int4_no_dense", rows["int4_no_dense"])
    bf16, int4, lean = rows["bf16"], rows["int4"], rows["int4_no_dense"]
    result = {"acceptance": {
        "step_speedup_int4": round(bf16["step_ms"] / int4["step_ms"], 3),
        "agreement_bf16": bf16["agreement_with_target"], "agreement_int4": int4["agreement_with_target"],
        "prefill_cost_int4_vs_bf16": round(int4["prefill_ms_per_token"] / bf16["prefill_ms_per_token"], 3),
        "prefill_cost_int4_no_dense_vs_bf16": round(lean["prefill_ms_per_token"] / bf16["prefill_ms_per_token"], 3)},
        "drafters": rows,
        "setup": {"target": TARGET, "drafter": DRAFTER, "dtype": "bfloat16 activations (int8/int4: weights only)",
                  "prompts": [p.id for p in chosen], "new_tokens": args.new_tokens, "steps": args.steps,
                  "machine": common.machine_info()}}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["acceptance"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
