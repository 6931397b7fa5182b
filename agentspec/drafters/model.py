"""A small causal LM as drafter: shares the target's tokenizer, keeps its own KV cache.

``propose`` keeps the cache's common prefix with the committed tokens and always feeds at least the last
committed token (the target's recovered/bonus token, never seen by the drafter), then drafts ``k`` tokens.
A first feed of :data:`CATCHUP_MIN` tokens or more is a catch-up (a new prompt, or tokens committed while
another mode ran): a prefill, not a drafting step. It is timed apart (:meth:`ModelDrafter.take_catchup`) so
the router charges it once to switching to edge mode instead of to every drafted token.
Sampled drafts come from the drafter's distribution truncated to ``proposal_top_k``, sent along as ``q``
(lossless sampling needs the exact law). ``tree_width > 1`` adds sibling leaves at no extra passes; a
reduced output vocabulary drafts from that set only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from agentspec import models
from agentspec.drafters.base import CATCHUP_MIN, DraftContext, common_prefix, register_drafter
from agentspec.types import DraftProposal, SparseDist
from agentspec.verify import greedy_ids, sampling_probs


@register_drafter("model")
class ModelDrafter:
    """Draft with a small causal LM (a :class:`~agentspec.models.LoadedModel` or a bare HF model)."""

    name = "model"

    def __init__(self, model: Any, tree_width: int = 1, proposal_top_k: int = 32,
                 confidence_threshold: float = 0.0) -> None:
        """``confidence_threshold``: a greedy draft made on the critical path (not one made ahead, while a
        round is in flight) stops after a chain token the model gives less than this probability: the
        tokens after it are seldom the target's, and each costs a drafting step the round waits for."""
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        if proposal_top_k < 1:
            raise ValueError(f"proposal_top_k must be >= 1, got {proposal_top_k}")
        if not 0.0 <= confidence_threshold < 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1), got {confidence_threshold}")
        self.model = model.model if isinstance(model, models.LoadedModel) else model
        self.tree_width, self.proposal_top_k = tree_width, proposal_top_k
        self.confidence_threshold = confidence_threshold
        # a reduced output vocabulary (models.restrict_output_vocab): head row -> token id
        self._token_map = getattr(self.model, "agentspec_token_map", None)
        self._full_vocab = getattr(self.model, "agentspec_full_vocab", None)
        self.reset()

    def reset(self) -> None:
        self._cache = models.new_cache(self.model, spare=True)  # a token or two appended per pass
        self._cached: list[int] = []  # token ids whose keys/values are in self._cache
        # per cached token, the drafter's greedy next token after it, where a catch-up computed it (else -1):
        # its teacher-forced chain over text another mode committed (known_next)
        self._next: list[int] = []
        self._catchup = (0, 0.0)  # catch-up prefills since the last take_catchup: (tokens, seconds)

    def catchup_tokens(self, tokens: list[int]) -> int:
        """Tokens a proposal after ``tokens`` would prefill first (0 when that is an ordinary drafting step)."""
        feed = len(tokens) - min(common_prefix(self._cached, tokens), len(tokens) - 1)
        return feed if feed >= CATCHUP_MIN else 0

    def reads_lead(self, ctx: DraftContext) -> bool:
        """Whether :meth:`propose` after ``ctx`` reads a ``lead``: greedy, unconstrained chains whose first pass
        is a drafting step (a catch-up's is a prefill, timed apart)."""
        return ctx.sampling.greedy and ctx.constraint is None and not self.catchup_tokens(ctx.tokens)

    def catch_up(self, tokens: list[int], next_from: int | None = None) -> None:
        """Prefill the cache over ``tokens`` but the last (which the next proposal feeds) off the critical
        path, e.g. while a server-side segment streams; not reported as a catch-up. Drafts stay what they
        would have been: the cache holds exactly the keys and values of the tokens it lists (a quantised
        drafter's, up to rounding: how many tokens a pass feeds picks its dense or quantised weights).
        ``next_from``: also note the greedy next token after each position from there on (:meth:`known_next`;
        its logits cost an output-head pass per position, so only over the answer, not a prompt)."""
        common = min(common_prefix(self._cached, tokens), len(tokens) - 1)
        if len(tokens) - 1 - common < CATCHUP_MIN:
            return  # a step's worth: the next proposal feeds it at no extra cost
        self._crop(common)
        feed = tokens[common:-1]
        scored = 0 if next_from is None else min(max(len(tokens) - 1 - next_from, 0), len(feed))
        logits = models.forward(self.model, feed, self._cache, num_logits=max(scored, 1))
        self._cached.extend(feed)
        self._next.extend([-1] * (len(feed) - scored))
        if scored:
            self._next.extend(self._ids(greedy_ids(logits[-scored:])))

    def known_next(self, tokens: list[int]) -> list[int]:
        """Over the prefix of ``tokens`` in the cache: the drafter's greedy next token after each position
        (-1 where no catch-up computed it). Where a stretch of it is known, a greedy chain drafter's rounds
        over that text can be replayed exactly (:func:`~agentspec.drafters.replay.replay_known_next`)."""
        return self._next[: common_prefix(self._cached, tokens)]

    def _crop(self, length: int) -> None:
        models.crop_cache(self._cache, length)
        del self._cached[length:]
        del self._next[length:]

    def take_catchup(self) -> tuple[int, float]:
        """The catch-up prefills (tokens, seconds) made since the last call, and forget them."""
        done, self._catchup = self._catchup, (0, 0.0)
        return done

    def propose(self, ctx: DraftContext, k: int, lead: Sequence[int] = ()) -> DraftProposal:
        """Up to ``k`` draft tokens: the model's chain (with sibling leaves when ``tree_width > 1``).

        ``lead``: a guess at what follows (a copy from the context) for the model to read in its first pass.
        That one pass gives the model's greedy pick after each of the lead's prefixes, so the draft takes
        the lead's tokens while they are the model's own picks, then the model's pick where they part, and
        drafts on from there a token a step: the chain the model drafts alone (up to a pass's rounding: a
        quantised drafter runs passes of many rows on its dense weights), for one pass however many lead
        tokens it keeps. Greedy, unconstrained chains only; ignored on a catch-up (its first pass is a
        prefill, timed apart)."""
        if k <= 0 or not ctx.tokens:
            return DraftProposal(source=self.name)
        lead = list(lead[: k - 1]) if lead and self.reads_lead(ctx) else []  # + the model's pick after it: k
        # 1. reconcile the cache with the committed tokens; always feed at least the last one
        common = common_prefix(self._cached, ctx.tokens)
        common = min(common, len(ctx.tokens) - 1)
        self._crop(common)
        feed = ctx.tokens[common:]
        catchup = len(feed) >= CATCHUP_MIN
        t0 = time.perf_counter()
        # 2. draft k tokens along a chain, adding sibling leaves when tree_width > 1
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[SparseDist | None] = []
        parent = -1
        chain: list[int] = []
        while len(chain) < k:
            if chain and ctx.stop is not None and ctx.stop():
                break  # a draft made ahead whose round's reply is in: what is drafted so far is used
            rows = feed + lead
            logits = models.forward(self.model, rows, self._cache, num_logits=len(lead) + 1)  # [.., head rows]
            self._cached.extend(rows)
            self._next.extend([-1] * len(rows))
            if catchup:  # the first forward: its one drafted token's share is noise next to the prefill
                catchup = False
                models.synchronize(logits.device)
                self._catchup = (self._catchup[0] + len(feed), self._catchup[1] + time.perf_counter() - t0)
            if lead:
                for picked in self._read_lead(logits, lead):  # a chain (each node the child of the one before)
                    node = len(tokens)
                    for tok in picked:  # the chain's token, then its sibling leaves
                        tokens.append(tok)
                        parents.append(parent)
                        probs.append(None)
                    chain.append(picked[0])
                    parent = node
                lead = []
            else:
                masked = None
                if ctx.constraint is not None:  # a constrained answer: draft from the grammar-masked law
                    masked = _masked(self._full_logits(logits[-1]),
                                     ctx.constraint.allowed_after([*ctx.tokens, *chain]))
                    if masked is None:
                        break
                picked, dist = self._pick(logits[-1], ctx, masked)
                node = len(tokens)
                for tok in picked:
                    tokens.append(tok)
                    parents.append(parent)
                    probs.append(dist)
                chain.append(picked[0])
                parent = node
                if self._unsure(logits[-1] if masked is None else masked, ctx):
                    break
            feed = [chain[-1]]
        tree = self.tree_width > 1
        return DraftProposal(
            tokens=tuple(tokens),
            parents=tuple(parents) if tree else None,
            draft_probs=None if ctx.sampling.greedy else tuple(probs),
            source=self.name,
        )

    def _unsure(self, row: torch.Tensor, ctx: DraftContext) -> bool:
        """Whether a greedy chain drafted on the critical path stops after the pick from ``row`` (its logits):
        the model's probability of that pick is under ``confidence_threshold``."""
        if not self.confidence_threshold or ctx.stop is not None or not ctx.sampling.greedy:
            return False
        return float(torch.softmax(row.float(), dim=-1).max()) < self.confidence_threshold

    def _read_lead(self, logits: torch.Tensor, lead: list[int]) -> list[list[int]]:
        """The chain read off one pass over ``lead`` (``logits``: its last ``len(lead) + 1`` rows, the model's
        picks after each lead prefix): the lead's tokens while they are its picks, then its pick where they
        part; each with its sibling leaves (the row's next picks, ``tree_width > 1``). The cache keeps the
        lead's tokens up to the parting, as if the model had drafted them."""
        if self.tree_width == 1:
            top = [[t] for t in self._ids(greedy_ids(logits))]
        else:
            top = [self._ids(row) for row in torch.topk(logits, self.tree_width).indices]
        kept = next((i for i, (p, t) in enumerate(zip(top, lead, strict=False)) if p[0] != t), len(lead))
        self._crop(len(self._cached) - (len(lead) - kept))
        return [*([t, *(x for x in top[i] if x != t)][: self.tree_width] for i, t in enumerate(lead[:kept])),
                top[kept]]

    def _ids(self, rows: torch.Tensor) -> list[int]:
        """Token ids of head rows (a reduced vocabulary's rows map back to their ids)."""
        return (rows if self._token_map is None else self._token_map[rows.to(self._token_map.device)]).tolist()

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: a reduced head's rows scattered to their token ids, the
        rest -inf (never proposed, probability 0 in a sampled draft's q)."""
        if self._token_map is None:
            return logits
        full = logits.new_full((self._full_vocab,), float("-inf"))
        full[self._token_map.to(logits.device)] = logits  # a no-op unless the model moved devices
        return full

    def _pick(self, logits: torch.Tensor, ctx: DraftContext, masked: torch.Tensor | None = None
              ) -> tuple[list[int], SparseDist | None]:
        """The chain token first, then sibling leaves; and the proposal they were drawn from (``masked``:
        the full-vocabulary logits under the grammar's mask, drafted from instead)."""
        if ctx.sampling.greedy and masked is not None:
            return torch.topk(masked, self.tree_width).indices.tolist(), None
        if ctx.sampling.greedy and self.tree_width == 1:  # argmax, as a lead's and a catch-up's picks are
            return self._ids(greedy_ids(logits).unsqueeze(-1)), None
        if ctx.sampling.greedy:
            return self._ids(torch.topk(logits, self.tree_width).indices), None
        logits = self._full_logits(logits) if masked is None else masked  # processors index by token id
        probs = sampling_probs(logits, ctx.sampling)
        top = torch.topk(probs, min(self.proposal_top_k, probs.shape[-1]))
        kept = top.values / top.values.sum()  # the truncated proposal actually sampled from
        draws = torch.multinomial(kept.cpu(), self.tree_width, replacement=True, generator=ctx.generator)
        ids = top.indices.cpu()
        dist = SparseDist(tuple(ids.tolist()), tuple(kept.cpu().tolist()))
        return [int(ids[d]) for d in draws], dist


def _masked(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor | None:
    """Full-vocabulary ``logits`` with what the grammar forbids at -inf (None: the path left the grammar)."""
    if allowed is None:
        return None
    out = logits.float().clone()
    width = min(out.shape[-1], allowed.shape[-1])
    out[:width].masked_fill_(~allowed[:width].to(out.device), float("-inf"))
    out[width:] = float("-inf")
    return out if bool(torch.isfinite(out).any()) else None
