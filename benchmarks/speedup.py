"""Speed-up of agentspec's greedy speculative decoding over plain decoding, on BFCL tool-calling prompts.

Run: ``python -m benchmarks.speedup`` (full: ~2 h on 2 AVX2 cores, where bf16 is emulated and slow;
much less on a CPU with native bf16) or ``--quick`` (a smoke run, ~4 min).
Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/speedup``).

Flow, per target × dtype, all in one process:

1. load the target and a layer-skip drafter (its first L layers); fault in memory (:func:`pretouch`) and
   run every method once, untimed, on a warm-up prompt outside the measured set;
2. measure the verify-cost curve t_v(k) on a cached median-length prompt;
3. for each prompt: time a prefill forward, run every method (order rotated per prompt) timing it end to
   end and counting target forward passes, time the prefill again (prefill = median of the two);
4. compare every method's tokens with plain greedy's; at a divergence measure the target's top-2 logit
   margin (:func:`common.check_divergence`; fp32: any divergence is a failure; bf16: a tie is allowed
   within the measured logit noise between computation paths, at least ``--tie-ulps`` bf16 ulps);
5. aggregate as ratios of totals (Σ tokens / Σ decode seconds, decode = end-to-end − prefill; also
   "after the first step": each call's own first committed tokens and their time left out), add the
   closed-form prediction from design.md, and write the JSON and Markdown reports.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec import models, router
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.local import SpecEngine
from agentspec.toolcalls import supports_tools
from agentspec.types import SamplingParams, SpecStats
from benchmarks import common
from benchmarks.common import log
from benchmarks.speedup_report import write_markdown

METHODS = ("plain", "prompt_lookup", "agentspec_plain", "agentspec_ngram", "agentspec_ngram_fixed", "agentspec_model")
AGENTSPEC_METHODS = ("agentspec_plain", "agentspec_ngram", "agentspec_ngram_fixed", "agentspec_model")


@dataclass
class Output:
    """What a method returns: new tokens, engine statistics, and when its first tokens were committed."""

    tokens: list[int]
    stats: SpecStats | None
    first_s: float  # from the call to its first committed tokens: its own prefill step
    first_tokens: int  # tokens committed by that step (1 + accepted drafts under speculation)


Method = Callable[..., Output]  # (prompt ids, cache=None) -> Output; cache: prefilled up to the last prompt token


@dataclass
class Run:
    """One method on one prompt."""

    out: Output
    e2e_s: float
    target_passes: int
    drafter_passes: int
    cpu_s: float = 0.0  # process CPU time: well below threads × wall means the CPU was shared
    prefill_s: float = 0.0  # the separately timed prefill of this prompt

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    @property
    def stats(self) -> SpecStats | None:
        return self.out.stats

    @property
    def decode_s(self) -> float:
        """Decode-only time: end-to-end minus the separately timed prefill of the prompt."""
        return self.e2e_s - self.prefill_s

    @property
    def after_first_s(self) -> float:
        """End-to-end minus this call's own first step: decode time free of prefill-timing noise."""
        return self.e2e_s - self.out.first_s


