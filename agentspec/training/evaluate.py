"""Held-out evaluation of a drafter against its target: acceptance, draft cost, speed-up.

Each prompt is prefilled once and every run decodes from a copy of that cache (decode time only): plain
(the timed reference) and speculative at fixed γ = k. Every speculative output must equal the plain one
or (bf16 only) diverge first at a top-2 logit tie (:mod:`agentspec.equivalence`); anything else fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from agentspec import models, router
from agentspec.drafters import make_drafter
from agentspec.drafters.base import DraftContext
from agentspec.local import SpecEngine
from agentspec.models import check_divergence, logit_path_noise
from agentspec.toolcalls import render_chat
from agentspec.training.data import ChatExample
from agentspec.types import SamplingParams, SpecStats


def evaluate(target: models.LoadedModel, drafter_model: Any, examples: Sequence[ChatExample], ks: Sequence[int],
             max_new_tokens: int, progress: Callable[[str], None] | None = None, tie_ulps: float = 1.0
             ) -> dict[str, Any]:
    """Figures of ``drafter_model`` (a bare HF model or LoadedModel, same device/dtype as the target).

    ``tie_ulps``: the bf16 tie threshold's floor in bf16 ulps (see :func:`check_divergence`)."""
    prompts = [render_chat(target.tokenizer, list(e.messages), list(e.tools) or None) for e in examples]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    plain = SpecEngine(target, None)
    drafter = make_drafter("model", model=drafter_model)
    curve = models.measure_verify_cost(target.model, prompts[0], max(ks) + 1, reps=2)
    plain.generate(prompts[0], params)  # warm-up
    drafter.propose(DraftContext(prompts[0], len(prompts[0])), 1)
    caches = [_prefill(target, ids) for ids in prompts]  # each run starts from a copy: decode time only
    ref, plain_s, plain_tokens = [], 0.0, 0
    for ids, cache in zip(prompts, caches, strict=True):
        tokens, seconds, counted = _decode_timed(plain, ids, cache, params)
        ref.append(tokens)
        plain_s, plain_tokens = plain_s + seconds, plain_tokens + counted
    t_ar = plain_s / max(plain_tokens, 1)
    # how far bf16 rounding moves a logit between computation paths: the floor for calling a divergence a tie
    noise = logit_path_noise(target.model, prompts[0], ref[0], max(ks) + 1)["max_abs"] if ref[0] else 0.0
    result: dict[str, Any] = {"prompts": len(prompts), "plain_tokens_per_s": plain_tokens / plain_s, "t_ar": t_ar,
                              "verify_cost_ratio": {k: s / curve[1] for k, s in curve.items()},
                              "logit_path_noise": noise, "by_k": {}}
    for k in ks:
        engine = SpecEngine(target, drafter, num_draft_tokens=k)
        stats, seconds, counted, divergences = SpecStats(), 0.0, 0, []
        for example, ids, cache, expected in zip(examples, prompts, caches, ref, strict=True):
            tokens, s, n = _decode_timed(engine, ids, cache, params, stats)
            seconds, counted = seconds + s, counted + n
            div = check_divergence(target, example.id, ids, expected, tokens, tie_ulps, noise)
            if div is not None:
                divergences.append(div)
        alpha = stats.alpha
        t_d = stats.draft_s / stats.drafted if stats.drafted else 0.0
        predicted = router.predicted_speedup([k] * max(stats.num_rounds, 1), alpha, t_ar, t_d,
                                             lambda n: curve[n] / curve[1])
        rate = counted / seconds
        result["by_k"][k] = {
            "alpha": alpha, "mean_accepted_length": stats.mean_accepted_length,
            "per_position_acceptance": stats.per_position_acceptance, "draft_ms_per_token": t_d * 1e3,
            "tokens_per_s": rate, "measured_speedup": rate / result["plain_tokens_per_s"],
            "predicted_speedup": predicted, "identical_to_plain": not divergences,
            "divergences": divergences,
            "lossless": all(d["verdict"] == "tie" for d in divergences),  # identical, or bf16 ties only
        }
        if progress:
            progress(f"k={k}: MAL {stats.mean_accepted_length:.2f}, α {alpha:.3f}, "
                     f"x{result['by_k'][k]['measured_speedup']:.2f} measured, x{predicted:.2f} predicted; "
                     f"{len(divergences)} divergences ({sum(d['verdict'] != 'tie' for d in divergences)} real)")
    return result


def _prefill(target: models.LoadedModel, ids: list[int]) -> Any:
    cache = models.new_cache(target.model)
    models.forward(target.model, ids[:-1], cache, num_logits=1)
    return cache


def _decode_timed(engine: SpecEngine, ids: list[int], cache: Any, params: SamplingParams,
                  stats: SpecStats | None = None) -> tuple[list[int], float, int]:
    """(tokens, decode seconds, tokens): a generation from a copy of the prompt's prefilled cache."""
    own = models.copy_cache_prefix(engine.model, cache, len(ids) - 1)
    t0 = time.perf_counter()
    out = engine.generate(ids, params, stats=stats if stats is not None else SpecStats(), prefilled=(own, len(ids) - 1))
    return out.tokens, time.perf_counter() - t0, len(out.tokens)
