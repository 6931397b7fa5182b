"""In-process speculative generation: target + drafter + both KV caches, greedy and sampled.

This is the loop the verifier server's co-located mode runs. One round:

1. the drafter proposes a chain or tree from the committed tokens (:class:`DraftContext`);
2. the target runs ONE forward pass over the committed tokens it has not cached yet (the previous
   round's recovered/bonus token; the whole prompt in round one) followed by the draft nodes;
3. :mod:`agentspec.verify` accepts a path and appends the target's own next token;
4. the target cache keeps only the committed prefix plus the accepted path ("lengths are the truth");
5. stop on a stop token, ``max_new_tokens`` or a stop string.

With no drafter (or ``num_draft_tokens=0``) every round is a plain decoding step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec import models
from agentspec.drafters.base import DraftContext, Drafter, observed_acceptance, propose_round, remember_output
from agentspec.router import DraftLengthPolicy
from agentspec.types import DraftProposal, RoundStats, SamplingParams, SpecStats, VerifyResult
from agentspec.verify import path_depth, sampling_probs, tree_attention, verify_greedy, verify_sampled


@dataclass
class RoundEvent:
    """Tokens committed by one round (already truncated at a stop), and whether generation ended."""

    tokens: list[int]
    stats: RoundStats
    finish_reason: str | None = None  # "stop" | "length" | None while running


@dataclass
class GenerationResult:
    """A finished generation: generated token ids (prompt excluded), why it ended, and its statistics."""

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
    num_cached: int = 0  # target KV positions, always a prefix of tokens
    stats: SpecStats = field(default_factory=SpecStats)

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
        text = self.target.tokenizer.decode(tokens) if self.target.tokenizer is not None else None
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

        ``tools``/``tool_choice``/``response_format`` let grammar drafting shape the drafts (the target
        still decides every token); ``history`` holds earlier sequences of the conversation to copy from.
        ``prefilled = (cache, n)``: a target cache already holding the first ``n < len(prompt_ids)`` prompt
        tokens (taken over by this generation), e.g. to share one prefill between runs."""
        params = params or SamplingParams()
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        k_max = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if k_max < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {k_max}")
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        seq = _Sequence(list(prompt_ids), len(prompt_ids), models.new_cache(self.model), stats=stats or SpecStats())
        if prefilled is not None:
            seq.cache, seq.num_cached = prefilled
            if not 0 <= seq.num_cached < len(prompt_ids) or models.cache_length(seq.cache) != seq.num_cached:
                raise ValueError(f"prefilled cache must hold {seq.num_cached} < {len(prompt_ids)} prompt tokens")
        if self.drafter is not None:
            self.drafter.reset()
        ctx = DraftContext(seq.tokens, seq.num_prompt_tokens, params, generator, [list(h) for h in history],
                           tools, tool_choice, response_format)
        try:
            yield from self._rounds(seq, ctx, params, generator, k_max)
        finally:
            remember_output(self.drafter, ctx)

    def _rounds(self, seq: _Sequence, ctx: DraftContext, params: SamplingParams,
                generator: torch.Generator | None, k_max: int) -> Iterator[RoundEvent]:
        while True:
            remaining = params.max_new_tokens - len(seq.generated)
            k = min(k_max, remaining - 1) if self.drafter is not None else 0
            policy = self.draft_policy if k > 0 else None
            if policy is not None:
                k = policy.choose(k)
            elif k <= 0:
                k = -1  # speculation off (or one token left): not even grammar-forced drafts
            decode_pass = seq.num_cached == len(seq.tokens) - 1  # not the prompt's prefill
            new, round_stats, path_depth, proposal = self._round(seq, ctx, k, params, generator)
            if policy is not None:
                free, reached, accepted = observed_acceptance(proposal, path_depth, round_stats.accepted)
                policy.observe(free, reached, accepted, round_stats.verify_s if decode_pass else None,
                               round_stats.draft_s, pass_tokens=len(proposal))
            new, finish = self._check_stop(seq, new, params)
            round_stats.emitted = len(new)  # after truncation at a stop: what the caller really gets
            seq.stats.add(round_stats, path_depth)
            yield RoundEvent(new, round_stats, finish)
            if finish:
                return

    # -- one round ----------------------------------------------------------------------------------

    def _round(
        self, seq: _Sequence, ctx: DraftContext, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[list[int], RoundStats, int, DraftProposal]:
        t0 = time.perf_counter()
        # 1. draft
        proposal = propose_round(self.drafter, ctx, k)
        t1 = time.perf_counter()
        # 2. one target pass over uncached committed tokens + draft nodes
        pending = seq.tokens[seq.num_cached :]
        n = len(proposal)
        mask = positions = None
        parents = proposal.parent_list()
        if proposal.is_tree:
            mask, positions = tree_attention(parents, seq.num_cached, len(pending), self.target.dtype, self.model.device)
        logits = models.forward(self.model, pending + list(proposal.tokens), seq.cache, n + 1, mask, positions)
        # 3. accept a path, then the target's own next token
        result = self._verify(logits, proposal, parents, params, generator)
        t2 = time.perf_counter()
        # 4. keep the committed prefix and the accepted path in the target cache
        prefix = seq.num_cached + len(pending)
        models.keep_cache_positions(seq.cache, prefix, [prefix + i for i in result.accepted_nodes])
        seq.num_cached = prefix + result.num_accepted
        new = list(result.output_tokens)
        seq.tokens.extend(new)
        stats = RoundStats(
            drafted=n, accepted=result.num_accepted, emitted=len(new), draft_s=t1 - t0, verify_s=t2 - t1,
            tree_nodes=n if proposal.is_tree else 0, source=proposal.source,
        )
        return new, stats, path_depth(parents, result), proposal

    def _verify(
        self,
        logits: torch.Tensor,
        proposal: DraftProposal,
        parents: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> VerifyResult:
        if params.greedy:
            return verify_greedy(logits, proposal.tokens, parents, self.stop_token_ids)
        target_probs = sampling_probs(logits, params)  # [n + 1, vocab]
        return verify_sampled(target_probs, proposal.tokens, proposal.draft_probs, parents, generator,
                              self.stop_token_ids)

    def _check_stop(self, seq: _Sequence, new: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
        """Truncate a round's tokens at a stop token, the length limit or a stop string."""
        before = len(seq.generated) - len(new)
        for i, tok in enumerate(new):
            if tok in self.stop_token_ids:
                return self._truncate(seq, new, i + 1), "stop"
        if params.stop:
            cut = self._stop_string_cut(seq.generated, params.stop, before)
            if cut is not None:
                return self._truncate(seq, new, cut - before), "stop"
        if len(seq.generated) >= params.max_new_tokens:
            return self._truncate(seq, new, params.max_new_tokens - before), "length"
        return new, None

    def _truncate(self, seq: _Sequence, new: list[int], keep: int) -> list[int]:
        drop = len(new) - keep
        if drop > 0:
            del seq.tokens[-drop:]
        return new[:keep]

    def _stop_string_cut(self, generated: list[int], stops: tuple[str, ...], before: int) -> int | None:
        """Smallest token count (> before) whose decoded text contains a stop string (kept, as HF does)."""
        decode = self.target.tokenizer.decode
        if not any(s in decode(generated) for s in stops):
            return None
        for count in range(before + 1, len(generated) + 1):
            text = decode(generated[:count])
            if any(s in text for s in stops):
                return count
        return None

