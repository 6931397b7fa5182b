"""Tool-call drafting on BFCL prompts: grammar, copy, n-gram, model and the combined tree vs plain decoding.

Run: ``python -m benchmarks.toolcalls`` (alone on the machine: ~1 h on 2 AVX2 cores). Writes
``benchmarks/results/toolcalls.{json,md}``. ``--quick``: 6 prompts, bf16 only, 32 tokens, every method at a fixed
γ (no timing-driven draft-length policy, so accepted lengths repeat run to run: a before/after check of the
engine), a few minutes; writes ``toolcalls_quick.{json,md}``.

Target Qwen2.5-Coder-0.5B-Instruct (the offline default), greedy, BFCL v4 prompts from the categories
simple_python, multiple, parallel and live_simple (ids in the output). Methods, each on the same prompts
in one process, order rotated per prompt (the measurement loop of :mod:`benchmarks.speedup`):

* ``plain`` — transformers ``generate``, greedy (the reference every output is compared with);
* ``prompt_lookup`` — transformers' prompt lookup decoding (K=10, N=2), the outside anchor;
* ``ngram`` — agentspec's n-gram drafter over the prompt (N=2);
* ``grammar`` — only the tokens the tools' grammar forces (:class:`GrammarDrafter`), no model;
* ``copy`` — suffix-match copy drafting with match-length–aware proposals (:class:`CopyDrafter`) over
  the prompt, the answer so far and a cross-conversation index of the earlier answers of this run (the
  prompts run in a fixed order; a deployment's index holds its earlier requests the same way);
* ``model`` — the only same-tokenizer drafter available offline: the target's first 4 layers;
* ``combined`` — the :class:`TreeDrafter`: grammar-forced spans + copy candidates merged into a tree,
  node budget from the measured verify-cost curve.

The prompt is prefilled once per prompt (timed) and every method starts from a copy of that cache (bf16
prefill on this CPU is ~30 ms/token, so re-prefilling per method would triple the run); decode-only speed-up
compares the methods' own times, end-to-end adds the one measured prefill to each. transformers' prompt
lookup prefills itself (given a prefilled cache it slowed down and diverged), its decode time is its
end-to-end time minus that measured prefill, as in benchmarks/speedup.py. fp32 runs only plain, prompt
lookup and combined (time: the bf16 run alone takes about an hour here).

The agentspec methods choose γ per round with :class:`DraftLengthPolicy` (seeded with the measured curve);
grammar-forced tokens are drafted on top of γ. Every output is compared token for token with plain greedy
(bf16 ties are measured and reported with their logit margin, see benchmarks/speedup.py), and the tool
calls parsed from each output are compared with those parsed from plain output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agentspec import models, router
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.drafters.copy import CopyDrafter, SuffixIndex
from agentspec.drafters.grammar import GrammarDrafter
from agentspec.drafters.tree import TreeDrafter
from agentspec.local import SpecEngine
from agentspec.toolcalls import ToolCallParser
from agentspec.types import SamplingParams, SpecStats
from benchmarks import common, speedup
from benchmarks.common import log
from benchmarks.speedup_report import write_markdown

METHODS = ("plain", "prompt_lookup", "ngram", "grammar", "copy", "model", "combined")
FP32_METHODS = ("plain", "prompt_lookup", "combined")
CATEGORIES = ("simple_python", "multiple", "parallel", "live_simple")
DEFAULTS = {"targets": "qwen2.5-coder-0.5b-instruct", "dtypes": "bfloat16,float32", "prompts": 50,
            "max_new_tokens": 64, "out": "benchmarks/results/toolcalls", "methods": METHODS,
            "categories": ",".join(CATEGORIES)}


def make_methods(prompts: list[common.Prompt]):
    """A factory for :func:`speedup.bench_target_dtype`: the methods above, each ``ids -> Output``."""

    def factory(target: models.LoadedModel, drafter: models.LoadedModel, args: Any, curve: dict[int, float]
                ) -> dict[str, speedup.Method]:
        tok = target.tokenizer
        tools_of = {tuple(common.render(tok, p)): [dict(t) for t in p.tools]
                    for p in [*prompts, common.warmup_prompt(prompts)]}
        k, n = args.num_draft_tokens, args.max_ngram
        # copy drafting includes the cross-conversation index of past answers (this run's earlier prompts,
        # in order, as a deployment's earlier requests): agents open and close their answers alike
        tree = TreeDrafter(GrammarDrafter(tok), CopyDrafter(SuffixIndex(), max_candidates=3))
        budget = tree.set_verify_costs(curve)
        log(f"combined: tree node budget beyond the chain = {budget} (verify-cost curve {curve})")
        drafters = {
            "ngram": NgramDrafter(max_ngram=n, min_ngram=1),
            "grammar": GrammarDrafter(tok),
            "copy": CopyDrafter(SuffixIndex()),
            "model": ModelDrafter(drafter),
            "combined": tree,
        }
        params = SamplingParams(max_new_tokens=args.max_new_tokens)

        def spec(name: str) -> speedup.Method:
            engine = SpecEngine(target, drafters[name], num_draft_tokens=args.model_draft_tokens
                                if name == "model" else k,
                                draft_policy=None if args.quick else router.DraftLengthPolicy.from_calibration(curve))

            def run(ids: list[int], cache: Any = None) -> speedup.Output:
                t0, stats, tokens, first = time.perf_counter(), SpecStats(), [], None
                prefilled = None if cache is None else (cache, len(ids) - 1)
                for event in engine.stream(ids, params, stats=stats, tools=tools_of[tuple(ids)], prefilled=prefilled):
                    first = first or (time.perf_counter() - t0, len(event.tokens))
                    tokens.extend(event.tokens)
                return speedup.Output(tokens, stats, *first)
            return run

        hf = speedup.make_methods(target, drafter, args, curve)  # plain and prompt_lookup from there
        return {"plain": hf["plain"], "prompt_lookup": hf["prompt_lookup"],
                **{m: spec(m) for m in drafters if m in args.methods}}

    return factory


def parsed_calls(text: str) -> list[tuple[str, Any]]:
    """The tool calls in an output, as (name, arguments object) pairs."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    return [(e.call.name, json.loads(e.call.arguments)) for e in events if e.call]