def parse_args(argv: list[str] | None = None, description: str | None = None,
               defaults: dict[str, Any] | None = None) -> argparse.Namespace:
    """The benchmark's options; ``defaults`` lets another benchmark (toolcalls.py) reuse them."""
    p = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    p.add_argument("--targets", default=None, help="comma-separated model aliases (default both)")
    p.add_argument("--dtypes", default=None, help="comma-separated: float32,bfloat16 (default both)")
    p.add_argument("--prompts", type=int, default=None, help="number of BFCL prompts (default 20)")
    p.add_argument("--categories", default=",".join(common.BFCL_CATEGORIES), help="BFCL v4 categories")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 64")
    p.add_argument("--methods", default=",".join(METHODS), type=lambda v: tuple(v.split(",")),
                   help=f"comma-separated subset of {','.join(METHODS)} (plain is always run)")
    p.add_argument("--prefill-reps", type=int, default=2, help="separately timed prefills per prompt")
    p.add_argument("--num-draft-tokens", type=int, default=10,
                   help="K: HF prompt_lookup_num_tokens and SpecEngine num_draft_tokens for n-gram")
    p.add_argument("--max-ngram", type=int, default=2,
                   help="N: HF max_matching_ngram_size and NgramDrafter(max_ngram=N, min_ngram=1)")
    p.add_argument("--model-draft-layers", type=int, default=4, help="L: layers of the layer-skip drafter")
    p.add_argument("--model-draft-tokens", type=int, default=4, help="draft tokens per round, model drafter")
    p.add_argument("--curve-reps", type=int, default=None, help="repetitions per verify-cost point (default 5)")
    p.add_argument("--tie-ulps", type=float, default=1.0,
                   help="bf16: floor of the tie threshold, in bf16 ulps at the top logit's magnitude (the "
                        "threshold is the larger of this and twice the measured logit path noise)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="output path without suffix (default benchmarks/results/speedup)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 prompts, bfloat16, SmolLM2 only, 16 tokens, 2 curve reps")
    p.set_defaults(**(defaults or {}))
    args = p.parse_args(argv)
    quick = args.quick
    args.targets = (args.targets or (common.TARGETS[0] if quick else ",".join(common.TARGETS))).split(",")
    args.dtypes = (args.dtypes or ("bfloat16" if quick else "float32,bfloat16")).split(",")
    args.categories = args.categories.split(",")
    args.prompts = args.prompts or (2 if quick else 20)
    args.max_new_tokens = args.max_new_tokens or (16 if quick else 64)
    args.curve_reps = args.curve_reps or (2 if quick else 5)
    args.out = args.out or ("benchmarks/results/speedup_quick" if quick else "benchmarks/results/speedup")
    return args


def make_methods(target: models.LoadedModel, drafter: models.LoadedModel, args: argparse.Namespace,
                 curve: dict[int, float]) -> dict[str, Method]:
    """The methods, each ``prompt ids -> Output``; all greedy, all stopping on the same ids.

    agentspec's engines choose γ ≤ their K each round (:class:`agentspec.router.DraftLengthPolicy`,
    seeded with the measured verify-cost ``curve`` and learning acceptance as it runs); ``*_fixed``
    variants draft the full K every round, like transformers does."""
    k, n = args.num_draft_tokens, args.max_ngram
    plain_cfg = common.hf_generation_config(target, args.max_new_tokens)
    lookup_cfg = common.hf_generation_config(target, args.max_new_tokens, prompt_lookup_num_tokens=k,
                                             max_matching_ngram_size=n)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engines = {
        "agentspec_plain": SpecEngine(target, None, num_draft_tokens=0),
        "agentspec_ngram": SpecEngine(target, NgramDrafter(max_ngram=n, min_ngram=1), num_draft_tokens=k,
                                      draft_policy=router.DraftLengthPolicy.from_calibration(curve)),
        "agentspec_ngram_fixed": SpecEngine(target, NgramDrafter(max_ngram=n, min_ngram=1), num_draft_tokens=k),
        "agentspec_model": SpecEngine(target, ModelDrafter(drafter), num_draft_tokens=args.model_draft_tokens,
                                      draft_policy=router.DraftLengthPolicy.from_calibration(curve)),
    }

    def hf(cfg: Any) -> Method:
        def run(ids: list[int], cache: Any = None) -> Output:
            timer = common.FirstTokenTimer()
            tokens = common.hf_generate(target, ids, cfg, streamer=timer, cache=cache)
            return Output(tokens, None, timer.first_s, timer.first_tokens)
        return run

    def spec(engine: SpecEngine) -> Method:
        def run(ids: list[int], cache: Any = None) -> Output:  # SpecEngine.generate, with the first round timed
            t0, stats, tokens, first = time.perf_counter(), SpecStats(), [], None
            prefilled = None if cache is None else (cache, len(ids) - 1)
            for event in engine.stream(ids, params, stats=stats, prefilled=prefilled):
                first = first or (time.perf_counter() - t0, len(event.tokens))
                tokens.extend(event.tokens)
            return Output(tokens, stats, *first)
        return run

    return {"plain": hf(plain_cfg), "prompt_lookup": hf(lookup_cfg), **{m: spec(e) for m, e in engines.items()}}


def bench_target_dtype(alias: str, dtype: str, prompts: list[common.Prompt], args: argparse.Namespace,
                       factory: Callable[..., dict[str, Method]] | None = None
                       ) -> tuple[list[dict], dict, list[dict], dict]:
    """One target × dtype: records per method, the verify-cost curve, per-prompt rows, model facts.

    ``factory(target, drafter, args, curve)`` builds the methods (default :func:`make_methods`); with
    ``args.keep_text`` each per-prompt row also keeps every method's output text."""
    tag = f"[{alias} {dtype}]"
    (target, load_s) = common.timed(lambda: models.load_model(alias, device="cpu", dtype=dtype))
    drafter = models.layer_skip_drafter(target, args.model_draft_layers)
    info = model_info(target, drafter, load_s)
    log(tag, f"loaded in {load_s:.1f}s; drafter = first {args.model_draft_layers} layers; {info}")
    encoded = [common.render(target.tokenizer, p) for p in prompts]
    warm = common.render(target.tokenizer, common.warmup_prompt(prompts))
    targets_passes = common.ForwardCounter(target.model)
    drafter_passes = common.ForwardCounter(drafter.model)

    # 0. fault in memory
    longest = max(len(x) for x in encoded) + args.max_new_tokens + args.num_draft_tokens
    common.pretouch(target.model, longest)
    common.pretouch(drafter.model, longest)
    common.prefill_seconds(target.model, warm)
    # 1. verify-cost curve on a median-length prompt (after faulting in memory); it seeds the draft policies
    by_length = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    median_i = by_length[len(by_length) // 2]
    kmax = max(17, args.num_draft_tokens + 1, args.model_draft_tokens + 1)
    curve = common.verify_cost_curve(target.model, encoded[median_i], kmax, args.curve_reps)
    ratio = {k: s / curve[1] for k, s in curve.items()}
    log(tag, "verify cost t_v(k)/t_v(1):", " ".join(f"{k}:{r:.2f}" for k, r in ratio.items() if k <= 16))
    verify_cost = {"prompt_id": prompts[median_i].id, "prompt_tokens": len(encoded[median_i]),
                   "reps": args.curve_reps, "seconds": curve, "ratio": ratio}

    methods = {m: run for m, run in (factory or make_methods)(target, drafter, args, curve).items()
               if m in args.methods or m == "plain"}

    # 2. warm-up: one untimed generation per method on a separate prompt (the policies start learning)
    warm_out = {}
    for name, run in methods.items():
        warm_out[name], seconds = common.timed(lambda run=run: run(warm))
        log(tag, f"warm-up {name}: {seconds:.2f}s, {len(warm_out[name].tokens)} tokens")
    noise = common.logit_path_noise(target.model, warm, warm_out["plain"].tokens, args.num_draft_tokens + 1)
    info["logit_path_noise"] = noise
    log(tag, f"logit path noise (|Δ logit| between computation paths): max {noise['max_abs']:.4g}, "
        f"median {noise['median_abs']:.4g} over {noise['positions']} positions")

    # 3./4. the measured loop, methods interleaved per prompt (order rotated), then the comparison
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    rows, divergences = [], {m: [] for m in methods if m != "plain"}
    for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
        order = list(methods)[i % len(methods):] + list(methods)[:i % len(methods)]
        this, prefills = measure_prompt(target, methods, order, ids, (targets_passes, drafter_passes),
                                          args.prefill_reps, getattr(args, "shared_prefill", False),
                                          frozenset(getattr(args, "own_prefill", ())))
        prefill = statistics.median(prefills)
        row = {"prompt_id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids),
               "prefill_s": prefill, "prefill_spread_s": max(prefills) - min(prefills), "methods": {}}
        for name, r in this.items():
            r.prefill_s = prefill
            runs[name].append(r)
            div = None if name == "plain" else common.check_divergence(
                target, prompt.id, ids, this["plain"].tokens, r.tokens, args.tie_ulps, noise["max_abs"])
            if div:
                divergences[name].append(div)
                loud = "!!! REAL DIVERGENCE" if div["verdict"] == "FAILURE" else "bf16 tie divergence"
                log(tag, f"{loud}: {name} on {prompt.id} at {div['position']}: margin {div['margin']:.4f} "
                    f"({div['margin_ulps']:.2f} ulp), plain {div['plain_text']!r} vs {div['method_text']!r}")
            row["methods"][name] = {
                "new_tokens": len(r.tokens), "e2e_s": r.e2e_s, "decode_s": r.decode_s,
                "first_s": r.out.first_s, "first_tokens": r.out.first_tokens,
                "target_passes": r.target_passes, "drafter_passes": r.drafter_passes,
                "cpu_per_wall": r.cpu_s / r.e2e_s, "identical_to_plain": div is None,
                "mean_accepted_length": r.stats.mean_accepted_length if r.stats else None,
            }
            if getattr(args, "keep_text", False):
                row["methods"][name]["text"] = target.tokenizer.decode(r.tokens, skip_special_tokens=True)
        rows.append(row)
        log(tag, f"{i + 1}/{len(prompts)} {prompt.id} ({len(ids)} tok, prefill {prefill:.2f}s, cpu/wall "
            f"{sum(r.cpu_s for r in this.values()) / sum(r.e2e_s for r in this.values()):.2f}) " + " | ".join(
            f"{m} {this[m].e2e_s:.2f}s/{len(this[m].tokens)}t" for m in methods))
    targets_passes.close(), drafter_passes.close()

    # 5. aggregate
    records = [summarise(alias, dtype, name, runs[name], runs["plain"], ratio, divergences.get(name, []))
               for name in methods]
    for rec in records:
        log(tag, f"{rec['method']:16s} {rec['tokens_per_s']:7.2f} tok/s decode, x{rec['speedup_vs_plain']:.2f} "
            f"decode, x{rec['speedup_vs_plain_after_first']:.2f} after 1st step, x{rec['speedup_vs_plain_e2e']:.2f} e2e, MAL {rec['mean_accepted_length'] or 0:.2f}, "
            f"pred x{rec['predicted_speedup'] or 0:.2f}, identical={rec['identical_to_plain']}")
    del methods, drafter, target
    gc.collect()
    return records, verify_cost, rows, info


def measure_prompt(target: models.LoadedModel, methods: dict[str, Method], order: list[str], ids: list[int],
                   counters: tuple[common.ForwardCounter, common.ForwardCounter], prefill_reps: int = 2,
                   shared_prefill: bool = False, own_prefill: frozenset[str] = frozenset()
                   ) -> tuple[dict[str, Run], list[float]]:
    """Prefill, every method in ``order`` (timed end to end, passes counted), prefill again.

    ``shared_prefill``: the prompt (but its last token) is prefilled once, timed, and every method
    starts from a copy of that cache; a method's end-to-end time is then that prefill + its own run.
    Methods named in ``own_prefill`` still prefill themselves (timed end to end as usual)."""
    target_passes, drafter_passes = counters
    shared = common.prefill_cache(target.model, ids) if shared_prefill else None
    prefills = [shared[1] if shared else common.prefill_seconds(target.model, ids)]
    target_passes.take(), drafter_passes.take()
    this: dict[str, Run] = {}
    for name in order:
        share = shared is not None and name not in own_prefill
        cache = models.copy_cache_prefix(target.model, shared[0], len(ids) - 1) if share else None
        cpu0 = time.process_time()
        out, seconds = common.timed(lambda run=methods[name], cache=cache: run(ids, cache))
        if share:
            seconds += shared[1]
            out.first_s += shared[1]
        this[name] = Run(out, seconds, target_passes.take(), drafter_passes.take(), time.process_time() - cpu0)
    prefills += [common.prefill_seconds(target.model, ids) for _ in range(prefill_reps - 1)]
    return this, prefills


def model_info(target: models.LoadedModel, drafter: models.LoadedModel, load_s: float) -> dict:
    """What was really loaded: module classes and parameter dtypes prove the weights were dequantised."""
    mods = Counter(type(m).__name__ for m in target.model.modules() if "Linear" in type(m).__name__)
    return {
        "class": type(target.model).__name__, "params": sum(p.numel() for p in target.model.parameters()),
        "layers": target.model.config.num_hidden_layers, "linear_modules": dict(mods),
        "param_dtypes": dict(Counter(str(p.dtype) for p in target.model.parameters())),
        "eos_token_ids": list(target.eos_token_ids), "template_supports_tools": supports_tools(
            target.tokenizer), "drafter_params": sum(p.numel() for p in drafter.model.parameters()),
        "load_s": round(load_s, 1),
    }


def summarise(alias: str, dtype: str, method: str, runs: list[Run], plain: list[Run], ratio: dict[int, float],
              divergences: list[dict]) -> dict:
    """One record: ratio-of-totals rates, medians of per-prompt speed-ups, acceptance, the prediction."""
    tokens = sum(len(r.tokens) for r in runs)
    decode_s, e2e_s = sum(r.decode_s for r in runs), sum(r.e2e_s for r in runs)
    plain_tokens = sum(len(r.tokens) for r in plain)
    plain_decode, plain_e2e = sum(r.decode_s for r in plain), sum(r.e2e_s for r in plain)
    t_ar = plain_decode / plain_tokens  # plain decode-only seconds per generated token
    # per-prompt decode speed-ups; a decode time <= 0 (prefill noise on a very short answer) is left out
    per_prompt = [(len(r.tokens) / r.decode_s) / (len(p.tokens) / p.decode_s)
                  for r, p in zip(runs, plain, strict=True) if r.decode_s > 0 and p.decode_s > 0 and p.tokens]
    passes = sum(r.target_passes for r in runs)
    # the same rates from each call's own first step on: no separately timed prefill involved
    after = sum(len(r.tokens) - r.out.first_tokens for r in runs) / sum(r.after_first_s for r in runs)
    plain_after = (sum(len(r.tokens) - r.out.first_tokens for r in plain) / sum(r.after_first_s for r in plain))
    rec: dict[str, Any] = {
        "target": alias, "dtype": dtype, "method": method, "prompts": len(runs), "new_tokens": tokens,
        "e2e_s": e2e_s, "prefill_s": sum(r.prefill_s for r in runs), "decode_s": decode_s,
        "tokens_per_s": tokens / decode_s, "tokens_per_s_e2e": tokens / e2e_s,
        "speedup_vs_plain": (tokens / decode_s) / (plain_tokens / plain_decode),
        "speedup_vs_plain_e2e": (tokens / e2e_s) / (plain_tokens / plain_e2e),
        "speedup_vs_plain_median": statistics.median(per_prompt) if per_prompt else None,
        "tokens_per_s_after_first": after, "speedup_vs_plain_after_first": after / plain_after,
        "first_step_s": sum(r.out.first_s for r in runs),
        "median_over_prompts": len(per_prompt),
        "target_passes": passes, "tokens_per_target_pass": tokens / passes if passes else None,
        "drafter_passes": sum(r.drafter_passes for r in runs), "t_ar": t_ar,
        "cpu_per_wall": sum(r.cpu_s for r in runs) / e2e_s,
        "mean_accepted_length": None, "alpha": None, "per_position_acceptance": None,
        "predicted_speedup": None, "achieved_over_predicted": None,
        "after_first_over_predicted": None, "identical_to_plain": not divergences,
        "real_failures": sum(d["verdict"] == "FAILURE" for d in divergences),
        "tie_divergences": sum(d["verdict"] == "tie" for d in divergences),
        "divergences": divergences,
    }
    stats = [r.stats for r in runs if r.stats is not None]
    if stats:
        pooled = common.pooled_stats(stats)
        gammas = pooled.pop("gammas")
        predicted = router.predicted_speedup(gammas, pooled["alpha"], t_ar, pooled["t_d"],
                                             lambda k: _ratio_at(ratio, k))
        rec.update(mean_accepted_length=pooled["mean_accepted_length"], alpha=pooled["alpha"],
                   per_position_acceptance=pooled["per_position_acceptance"], spec_stats=pooled,
                   mean_draft_length=statistics.fmean(gammas) if gammas else 0.0,
                   predicted_speedup=predicted, achieved_over_predicted=rec["speedup_vs_plain"] / predicted,
                   after_first_over_predicted=rec["speedup_vs_plain_after_first"] / predicted)
    return rec


def _ratio_at(ratio: dict[int, float], k: int) -> float:
    """t_v(k)/t_v(1) from the measured curve; past its end (forced grammar runs can be long) extrapolated
    in proportion to k from the longest measured pass."""
    if k in ratio:
        return ratio[k]
    top = max(ratio)
    return ratio[top] * k / top


def acceptance(records: list[dict]) -> dict:
    """The figures acceptance is judged on (agentspec methods only; HF's own divergences listed apart)."""
    by = {(r["target"], r["dtype"], r["method"]): r for r in records}
    ours = [r for r in records if r["method"] in AGENTSPEC_METHODS]
    out: dict[str, Any] = {"ngram_vs_prompt_lookup_bf16": {}, "achieved_over_predicted_bf16": {},
                           "ngram_vs_prompt_lookup_bf16_after_first": {}}
    for (alias, dtype, method), r in by.items():
        if dtype == "bfloat16" and method == "agentspec_ngram":
            hf = by[(alias, dtype, "prompt_lookup")]
            out["ngram_vs_prompt_lookup_bf16"][alias] = r["tokens_per_s"] / hf["tokens_per_s"]
            out["achieved_over_predicted_bf16"][alias] = r["achieved_over_predicted"]
            out["ngram_vs_prompt_lookup_bf16_after_first"][alias] = (
                r["tokens_per_s_after_first"] / hf["tokens_per_s_after_first"])
    out["all_identical"] = all(
        r["identical_to_plain"] if r["dtype"] == "float32" else r["real_failures"] == 0 for r in ours)
    out["bf16_tie_divergences"] = sum(r["tie_divergences"] for r in ours if r["dtype"] == "bfloat16")
    out["real_failures"] = sum(r["real_failures"] for r in ours)
    hf = [r for r in records if r["method"] == "prompt_lookup"]
    out["hf_prompt_lookup_divergences"] = {"ties": sum(r["tie_divergences"] for r in hf),
                                           "real": sum(r["real_failures"] for r in hf)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    prompts = common.bfcl_prompts(args.prompts, args.categories)
    log(f"{len(prompts)} prompts:", ", ".join(p.id for p in prompts))
    settings = {k: getattr(args, k) for k in ("targets", "dtypes", "prompts", "categories", "max_new_tokens", "methods",
                                              "prefill_reps",
                                              "num_draft_tokens", "max_ngram", "model_draft_layers",
                                              "model_draft_tokens", "curve_reps", "tie_ulps", "threads", "quick")}
    meta = {"settings": settings, "machine": common.machine_info(),
            "data": {"source": "bfcl_eval wheel, BFCL v4", "prompt_ids": [p.id for p in prompts],
                     "selection": "per category: evenly spread indices i*len//n, first categories take the "
                                  "remainder", "warmup_prompt_id": common.warmup_prompt().id},
            "methods": list(METHODS), "models": {}}
    records, verify_cost, per_prompt = [], {}, {}
    json_path, md_path = Path(f"{args.out}.json"), Path(f"{args.out}.md")

    def save() -> dict:  # after every target × dtype, so a long run that is cut short keeps its results
        meta["load_average_end"] = list(os.getloadavg())
        result = {"meta": meta, "verify_cost": verify_cost, "records": records, "acceptance": acceptance(records),
                  "per_prompt": per_prompt}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1, default=str))
        write_markdown(result, md_path)
        return result

    for alias in args.targets:
        for dtype in args.dtypes:
            recs, curve, rows, info = bench_target_dtype(alias, dtype, prompts, args)
            meta["models"][f"{alias}/{dtype}"] = info
            records += recs
            verify_cost[f"{alias}/{dtype}"] = curve
            per_prompt[f"{alias}/{dtype}"] = rows
            result = save()
    acc = result["acceptance"]
    log("acceptance:", json.dumps(acc))
    log(f"wrote {json_path} and {md_path}")
    if not acc["all_identical"]:
        log("!!! LOSSLESSNESS FAILURE: agentspec output differs from plain greedy beyond bf16 ties (see report)")
        return 1
    return 0


def merge(paths: list[str], out: str) -> dict:
    """Combine result files of separate runs (same settings, other targets × dtypes) into one."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    settings = [{k: v for k, v in p["meta"]["settings"].items() if k not in ("targets", "dtypes")} for p in parts]
    if any(s != settings[0] for s in settings):
        raise SystemExit(f"refusing to merge runs with different settings: {settings}")
    meta = parts[0]["meta"]
    meta["merged_from"] = [{"path": p, "date_utc": x["meta"]["machine"]["date_utc"],
                            "targets": x["meta"]["settings"]["targets"], "dtypes": x["meta"]["settings"]["dtypes"]}
                           for p, x in zip(paths, parts, strict=True)]
    result: dict[str, Any] = {"meta": meta, "verify_cost": {}, "records": [], "per_prompt": {}}
    for x in parts:
        meta["models"].update(x["meta"]["models"])
        result["verify_cost"].update(x["verify_cost"])
        result["per_prompt"].update(x["per_prompt"])
        result["records"] += x["records"]
    result["acceptance"] = acceptance(result["records"])
    Path(f"{out}.json").write_text(json.dumps(result, indent=1, default=str))
    write_markdown(result, Path(f"{out}.md"))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["merge"]:  # python -m benchmarks.speedup merge OUT PART.json PART.json ...
        merge(sys.argv[3:], sys.argv[2])
        sys.exit(0)
    sys.exit(main())
