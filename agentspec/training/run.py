"""``agentspec train`` end to end: data → split → the target's responses → drafter → train → evaluate → report.

Everything lands in ``cfg.output``: ``responses.jsonl``, ``checkpoint.pt``, the drafter (loads as
``--draft-model DIR`` and ``ModelDrafter(load_model(DIR))``) and ``report.json`` / ``report.md``.
"""

from __future__ import annotations

import copy
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from agentspec import models
from agentspec.training import data, distill
from agentspec.training.config import TrainConfig
from agentspec.training.evaluate import evaluate


def _say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


def _bar(label: str):
    """A tqdm progress callback (quiet when stderr is not a terminal)."""
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int, loss: float | None = None) -> None:
        if "b" not in bar:
            bar["b"] = tqdm(total=total, desc=label, disable=not sys.stderr.isatty(), leave=False)
        bar["b"].n = done
        if loss is not None:
            bar["b"].set_postfix(loss=f"{loss:.3f}")
        bar["b"].refresh()
        if done >= total:
            bar["b"].close()
    return update


def run_training(cfg: TrainConfig, target: models.LoadedModel | None = None, stop_after: int | None = None
                 ) -> dict[str, Any]:
    """Run (or resume) a training job; returns the report. ``target`` skips loading it (tests)."""
    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    examples = data.load_examples(cfg.data)
    train_ex, held_ex = data.split(examples, cfg.split, cfg.heldout_fraction, cfg.heldout_categories.split(","))
    train_ex = data.spread(train_ex, cfg.max_train_prompts)
    held_ex = data.spread(held_ex, cfg.max_heldout_prompts)
    _say(f"{len(train_ex)} training prompts, {len(held_ex)} held out (split by {cfg.split})")
    if target is None:
        _say(f"loading target {cfg.target} ({cfg.dtype})")
        target = models.load_model(cfg.target, device=cfg.device, dtype=cfg.dtype)
    t_data = time.perf_counter()
    samples = distill.target_responses(target, train_ex, cfg, out / "responses.jsonl", _bar("target responses"))
    data_s = time.perf_counter() - t_data
    drafter = distill.init_drafter(target, cfg)
    full_vocab = int(drafter.get_output_embeddings().weight.shape[0])
    vocab = distill.draft_vocabulary(samples, cfg.draft_vocab, full_vocab, target.tokenizer.all_special_ids)
    full_head = drafter.get_output_embeddings().weight.detach()  # frozen; the saved head starts from it
    if vocab is not None:  # train the head the drafter will draft with
        models.restrict_output_vocab(drafter, vocab)
    report: dict[str, Any] = {"config": cfg.to_dict(), "train_ids": [e.id for e in train_ex],
                              "heldout_ids": [e.id for e in held_ex], "samples": len(samples),
                              "response_tokens": sum(len(s.response_ids) for s in samples),
                              "drafter_params": sum(p.numel() for p in drafter.parameters()),
                              "draft_vocab": len(vocab) if vocab else full_vocab}
    checkpoint = out / "checkpoint.pt"
    eval_target = None
    if cfg.eval_before and not checkpoint.exists() and stop_after is None:
        eval_target = _eval_target(target, cfg)
        _say("evaluating the untrained drafter on held-out prompts")
        report["before"] = evaluate(eval_target, _as(drafter, eval_target), held_ex, cfg.ks, cfg.max_new_tokens, _say)
    report["resumed"] = checkpoint.exists()  # then train_s times this run's part only
    t_train = time.perf_counter()
    state = distill.train(drafter, samples, cfg, checkpoint, target.model if cfg.kl_weight > 0 else None,
                          stop_after, _bar("training"))
    report.update(train_steps=state.step, final_loss=state.losses[-1] if state.losses else None,
                  losses=state.losses, train_s=time.perf_counter() - t_train, responses_s=data_s)
    total = math.ceil(len(samples) / cfg.batch_size) * cfg.epochs
    if state.step < total:
        _say(f"stopped at step {state.step}/{total}; rerun the same command to resume")
        report["finished"] = False
        return report
    distill.save_drafter(drafter, target.tokenizer, out, {"target": cfg.target, "steps": state.step}, vocab,
                         full_head)
    drafter = models.load_model(str(out), device=target.device, dtype="float32").model  # what users will load
    eval_target = eval_target or _eval_target(target, cfg)
    _say("evaluating the trained drafter on held-out prompts")
    report["after"] = evaluate(eval_target, _as(drafter, eval_target), held_ex, cfg.ks, cfg.max_new_tokens, _say)
    report.update(finished=True, wall_s=time.perf_counter() - t0,
                  peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(report_markdown(report))
    _say(f"wrote {out}/report.md")
    return report


def _eval_target(target: models.LoadedModel, cfg: TrainConfig) -> models.LoadedModel:
    """The target in the evaluation dtype (a converted copy when it differs from the training dtype)."""
    dtype = models.resolve_dtype(cfg.eval_dtype, target.device)
    if dtype == target.dtype:
        return target
    model = copy.deepcopy(target.model).to(dtype)
    return models.LoadedModel(model, target.tokenizer, target.name, target.device, dtype)


def _as(drafter: Any, target: models.LoadedModel) -> Any:
    """The drafter in the target's dtype (a copy: training continues on the original)."""
    base = drafter.merge_and_unload() if hasattr(drafter, "merge_and_unload") else drafter
    return copy.deepcopy(base).to(target.dtype).eval()


def _identity(figures: dict[str, Any]) -> str:
    """"yes", "ties: N" (bf16 top-2 ties only) or "FAILED: N" (a real divergence: a bug)."""
    divs = figures.get("divergences", [])
    real = sum(d["verdict"] != "tie" for d in divs)
    return "FAILED: " + str(real) if real else (f"ties: {len(divs)}" if divs else "yes")


def report_markdown(report: dict[str, Any]) -> str:
    """The before/after table of a finished run."""
    lines = ["# agentspec train report", "",
             f"target `{report['config']['target']}`, {len(report['train_ids'])} training prompts "
             f"({report['samples']} responses, {report['response_tokens']} tokens), drafter output vocabulary "
             f"{report.get('draft_vocab')} ids, "
             f"{len(report['heldout_ids'])} held out; {report['train_steps']} steps, final loss "
             f"{report['final_loss']:.3f}, training {report['train_s'] / 60:.1f} min, wall {report['wall_s'] / 60:.1f} "
             f"min, peak RSS {report['peak_rss_mib']:.0f} MiB", "",
             "| k | MAL before | MAL after | α before | α after | draft ms/tok after | speed-up before | "
             "speed-up after (pred.) | identical (bf16 ties) |", "|---|---|---|---|---|---|---|---|---|"]
    before = report.get("before", {}).get("by_k", {})
    for k, a in report["after"]["by_k"].items():
        b = before.get(k, {})
        lines.append(f"| {k} | {b.get('mean_accepted_length', float('nan')):.2f} | {a['mean_accepted_length']:.2f} "
                     f"| {b.get('alpha', float('nan')):.3f} | {a['alpha']:.3f} | {a['draft_ms_per_token']:.1f} | "
                     f"{b.get('measured_speedup', float('nan')):.2f} | {a['measured_speedup']:.2f} "
                     f"({a['predicted_speedup']:.2f}) | {_identity(a)} |")
    after = report["after"]
    if "t_ar" in after:
        curve = ", ".join(f"{n}: {r:.2f}" for n, r in after.get("verify_cost_ratio", {}).items())
        lines += ["", f"Evaluation ({report['config'].get('eval_dtype')}): plain decoding {after['t_ar'] * 1e3:.1f} "
                      f"ms/token; verify cost t_v(n)/t_v(1) for n tokens: {curve}."]
    lines += ["", "Held-out ids: " + ", ".join(report["heldout_ids"]), ""]
    return "\n".join(lines)
