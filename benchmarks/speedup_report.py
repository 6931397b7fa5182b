"""Markdown report for :mod:`benchmarks.speedup`: tables per target × dtype, the verify-cost curve, the
divergences with their margins, the prompt ids and how everything was measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOW = """\
* **One process, interleaved.** Per target × dtype every method runs on every prompt before the next
  prompt starts; the method order is rotated by one per prompt. Before timing: every parameter is read
  and one forward over the longest sequence is run (fresh memory is slow to fault in here), then each
  method generates once, untimed, on a warm-up prompt outside the measured set.
* **Greedy only**, `max_new_tokens` as in the settings; HF `generate` gets a `GenerationConfig` with
  `do_sample=False` and `eos_token_id` = the engine's stop ids (`LoadedModel.eos_token_ids`).
* **prompt_lookup** is transformers' prompt lookup (`prompt_lookup_num_tokens=K`,
  `max_matching_ngram_size=N`); **agentspec_ngram** is `NgramDrafter(max_ngram=N, min_ngram=1)` with
  `SpecEngine(num_draft_tokens=K)`: same K and N. (HF continues the *earliest* n-gram match in the
  context, agentspec the *latest*; both drop to shorter n-grams when the longest has no match.)
  agentspec_ngram lets `agentspec.router.DraftLengthPolicy` pick γ ≤ K each round: the γ maximising
  expected tokens per second, E[A](γ) / (γ·t_d + t_v(γ)), from the per-position acceptance it has seen so
  far and the verify-cost curve (seeded with the curve measured below, refined online); γ = 0 is a
  plain step, with a 1-token probe every 16 such rounds. **agentspec_ngram_fixed** drafts the full K
  every round, as transformers does. The policies learn across prompts (the warm-up prompt included),
  as a long-running engine would.
  **agentspec_plain** is the engine with no drafter (its overhead); **agentspec_model** drafts with the
  target's own first L layers (same tokenizer by construction), γ ≤ L' chosen by the same policy.
* **Times.** End-to-end = wall time of the whole call. Prefill = one forward over the prompt alone into a
  fresh cache, timed before and after the methods on that prompt (median of the 2). Decode-only =
  end-to-end − prefill. Rates are **ratios of totals**: Σ new tokens / Σ decode seconds over all prompts;
  `speedup` = method rate / plain rate (decode-only, and the same end-to-end). `median` is the median
  over prompts of the per-prompt decode-only speed-up. `after 1st` is the same ratio of totals measured
  inside each call: tokens after the call's first committed step / time after it (HF: a streamer notes
  the first `put` after the prompt; engine: the first streamed round), so a separately timed prefill
  and its noise play no part — the first step's tokens (1 + drafts accepted with the prompt) and time
  are left out for every method alike. When the per-prompt `prefill_spread_s` in the JSON is large next
  to decode times (slow bf16 prefill, a shared CPU), trust `after 1st` and `tok/pass` over
  `speedup decode`. Target passes are counted with a forward pre-hook; `cpu_per_wall` in the JSON well
  below the thread count means the CPU was shared during the run.
* **Verify cost.** On a cached median-length prompt, one forward over k new tokens with all k logit rows
  kept, the cache cropped back after each; median of the repetitions. **k counts every token in the pass**:
  a round with γ draft tokens is a pass over k = γ + 1 tokens (last committed token + draft).
