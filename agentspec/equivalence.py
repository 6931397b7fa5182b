"""Is a speculative output the target's own? Exact comparison, and bf16 ties judged by the logit margin.

Greedy speculation must reproduce plain greedy decoding token for token. In fp32 on a batch-invariant
backend it does, bitwise. In bf16 the verify pass (several rows) and plain decoding (one row) round
differently, so where the target's top-2 logits are within rounding of each other either token is the
target's greedy choice. :func:`check_divergence` finds the first differing position, recomputes the
target's logits there and calls it a *tie* only when both chosen tokens lie within max(tie_ulps bf16
ulps, 2 x measured path noise) of the top logit (:func:`logit_path_noise`); anything else is a failure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from agentspec import models


def logits_at(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """The target's next-token logits after ``ids`` (one fresh forward, in the model's dtype) as float32."""
    return models.forward(model, list(ids), models.new_cache(model), num_logits=1)[-1].float()


@torch.inference_mode()
def logit_path_noise(model: Any, prompt_ids: Sequence[int], generated: Sequence[int], chunk: int) -> dict:
    """How far the same position's logits move when only the computation path changes.

    The logits predicting each of ``generated`` are computed three ways: (a) one forward over the whole
    sequence, (b) prompt prefill then one token per forward (plain decoding), (c) prompt prefill then
    ``chunk`` tokens per forward (a verify pass). All three are the target's exact greedy computation;
    in bf16 they round differently. Returns the largest and the median absolute difference, over
    positions and path pairs, of the logits of path (a)'s top-2 tokens.
    """
    prompt, gen = list(prompt_ids), list(generated)
    if not gen:
        return {"max_abs": float("nan"), "median_abs": float("nan"), "positions": 0}
    full = models.forward(model, prompt + gen, models.new_cache(model), num_logits=len(gen) + 1)[:-1].float()
    paths = [full]
    for step in (1, chunk):
        cache = models.new_cache(model)
        rows = [models.forward(model, prompt, cache, num_logits=1)]
        for i in range(0, len(gen) - 1, step):
            piece = gen[i:i + step][: len(gen) - 1 - i]
            rows.append(models.forward(model, piece, cache, num_logits=len(piece)))
        paths.append(torch.cat(rows).float())  # [len(gen), vocab]
    top2 = torch.topk(full, 2, dim=-1).indices  # [len(gen), 2]
    picked = [p.gather(-1, top2) for p in paths]
    diffs = torch.cat([(picked[i] - picked[j]).abs().flatten() for i in range(3) for j in range(i + 1, 3)])
    return {"max_abs": float(diffs.max()), "median_abs": float(diffs.median()), "positions": len(gen),
            "chunk": chunk}


def top2_margin(logits: torch.Tensor) -> tuple[int, float, int, float]:
    """``(top1 id, top1 logit, top2 id, top2 logit)`` of one logit row."""
    values, ids = torch.topk(logits, 2)
    return int(ids[0]), float(values[0]), int(ids[1]), float(values[1])


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude ``|x|`` (8 significant bits: ``2**(exponent - 7)``)."""
    x = abs(x)
    if x < 2.0**-126:
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def check_divergence(target: models.LoadedModel, prompt_id: str, ids: list[int], plain: list[int],
                     other: list[int], tie_ulps: float, noise: float) -> dict | None:
    """``None`` if ``other == plain``; else the first differing position and the target's margin there.

    The margin comes from one fresh forward over prompt + common prefix in the run's dtype. A bf16
    divergence is a tie when both chosen tokens' logits lie within ``threshold`` of the top logit (for
    the top-2 tokens: margin <= threshold), threshold = max(tie_ulps · bf16 ulp, 2 · noise), ``noise``
    being the largest logit difference measured between computation paths (each of two logits can move
    by it, so their order can flip within twice it). In fp32 every divergence is a failure.
    """
    if other == plain:
        return None
    differ = (i for i, (a, b) in enumerate(zip(plain, other, strict=False)) if a != b)
    pos = next(differ, min(len(plain), len(other)))
    logits = logits_at(target.model, ids + plain[:pos])
    top1, top1_logit, top2, top2_logit = top2_margin(logits)
    margin = top1_logit - top2_logit
    ulp = bf16_ulp(top1_logit)
    chosen = plain[pos:pos + 1] + other[pos:pos + 1]
    worst = max((top1_logit - float(logits[t]) for t in chosen), default=float("inf"))
    if len(chosen) < 2:  # one output is a strict prefix of the other: never a rounding tie
        worst = float("inf")
    threshold = max(tie_ulps * ulp, 2.0 * noise)
    tie = target.dtype == torch.bfloat16 and worst <= threshold
    decode = target.tokenizer.decode
    return {
        "prompt_id": prompt_id, "position": pos,
        "plain_token": plain[pos] if pos < len(plain) else None,
        "method_token": other[pos] if pos < len(other) else None,
        "plain_text": decode(plain[pos:pos + 1]), "method_text": decode(other[pos:pos + 1]),
        "top1": top1, "top2": top2, "top1_logit": top1_logit, "margin": margin, "worst_gap": worst,
        "bf16_ulp": ulp, "margin_ulps": margin / ulp, "tie_threshold": threshold, "tie": tie,
        "verdict": "tie" if tie else "FAILURE",
    }
