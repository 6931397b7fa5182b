"""In-process speculative generation: target + drafter + both KV caches, greedy and sampled.

One sequence in the caller's process, over the round step the verifier runs too
(:mod:`agentspec.round_step`): draft (:class:`DraftContext`) → one target pass over the uncached committed
tokens and the draft → commit (stop token, ``max_new_tokens``) → a stop string in the decoded output ends
generation too. With no drafter (or ``num_draft_tokens=0``) every round is a plain decoding step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec import models
from agentspec.constraint import Constraint, wants_constraint
from agentspec.drafters.base import DraftContext, Drafter, propose_round, remember_output, take_catchup
from agentspec.round_step import commit_round, forward_round, observe_round
from agentspec.router import DraftLengthPolicy
from agentspec.text import stop_string_cut
from agentspec.types import RoundStats, SamplingParams, SpecStats


@dataclass
class RoundEvent:
    """Tokens committed by one round (already truncated at a stop), and whether generation ended."""

    tokens: list[int]
    stats: RoundStats
    finish_reason: str | None = None  # "stop" | "length" | None while running


@dataclass
class GenerationResult:
    """A finished generation: generated token ids (prompt excluded; a final stop token included), why it
    ended, its statistics, and ``text``: the tokens' text without the stop token."""

    tokens: list[int]
    finish_reason: str
    stats: SpecStats
    num_prompt_tokens: int
    text: str | None = None


@dataclass
class _Sequence:
    tokens: list[int]  # committed: prompt + generated
    num_prompt_tokens: int
    cache: Any
    stop_token_ids: frozenset[int]
    num_cached: int = 0  # target KV positions, always a prefix of tokens
    stats: SpecStats = field(default_factory=SpecStats)
    constraint: Constraint | None = None  # the grammar a constrained answer is decoded under

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