def compare_calls(rows: list[dict]) -> dict[str, Any]:
    """Per method: prompts whose parsed calls differ from plain's, and how many plain outputs hold calls."""
    out: dict[str, Any] = {"plain_outputs_with_calls": sum(bool(parsed_calls(r["methods"]["plain"]["text"]))
                                                           for r in rows), "prompts": len(rows), "differ": {}}
    for r in rows:
        ref = parsed_calls(r["methods"]["plain"]["text"])
        for name, m in r["methods"].items():
            if name != "plain" and parsed_calls(m["text"]) != ref:
                out["differ"].setdefault(name, []).append(r["prompt_id"])
    return out


def acceptance(records: list[dict], calls: dict[str, dict], prompt_ids: list[str]) -> dict[str, Any]:
    """The figures the issue judges (bf16, combined), plus the same for fp32 where it ran."""
    by = {(r["dtype"], r["method"]): r for r in records}
    out: dict[str, Any] = {}
    for dtype, tag in (("bfloat16", "bf16"), ("float32", "fp32")):
        comb, lookup = by.get((dtype, "combined")), by.get((dtype, "prompt_lookup"))
        if comb is None:
            continue
        out[f"combined_mean_accepted_length_{tag}"] = comb["mean_accepted_length"]
        out[f"combined_decode_speedup_{tag}"] = comb["speedup_vs_plain"]
        out[f"combined_e2e_speedup_{tag}"] = comb["speedup_vs_plain_e2e"]
        if lookup is not None:
            out[f"combined_vs_prompt_lookup_{tag}"] = comb["tokens_per_s"] / lookup["tokens_per_s"]
    ours = [r for r in records if r["method"] not in ("plain", "prompt_lookup")]
    out["all_identical"] = all(
        r["identical_to_plain"] if r["dtype"] == "float32" else r["real_failures"] == 0 for r in ours)
    out["bf16_tie_divergences"] = sum(r["tie_divergences"] for r in ours if r["dtype"] == "bfloat16")
    out["real_failures"] = sum(r["real_failures"] for r in ours)
    out["tool_calls_equal_to_plain"] = {k: not v["differ"] or set(v["differ"]) <= {"prompt_lookup"}
                                        for k, v in calls.items()}
    out["prompt_ids"] = prompt_ids
    return out


QUICK = {"dtypes": "bfloat16", "prompts": 6, "max_new_tokens": 32, "out": "benchmarks/results/toolcalls_quick"}


def main(argv: list[str] | None = None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    args = speedup.parse_args(argv, __doc__.split("\n\n")[0], {**DEFAULTS, **(QUICK if quick else {})})
    args.keep_text = True
    args.shared_prefill = True  # bf16 prefill here is ~30 ms/token: one timed prefill per prompt, shared
    args.prefill_reps = 1
    args.own_prefill = ("prompt_lookup",)  # transformers' assisted generation misbehaves on a given cache
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    prompts = common.bfcl_prompts(args.prompts, args.categories)
    ids = [p.id for p in prompts]
    log(f"{len(prompts)} prompts:", ", ".join(ids))
    settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    meta = {"settings": settings, "machine": common.machine_info(),
            "data": {"source": "bfcl_eval wheel, BFCL v4", "prompt_ids": ids, "categories": args.categories,
                     "selection": "per category: evenly spread indices i*len//n, first categories take the "
                                  "remainder", "warmup_prompt_id": common.warmup_prompt().id},
            "methods": {"bfloat16": list(args.methods), "float32": [m for m in args.methods if m in FP32_METHODS]},
            "models": {}}
    records: list[dict] = []
    verify_cost, per_prompt, calls = {}, {}, {}
    json_path, md_path = Path(f"{args.out}.json"), Path(f"{args.out}.md")
    all_methods = args.methods
    for alias in args.targets:
        for dtype in args.dtypes:
            args.methods = meta["methods"].get(dtype, all_methods)
            recs, curve, rows, info = speedup.bench_target_dtype(alias, dtype, prompts, args, make_methods(prompts))
            key = f"{alias}/{dtype}"
            meta["models"][key], verify_cost[key], per_prompt[key] = info, curve, rows
            records += recs
            calls[key] = compare_calls(rows)
            log(f"[{key}] tool calls: {calls[key]}")
            meta["load_average_end"] = list(os.getloadavg())
            result = {"meta": meta, "verify_cost": verify_cost, "records": records,
                      "acceptance": acceptance(records, calls, ids), "tool_calls": calls, "per_prompt": per_prompt}
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(result, indent=1, default=str))
            write_markdown(result, md_path, "agentspec tool-call drafting vs plain greedy (BFCL v4)", [
                "Methods: see `benchmarks/toolcalls.py`. `combined` = grammar-forced spans + copy candidates "
                "in one tree; every agentspec method picks γ per round from measured costs and acceptance; "
                "grammar-forced tokens ride on top of γ.", "",
                f"Tool calls parsed from outputs vs plain: {json.dumps(calls)}"])
    acc = result["acceptance"]
    log("acceptance:", json.dumps(acc))
    return 0 if acc["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
