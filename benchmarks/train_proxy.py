"""Cheap ablations of ``agentspec train`` recipes by teacher-forced agreement, which predicts greedy acceptance.

In greedy speculation every committed token is the target's, so whether the drafter's k-th proposal of a
round is accepted is exactly whether its argmax, given the true prefix, equals the target's next token
(up to dtype: this runs fp32, the benchmark's speculative evaluation bf16). From those per-token flags the
mean accepted length at any k follows by walking the response round by round. That needs one drafter
forward pass per response instead of a timed speculative decode per k.

``python -m benchmarks.train_proxy --name NAME [--init-layers L] [--epochs E] [--lr LR] [--train-head]
[--kl-weight W] [--batch-size B] [--threads T]`` trains on 280 of the 320 cached responses of
``benchmarks.train`` (``--responses``; every 8th is held back as "val40"), and scores the 40 held back and
the benchmark's 12 held-out prompts (their greedy answers are generated once into ``--held``).
``--existing DIR`` scores a trained drafter directory instead. Each run appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from agentspec import models
from agentspec.training import data, distill
from agentspec.training.config import TrainConfig
from benchmarks import common


def flags_of(model: Any, sample: distill.Sample) -> list[bool]:
    """Per response token: does the drafter's argmax given the true prefix equal the target's token?"""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        body = getattr(model, model.base_model_prefix)
        hidden = body(input_ids=ids).last_hidden_state[0, len(sample.prompt_ids) - 1 : -1]
        top = model.get_output_embeddings()(hidden).argmax(-1)
    token_map = getattr(model, "agentspec_token_map", None)
    if token_map is not None:
        top = token_map[top]
    return (top == torch.tensor(sample.response_ids)).tolist()


def walk(flags: list[bool], k: int) -> tuple[int, int, list[bool]]:
    """(tokens, rounds, first-position outcomes) of greedy speculation with k drafts per round."""
    pos = rounds = 0
    first = []
    while pos < len(flags):
        accepted = 0
        while accepted < k and pos + accepted < len(flags) and flags[pos + accepted]:
            accepted += 1
        first.append(flags[pos])
        rounds += 1
        pos += accepted + 1  # the accepted drafts and the target's own next token
    return len(flags), rounds, first


def score(model: Any, groups: dict[str, list[distill.Sample]]) -> dict[str, dict[str, float]]:
    out = {}
    for label, group in groups.items():
        flags = [flags_of(model, s) for s in group]
        res = {"tf_acc": round(sum(map(sum, flags)) / sum(map(len, flags)), 4)}
        for k in (2, 4, 8):
            tokens = rounds = 0
            first: list[bool] = []
            for f in flags:
                n, r, p1 = walk(f, k)
                tokens, rounds, first = tokens + n, rounds + r, first + p1
            res[f"mal{k}"] = round(tokens / rounds, 3)
            if k == 4:
                res["pos1"] = round(sum(first) / len(first), 3)
        out[label] = res
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="base")
    p.add_argument("--init-layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-head", action="store_true")
    p.add_argument("--kl-weight", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--existing", default="", help="score this drafter directory instead of training one")
    p.add_argument("--responses", default="drafters/bench-qwen-320-e4/responses.jsonl")
    p.add_argument("--held", default="drafters/heldout12.jsonl")
    p.add_argument("--work", default="/tmp/agentspec-train-proxy")
    p.add_argument("--out", default="benchmarks/results/train_proxy.jsonl")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(output=f"{args.work}/{args.name}", init_layers=args.init_layers, epochs=args.epochs,
                      lr=args.lr, train_head=args.train_head, kl_weight=args.kl_weight, batch_size=args.batch_size,
                      max_new_tokens=64, max_train_prompts=320, max_heldout_prompts=12)
    target = models.load_model(cfg.target, dtype="float32")
    samples = [distill.Sample(**json.loads(line)) for line in Path(args.responses).read_text().splitlines() if line.strip()]
    val = [s for i, s in enumerate(samples) if i % 8 == 0]
    train = [s for i, s in enumerate(samples) if i % 8 != 0]
    held_path = Path(args.held)
    if not held_path.exists():
        examples = data.load_examples(cfg.data)
        _, held = data.split(examples, cfg.split, cfg.heldout_fraction, cfg.heldout_categories.split(","))
        distill.target_responses(target, data.spread(held, 12), cfg, held_path)
    held = [distill.Sample(**json.loads(line)) for line in held_path.read_text().splitlines() if line.strip()]
    groups = {"val40": val, "held12": held}
    record: dict[str, Any] = {"name": args.name, "machine": common.machine_info()}
    if args.existing:
        drafter = models.load_model(args.existing, dtype="float32", pack_linears=False).model
        record["existing"] = args.existing
    else:
        drafter = distill.init_drafter(target, cfg)
        full = int(drafter.get_output_embeddings().weight.shape[0])
        models.restrict_output_vocab(drafter, distill.draft_vocabulary(train, cfg.draft_vocab, full,
                                                                       target.tokenizer.all_special_ids))
        checkpoint = Path(args.work) / f"{args.name}.pt"
        checkpoint.unlink(missing_ok=True)
        t0 = time.perf_counter()

        def progress(step: int, total: int, loss: float) -> None:
            if step % 10 == 0 or step == total:
                common.log(f"step {step}/{total} loss {loss:.3f}")
        state = distill.train(drafter, train, cfg, checkpoint, target.model if cfg.kl_weight > 0 else None,
                              progress=progress)
        drafter.eval()
        record.update(recipe={k: getattr(cfg, k) for k in ("init_layers", "epochs", "lr", "train_head",
                                                            "kl_weight", "batch_size")},
                      train_s=time.perf_counter() - t0, steps=state.step, final_loss=state.losses[-1])
    record["scores"] = score(drafter, groups)
    common.log(args.name, json.dumps(record["scores"]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
