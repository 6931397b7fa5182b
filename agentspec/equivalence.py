"""Is a speculative output the target's own? Exact comparison, and bf16 ties judged by the logit margin.

Greedy speculation must reproduce plain greedy decoding token for token. In fp32 on a batch-invariant
backend it does, bitwise. In bf16 the verify pass (several rows) and plain decoding (one row) round
differently, so where the target's top-2 logits are within rounding of each other either token is the
target's greedy choice. Pure math on given logits: :func:`agentspec.models.check_divergence` runs the
forward at :func:`first_divergence` for :func:`judge_divergence` to call a *tie* or a failure.
"""

from __future__ import annotations

import math

import torch


def top2_margin(logits: torch.Tensor) -> tuple[int, float, int, float]:
    """``(top1 id, top1 logit, top2 id, top2 logit)`` of one logit row."""
    values, ids = torch.topk(logits, 2)
    return int(ids[0]), float(values[0]), int(ids[1]), float(values[1])


def bf16_ulp(x: float) -> float:
    """Spacing of bfloat16 numbers at magnitude ``|x|`` (8 significant bits: ``2**(exponent - 7)``)."""
    x = abs(x)
    return 2.0**-133 if x < 2.0**-126 else 2.0 ** (math.floor(math.log2(x)) - 7)


def first_divergence(plain: list[int], other: list[int]) -> int | None:
    """``None`` if ``other == plain``; else where they first differ (a strict prefix: its length)."""
    if other == plain:
        return None
    differ = (i for i, (a, b) in enumerate(zip(plain, other, strict=False)) if a != b)
    return next(differ, min(len(plain), len(other)))


def judge_divergence(logits: torch.Tensor, plain: list[int], other: list[int], pos: int, bf16: bool,
                     tie_ulps: float, noise: float) -> dict:
    """The target's margin at ``pos`` (where ``plain`` and ``other`` first differ) and the verdict there.

    ``logits``: the target's next-token logits after prompt + ``plain[:pos]`` in the run's dtype (``bf16``:
    whether that is bfloat16). A bf16 divergence is a tie when both chosen tokens' logits lie within
    ``threshold`` of the top logit (for the top-2 tokens: margin <= threshold), threshold = max(tie_ulps ·
    bf16 ulp, 2 · noise), ``noise`` being the largest logit difference measured between computation paths
    (:func:`agentspec.models.logit_path_noise`; each of two logits can move by it, so their order can flip
    within twice it). In fp32 every divergence is a failure.
    """
    top1, top1_logit, top2, top2_logit = top2_margin(logits)
    margin = top1_logit - top2_logit
    ulp = bf16_ulp(top1_logit)
    chosen = plain[pos:pos + 1] + other[pos:pos + 1]
    worst = max((top1_logit - float(logits[t]) for t in chosen), default=float("inf"))
    if len(chosen) < 2:  # one output is a strict prefix of the other: never a rounding tie
        worst = float("inf")
    threshold = max(tie_ulps * ulp, 2.0 * noise)
    tie = bf16 and worst <= threshold
    return {
        "top1": top1, "top2": top2, "top1_logit": top1_logit, "margin": margin, "worst_gap": worst,
        "bf16_ulp": ulp, "margin_ulps": margin / ulp, "tie_threshold": threshold, "tie": tie,
        "verdict": "tie" if tie else "FAILURE",
    }