* **Prediction** (design.md): α pooled over prompts (accepted draft positions / drafted positions on the
  target's path), γ_r = the real draft length of each round, t_ar = plain decode seconds per token,
  t_d = Σ draft seconds / Σ drafted tokens, c(k) = t_ar · t_v(k)/t_v(1).
  Predicted time = Σ_r (γ_r·t_d + c(γ_r+1)), tokens = Σ_r (1 − α^(γ_r+1))/(1 − α),
  predicted speed-up = tokens · t_ar / time; `ach/pred` = achieved decode speed-up / predicted.
* **Losslessness.** Every method's tokens are compared with plain greedy's. At the first differing
  position one fresh forward over prompt + common prefix (same dtype) gives the target's logits; the
  report lists every divergence with the top-2 margin. fp32: any divergence is a failure. bf16: a
  divergence is a *tie* when both chosen tokens' logits lie within a threshold of the top logit; the
  threshold is the larger of `tie_ulps` bf16 ulps (spacing of bf16 numbers at the top logit's magnitude,
  2^(⌊log2|x|⌋−7)) and twice the *logit path noise*: the largest |Δ logit| measured (on the warm-up
  prompt's plain output) between three exact ways of computing the same positions — one forward over
  everything, one token per forward, K+1 tokens per forward. Each of two logits can move by that much
  with the computation path alone, so their order can flip within twice it; a wider gap is a real
  failure. `all_identical` covers the agentspec methods; HF's own divergences are listed separately.
"""


def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _at(curve: dict, k: int) -> float | None:
    """``curve[k]`` whether the keys are ints (in memory) or strings (read back from JSON)."""
    return curve.get(k, curve.get(str(k)))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |"
                                                                            for r in rows]


def write_markdown(result: dict, path: Path,
                   title: str = "agentspec speed-up vs plain greedy decoding (BFCL v4 tool-calling prompts)",
                   notes: list[str] = ()) -> None:
    """Render ``result`` (the JSON written by :mod:`benchmarks.speedup`) as Markdown at ``path``."""
    meta, acc = result["meta"], result["acceptance"]
    m, s = meta["machine"], meta["settings"]
    out = [f"# {title}", "", *notes, "",
           f"{m['date_utc']} · {m['cpu']} ({', '.join(m['cpu_flags'])}) · {m['cpu_count']} cores, "
           f"{m['torch_threads']} torch threads · torch {m['torch']} · transformers {m['transformers']} · "
           f"commit {m['git_commit'] or 'none'}", "",
           f"Settings: {len(meta['data']['prompt_ids'])} prompts, max_new_tokens={s['max_new_tokens']}, "
           f"K={s['num_draft_tokens']}, N={s['max_ngram']}, model drafter L={s['model_draft_layers']} layers "
           f"drafting {s['model_draft_tokens']} tokens/round, tie_ulps={s['tie_ulps']}"
           + (" — **quick smoke run, not a measurement**" if s["quick"] else ""), "",
           "## Acceptance figures", ""]
    out += [f"* `{k}`: {v}" for k, v in acc.items()]
    if not acc["all_identical"]:
        out += ["", "**LOSSLESSNESS FAILURE: agentspec output differed from plain greedy beyond bf16 ties.**"]
    out += ["", "## Results", ""]
    header = ["method", "tokens", "tok/s decode", "speedup decode", "median", "after 1st", "speedup e2e",
              "tok/pass", "MAL", "α", "predicted", "ach/pred", "identical", "divergences (tie/real)"]
    for key in result["verify_cost"]:
        recs = [r for r in result["records"] if f"{r['target']}/{r['dtype']}" == key]
        info = meta["models"].get(key, {})
        out += [f"### {key}", "",
                f"{info.get('class')} with {info.get('params')} params, {info.get('layers')} layers, "
                f"parameter dtypes {info.get('param_dtypes')}, linear modules {info.get('linear_modules')}; "
                f"stop ids {info.get('eos_token_ids')}; template supports tools: "
                f"{info.get('template_supports_tools')}; logit path noise {info.get('logit_path_noise')}; t_ar = "
                f"{_f(recs[0]['t_ar'] * 1000 if recs else None, 1)} ms/token", ""]
        rows = [[r["method"], str(r["new_tokens"]), _f(r["tokens_per_s"]), _f(r["speedup_vs_plain"]),
                 _f(r["speedup_vs_plain_median"]), _f(r["speedup_vs_plain_after_first"]),
                 _f(r["speedup_vs_plain_e2e"]),
                 _f(r["tokens_per_target_pass"]), _f(r["mean_accepted_length"]), _f(r["alpha"], 3),
                 _f(r["predicted_speedup"]), _f(r["achieved_over_predicted"]), _f(r["identical_to_plain"]),
                 f"{r['tie_divergences']}/{r['real_failures']}"] for r in recs]
        out += _table(header, rows) + [""]
        spec = [r for r in recs if r.get("spec_stats") and r["spec_stats"]["drafted"]]
        if spec:
            out += ["Per-position acceptance (P(draft token i accepted | drafted on the target's path)), "
                    "draft/verify seconds:", ""]
            out += [f"* {r['method']}: [{', '.join(f'{a:.2f}' for a in r['per_position_acceptance'])}], "
                    f"mean draft length {r['mean_draft_length']:.2f}, t_d = {r['spec_stats']['t_d'] * 1000:.2f}"
                    f" ms/drafted token, draft {r['spec_stats']['draft_s']:.2f}s, verify "
                    f"{r['spec_stats']['verify_s']:.2f}s, rounds {r['spec_stats']['rounds']}" for r in spec]
            out += [""]
    out += ["## Verify-cost curve t_v(k)/t_v(1)", "",
            "k = tokens in one target forward (γ draft tokens + 1), on a cached prompt of the given length.", ""]
    curves = result["verify_cost"]
    ks = sorted({int(k) for c in curves.values() for k in c["ratio"]})
    rows = [[str(k)] + [_f(_at(c["ratio"], k), 2) for c in curves.values()] for k in ks]
    out += _table(["k"] + [f"{key} ({c['prompt_tokens']} tok, t_v(1) = {_at(c['seconds'], 1) * 1000:.1f} ms)"
                           for key, c in curves.items()], rows) + [""]
    out += ["## Divergences from plain greedy", ""]
    divs = [(r, d) for r in result["records"] for d in r["divergences"]]
    if not divs:
        out += ["None: every method produced exactly plain greedy's tokens on every prompt.", ""]
    else:
        out += _table(["target/dtype", "method", "prompt", "pos", "plain → method", "top-2 margin", "bf16 ulps",
                       "gap of chosen", "tie threshold", "verdict"],
                      [[f"{r['target']}/{r['dtype']}", r["method"], d["prompt_id"], str(d["position"]),
                        f"{d['plain_text']!r} → {d['method_text']!r}", f"{d['margin']:.4f}",
                        f"{d['margin_ulps']:.2f}", f"{d['worst_gap']:.4f}", f"{d['tie_threshold']:.4g}",
                        d["verdict"] if d["tie"] else "**FAILURE**"] for r, d in divs]) + [""]
    out += ["## Prompts", "", meta["data"]["selection"] + "; warm-up prompt "
            f"`{meta['data']['warmup_prompt_id']}`.", "", ", ".join(f"`{i}`" for i in meta["data"]["prompt_ids"]),
            "", "## How it was measured", "", HOW]
    path.write_text("\n".join(out))
