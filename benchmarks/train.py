"""Distil a tool-call drafter for Qwen2.5-Coder-0.5B-Instruct on BFCL prompts and measure it, before and after.

``python -m benchmarks.train [--train-prompts N] [--heldout-prompts M] [--epochs E] [--init-layers L]
[--lr LR] [--draft-vocab V]`` runs
``agentspec train`` (:func:`agentspec.training.run.run_training`) with the settings below: BFCL v4 prompts split
by a stable hash of their ids, the target's own greedy answers (fp32, packed CPU linears), a drafter made of
the target's first L layers (embeddings and head frozen), and an output head cut to the V most frequent token
ids of the training data (drafting cost is mostly that head); cross-entropy on the answer tokens over that
head's rows, as it will draft. The held-out
evaluation runs in bf16, co-located: the trained drafter alone drafts k = 2, 4, 8 tokens per round and the
target verifies; plain greedy decoding of the same model on the same prompts is the baseline.

Writes ``benchmarks/results/train.json`` (with the top-level ``acceptance`` object) and ``train.md``; the
drafter itself goes to ``--output`` (not committed).

``--pair`` fine-tunes a pretrained drafter instead (issue 23, item 3): Qwen2.5-Coder-0.5B-Instruct with LoRA
adapters on every linear layer of its decoder (merged into the saved weights) on the answers of
Qwen2.5-Coder-1.5B-Instruct, trained and evaluated in bf16 (the 1.5B's dtype on CPU), k = 2, 4, 8, 16;
writes ``train_pair.json`` / ``train_pair.md``. ``--pair --recipe from-target`` keeps the wave-1 recipe for
comparison on the same target: a drafter made of the 1.5B's own first ``--init-layers`` layers (embeddings
frozen, head cut to ``--draft-vocab`` ids), trained in fp32 on the 1.5B's answers; writes
``train_pair_from_target.json`` / ``.md``. Its untrained layers draft nothing useful (wave 1 measured
α = 0.002), so ``--no-eval-before`` is the sensible companion.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from agentspec.training.config import TrainConfig
from agentspec.training.run import report_markdown, run_training
from benchmarks import common

PAIR_TARGET, PAIR_DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train-prompts", type=int, default=320)
    p.add_argument("--heldout-prompts", type=int, default=12)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--init-layers", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--output", default=None, help="the drafter's directory (default: by recipe)")
    p.add_argument("--out", default=None, help="results without suffix (default: benchmarks/results/train[_pair])")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pair", action="store_true", help="LoRA-tune the 0.5B on the 1.5B's answers (see above)")
    p.add_argument("--recipe", choices=("pretrained", "from-target"), default="pretrained",
                   help="--pair: fine-tune the pretrained 0.5B (default) or build a drafter from the 1.5B's first "
                   "--init-layers layers")
    p.add_argument("--lora-rank", type=int, default=16, help="--pair: the adapters' rank (0: full fine-tuning)")
    p.add_argument("--drafter-dtype", default="", help="--pair: the 0.5B's dtype while it trains (default: bf16, "
                   "the target's; float32 for full fine-tuning, whose small updates bf16 would round away)")
    p.add_argument("--no-eval-before", action="store_true",
                   help="skip evaluating the untrained drafter (another run measured it on the same prompts)")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    if args.recipe == "from-target" and not args.pair:
        p.error("--recipe from-target is a --pair option (without --pair the from-target recipe is the default)")
    torch.set_num_threads(args.threads)
    recipe = ("from-target" if args.recipe == "from-target" else "lora" if args.lora_rank else "full") \
        if args.pair else ""
    args.output = args.output or {"from-target": f"drafters/pair-1.5b-{args.init_layers}l", "": "drafters/bench-qwen-320-e4"
                                  }.get(recipe, f"drafters/pair-0.5b-{recipe}")
    args.out = args.out or "benchmarks/results/train" + {"lora": "_pair", "full": "_pair_full", "": "",
                                                         "from-target": "_pair_from_target"}[recipe]
    common_cfg = dict(output=args.output, max_train_prompts=args.train_prompts, epochs=args.epochs,
                      max_heldout_prompts=args.heldout_prompts, max_new_tokens=args.max_new_tokens,
                      threads=args.threads, lr=args.lr, draft_vocab=args.draft_vocab, batch_size=args.batch_size,
                      eval_before=not args.no_eval_before)
    if recipe == "from-target":  # trained in fp32 (bf16 would round its small updates away), evaluated in bf16
        cfg = TrainConfig(**common_cfg, target=PAIR_TARGET, init="from-target", init_layers=args.init_layers,
                          dtype="bfloat16", drafter_dtype=args.drafter_dtype or "float32", max_len=640,
                          eval_ks="2,4,8,16")
    elif args.pair:
        drafter_dtype = args.drafter_dtype or ("bfloat16" if args.lora_rank else "float32")
        cfg = TrainConfig(**common_cfg, target=PAIR_TARGET, drafter=PAIR_DRAFTER, lora_rank=args.lora_rank,
                          dtype="bfloat16", drafter_dtype=drafter_dtype, max_len=640, eval_ks="2,4,8,16")
    else:
        cfg = TrainConfig(**common_cfg, init="from-target", init_layers=args.init_layers)
    t0 = time.perf_counter()
    report = run_training(cfg)
    wall = time.perf_counter() - t0
    if not report.get("finished"):
        common.log("training did not finish; nothing written")
        return 1
    # a resumed run has no "before" (it was evaluated, and logged, by the run that started training), nor
    # has one run with --no-eval-before
    before, after = report.get("before", {}).get("by_k", {}), report["after"]["by_k"]
    evaluated = [r for r in (before, after) if r]

    def was(k: int, name: str) -> Any:
        return before[k][name] if before else None
    best_k = max(after, key=lambda k: after[k]["measured_speedup"])
    k8 = 8 if 8 in after else max(after)
    acceptance = {
        "alpha_before": was(k8, "alpha"), "alpha_after": after[k8]["alpha"], "alpha_k": k8,
        f"mean_accepted_length_k{k8}_before": was(k8, "mean_accepted_length"),
        f"mean_accepted_length_k{k8}_after": after[k8]["mean_accepted_length"],
        "mean_accepted_length_before": {k: v["mean_accepted_length"] for k, v in before.items()} or None,
        "mean_accepted_length_after": {k: v["mean_accepted_length"] for k, v in after.items()},
        f"per_position_acceptance_k{k8}_after": after[k8]["per_position_acceptance"],
        "mean_accepted_length_k4_before": was(4, "mean_accepted_length"),
        "mean_accepted_length_k4_after": after[4]["mean_accepted_length"],
        "decode_speedup_bf16": after[best_k]["measured_speedup"],
        "decode_speedup_bf16_k": best_k,
        "decode_speedup_bf16_k4": after[4]["measured_speedup"],
        "all_identical_to_plain": all(v["identical_to_plain"] for r in evaluated for v in r.values()),
        "all_lossless": all(v["lossless"] for r in evaluated for v in r.values()),  # bf16 ties only
        "real_divergences": sum(d["verdict"] != "tie" for r in evaluated for v in r.values()
                                for d in v["divergences"]),
        # a resumed run times only its own part: the minutes are then in the log of the run that trained
        "train_minutes": None if report["resumed"] else report["train_s"] / 60,
        "target_responses_minutes": report["responses_s"] / 60,
        "targets": {"alpha_after": 0.85, "mean_accepted_length_k8_after": 5.0, "train_minutes": 60} if args.pair
        else {},
        "train_ids": report["train_ids"],
        "heldout_ids": report["heldout_ids"],
    }
    result = {"acceptance": acceptance, "meta": {"model": cfg.target, "drafter": cfg.drafter or f"from-target ({cfg.init_layers} layers)",
                                                 "lora_rank": cfg.lora_rank, "train_dtype": cfg.dtype,
                                                 "drafter_train_dtype": cfg.drafter_train_dtype,
                                                 "eval_dtype": cfg.eval_dtype, "data": cfg.data,
                                                 "split": cfg.split, "machine": common.machine_info(),
                                                 "wall_minutes": wall / 60,
                                                 "peak_rss_mib": report["peak_rss_mib"]},
              "report": report}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    common.log("acceptance:", json.dumps({k: v for k, v in acceptance.items() if not k.endswith("_ids")}))
    return 0


def markdown(result: dict) -> str:
    """``train.md``: the run's before/after report, the machine, the acceptance figures."""
    m, acceptance = result["meta"]["machine"], result["acceptance"]
    return (report_markdown(result["report"])
            + f"\nMachine: {m['cpu']} ({', '.join(m['cpu_flags'])}), {m['torch_threads']} threads, torch {m['torch']}, "
              f"commit {m.get('git_commit')}.\n\n## Acceptance\n\n"
            + "\n".join(f"* `{k}`: {v}" for k, v in acceptance.items() if not k.endswith("_ids")) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