class SpecEngine:
    """Speculative generation against one target model, lossless by construction."""

    def __init__(
        self,
        target: models.LoadedModel,
        drafter: Drafter | None = None,
        num_draft_tokens: int = 4,
        stop_token_ids: Sequence[int] | None = None,
        draft_policy: DraftLengthPolicy | None = None,
    ) -> None:
        """``num_draft_tokens`` is the most drafted per round; with a ``draft_policy`` the policy picks
        γ ≤ that each round from measured acceptance and verify costs (see :meth:`calibrate`), otherwise
        every round drafts the full amount."""
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        self.target = target
        self.model = target.model
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.draft_policy = draft_policy
        self.stop_token_ids = frozenset(target.eos_token_ids if stop_token_ids is None else stop_token_ids)

    def calibrate(self, prompt_ids: Sequence[int], reps: int = 3, **policy_kwargs: Any) -> dict[int, float]:
        """Measure the verify-cost curve t_v(γ) on ``prompt_ids`` and install an adaptive draft policy.

        Returns the curve, keyed by tokens per pass (γ + 1). The policy keeps refining it online.
        """
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        curve = models.measure_verify_cost(self.model, prompt_ids, self.num_draft_tokens + 1, reps)
        self.draft_policy = DraftLengthPolicy.from_calibration(curve, **policy_kwargs)
        return curve

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None,
                 stats: SpecStats | None = None, **kwargs: Any) -> GenerationResult:
        """Run :meth:`stream` to the end and collect its tokens (``stats``: add this run's rounds there)."""
        params = params or SamplingParams()
        tokens: list[int] = []
        stats = stats if stats is not None else SpecStats()
        finish = "length"
        for event in self.stream(prompt_ids, params, stats=stats, **kwargs):
            tokens.extend(event.tokens)
            finish = event.finish_reason or finish
        shown = tokens[:-1] if finish == "stop" and tokens and tokens[-1] in self.stop_token_ids else tokens
        text = self.target.tokenizer.decode(shown) if self.target.tokenizer is not None else None
        return GenerationResult(tokens, finish, stats, len(prompt_ids), text)

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        num_draft_tokens: int | None = None,
        history: Sequence[Sequence[int]] = (),
        stats: SpecStats | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        response_format: dict[str, Any] | None = None,
        prefilled: tuple[Any, int] | None = None,
    ) -> Iterator[RoundEvent]:
        """Yield the tokens each round commits; the last event carries the finish reason.

        ``tools``/``tool_choice``/``response_format`` let grammar drafting shape the drafts; a required or
        named ``tool_choice`` or a JSON ``response_format`` also *constrains* the answer: every token is the
        target's under the grammar's mask (greedy: identical to masked plain greedy); ``history`` holds earlier sequences of the conversation to copy from.
        ``prefilled = (cache, n)``: a target cache already holding the first ``n < len(prompt_ids)`` prompt
        tokens (taken over by this generation), e.g. to share one prefill between runs."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        gamma_max = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if gamma_max < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {gamma_max}")
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = _Sequence(list(prompt_ids), len(prompt_ids), models.new_cache(self.model), self.stop_token_ids,
                        stats=stats or SpecStats())
        if prefilled is not None:
            seq.cache, seq.num_cached = prefilled
            if not 0 <= seq.num_cached < len(prompt_ids) or models.cache_length(seq.cache) != seq.num_cached:
                raise ValueError(f"prefilled cache must hold {seq.num_cached} < {len(prompt_ids)} prompt tokens")
        if wants_constraint(tools, tool_choice, response_format):
            if self.target.tokenizer is None:
                raise ValueError("a constrained answer (tool_choice / response_format) needs the target's tokenizer")
            seq.constraint = Constraint(self.target.tokenizer, tools, tool_choice, response_format,
                                        self.stop_token_ids)
        if self.drafter is not None:
            self.drafter.reset()
        ctx = DraftContext(seq.tokens, seq.num_prompt_tokens, params, generator, [list(h) for h in history],
                           tools, tool_choice, response_format, constraint=seq.constraint)
        try:
            yield from self._rounds(seq, ctx, params, generator, gamma_max)
        finally:
            remember_output(self.drafter, ctx)

    def _rounds(self, seq: _Sequence, ctx: DraftContext, params: SamplingParams,
                generator: torch.Generator | None, gamma_max: int) -> Iterator[RoundEvent]:
        while True:
            remaining = params.max_new_tokens - len(seq.generated)
            gamma = min(gamma_max, remaining - 1) if self.drafter is not None else 0
            policy = self.draft_policy if gamma > 0 else None
            if policy is not None:
                gamma = policy.choose(gamma)
            elif gamma <= 0:
                gamma = -1  # speculation off (or one token left): not even grammar-forced drafts
            decode_pass = seq.num_cached == len(seq.tokens) - 1  # not the prompt's prefill
            t0 = time.perf_counter()
            proposal = propose_round(self.drafter, ctx, gamma)  # 1. draft
            t1 = time.perf_counter()
            catchup_s = take_catchup(self.drafter)[1]  # a model drafter's prefill: not a cost per drafted token
            logits, num_pending = forward_round(self.model, seq, proposal)  # 2. one target pass
            before = len(seq.generated)
            out = commit_round(seq, proposal, logits, num_pending, params, generator,  # 3. verify, commit
                               cap=seq.num_prompt_tokens + params.max_new_tokens)
            t2 = time.perf_counter()
            new, finish = out.tokens, out.finish_reason
            cut = None
            if params.stop and finish != "stop":  # 4. a stop string in the decoded output
                cut = stop_string_cut(self.target.tokenizer.decode, seq.generated, params.stop, before)
            if cut is not None:
                del seq.tokens[seq.num_prompt_tokens + cut :]
                new, finish = new[: cut - before], "stop"
            round_stats = RoundStats(drafted=len(proposal), accepted=out.num_accepted, emitted=len(new),
                                     draft_s=t1 - t0, verify_s=t2 - t1,
                                     tree_nodes=len(proposal) if proposal.is_tree else 0, source=proposal.source)
            if policy is not None:
                observe_round(policy, proposal, out, round_stats.verify_s if decode_pass else None,
                              max(round_stats.draft_s - catchup_s, 0.0))
            seq.stats.add(round_stats, out.path_depth)
            yield RoundEvent(new, round_stats, finish)
            if finish:
                return
