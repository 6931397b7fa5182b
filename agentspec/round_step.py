"""One verification round, the step both loops share: pass inputs, the target's logits → committed tokens.

The in-process loop (:class:`agentspec.local.SpecEngine`) and the verifier (its scheduler batches
sessions) both run: :func:`round_inputs` (uncached committed tokens + draft nodes, a tree mask where needed)
→ one target pass → :func:`commit_round` (:mod:`agentspec.verify` accepts a path and appends the target's
own token; the KV cache keeps the committed prefix plus that path; the tokens are cut at a stop token or
the cap). A sequence is anything with ``tokens``, ``num_cached``, ``cache`` and ``stop_token_ids``; one
with a ``constraint`` (:class:`agentspec.constraint.Constraint`) is verified under its grammar mask, and
takes the tokens the grammar alone decides without a pass (jump-forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from agentspec import models
from agentspec.types import DraftProposal, SamplingParams, VerifyResult
from agentspec.verify import (
    path_depth,
    process_logits,
    sampling_probs,
    token_logprobs,
    tree_attention,
    verify_greedy,
    verify_sampled,
)


class Sequence(Protocol):
    tokens: list[int]  # committed: prompt + generated
    num_prompt_tokens: int  # tokens[num_prompt_tokens:] were generated (what penalties count)
    num_cached: int  # target KV positions, always a prefix of tokens
    cache: Any
    stop_token_ids: frozenset[int]


@dataclass(frozen=True)
class RoundInputs:
    """What one sequence feeds the round's target pass."""

    ids: list[int]  # uncached committed tokens + draft nodes
    num_pending: int  # how many of ``ids`` are committed tokens (the rest are draft nodes)
    mask: torch.Tensor | None  # [1, 1, q, kv] additive, or None for a causal chain
    positions: torch.Tensor | None  # [1, q]


@dataclass(frozen=True)
class RoundOutcome:
    """What a round committed: ``tokens`` = accepted draft tokens + the recovered/bonus token, already cut
    at a stop token or the cap (``finish_reason`` says which), and how far the draft reached."""

    tokens: list[int]
    num_accepted: int  # draft tokens the target accepted (before any cut)
    finish_reason: str | None  # "stop" | "length" | None
    path_depth: int  # depth of the draft along the path the target took
    result: VerifyResult
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # per token, when params ask


def round_inputs(seq: Sequence, proposal: DraftProposal, model: Any, batched: bool = False) -> RoundInputs:
    """The pass inputs of one sequence's round; the mask is built only where it is needed."""
    pending = seq.tokens[seq.num_cached :]
    mask = positions = None
    if proposal.is_tree or batched:
        mask, positions = tree_attention(proposal.parent_list(), seq.num_cached, len(pending), model.dtype,
                                         model.device)
    return RoundInputs(pending + list(proposal.tokens), len(pending), mask, positions)


def forward_round(model: Any, seq: Sequence, proposal: DraftProposal) -> tuple[torch.Tensor, int]:
    """One unbatched target pass for a round: the logit rows of the last committed token and every draft
    node (``[len(proposal) + 1, vocab]``) and the number of pending committed tokens it cached."""
    inputs = round_inputs(seq, proposal, model)
    logits = models.forward(model, inputs.ids, seq.cache, len(proposal) + 1, inputs.mask, inputs.positions)
    return logits, inputs.num_pending


def commit_round(seq: Sequence, proposal: DraftProposal, logits: torch.Tensor, num_pending: int,
                 params: SamplingParams, generator: torch.Generator | None, cap: int) -> RoundOutcome:
    """Verify ``proposal`` against ``logits`` (``[len(proposal) + 1, vocab]``: the last committed token's row,
    then one per draft node) and commit the result to ``seq``; ``cap`` is the most tokens ``seq.tokens`` may
    hold. A draft token past a stop token or the cap is never committed, and its KV position is dropped."""
    parents = proposal.parent_list()
    raw = logits
    logits = process_logits(logits, params, seq.tokens[seq.num_prompt_tokens :], proposal.tokens, parents)
    constraint = getattr(seq, "constraint", None)
    if constraint is not None:
        constraint.sync(seq.tokens, seq.num_prompt_tokens)
        logits = constraint.apply(logits, proposal.tokens, parents)
    if params.greedy:
        result = verify_greedy(logits, proposal.tokens, parents, seq.stop_token_ids)
    else:
        target_probs = sampling_probs(logits, params)  # [n + 1, vocab]
        result = verify_sampled(target_probs, proposal.tokens, proposal.draft_probs, parents, generator,
                                seq.stop_token_ids)
    prefix = seq.num_cached + num_pending
    models.keep_cache_positions(seq.cache, prefix, [prefix + i for i in result.accepted_nodes])
    seq.num_cached = prefix + result.num_accepted
    new, finish = list(result.output_tokens), None
    for i, tok in enumerate(new):
        if tok in seq.stop_token_ids:
            new, finish = new[: i + 1], "stop"
            break
    if len(seq.tokens) + len(new) >= cap and (finish is None or len(seq.tokens) + len(new) > cap):
        new, finish = new[: max(cap - len(seq.tokens), 0)], "length"
    seq.tokens.extend(new)
    if seq.num_cached > len(seq.tokens) - 1:  # accepted tokens cut by a stop/cap: the last one stays pending
        models.crop_cache(seq.cache, len(seq.tokens) - 1)
        seq.num_cached = len(seq.tokens) - 1
    logprobs = None
    if params.logprobs is not None:  # output token j was chosen at the row after the path's (j - 1)th node
        rows = [0, *(a + 1 for a in result.accepted_nodes)][: len(new)]
        logprobs = token_logprobs(raw, rows, new, params.logprobs)
    elif constraint is not None and constraint.jump_forward and finish is None:
        # where the grammar allows one token only, masked plain decoding takes it whatever the target says:
        # commit it now (its KV comes with the next pass) rather than spend a verified position on it
        constraint.sync(seq.tokens, seq.num_prompt_tokens)
        forced = constraint.take_forced(seq.tokens, seq.num_prompt_tokens, cap - len(seq.tokens))
        new = [*new, *forced]
        if forced and len(seq.tokens) >= cap:
            finish = "length"
    return RoundOutcome(new, result.num_accepted, finish, path_depth(parents, result), result, logprobs)


def observe_round(policy: Any, proposal: DraftProposal, outcome: RoundOutcome, verify_s: float | None,
                  draft_s: float) -> None:
    """Feed a round to a draft-length policy (:class:`agentspec.router.DraftLengthPolicy`): only the free
    draft tokens count towards acceptance (:meth:`DraftProposal.free_acceptance`);
    ``verify_s`` is None when the pass's time does not measure this round alone (a prefill, a batch)."""
    free, reached, accepted = proposal.free_acceptance(outcome.path_depth, outcome.num_accepted)
    policy.observe(free, reached, accepted, verify_s, draft_s, pass_tokens=len(proposal))
