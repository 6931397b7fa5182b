"""TreeDrafter: grammar-forced spans, copy candidates and model branches merged into one token tree.

The forced tokens come first (every path shares them); copy candidates and the model's chain continue
the extended context, each cut to what the grammar allows, merged into a trie and verified in one pass.
A long copy match leads the chain, unless the model drafter read it (:meth:`ModelDrafter.propose`'s lead):
the model then drafts its own chain for one pass over the copy's tokens it agrees with, and leads.
Extra branches are added only while the measured verify-cost curve stays flat
(:meth:`TreeDrafter.set_verify_costs`); where t_v(k) grows with k the tree stays a chain.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from agentspec.drafters.base import (
    DraftContext,
    Drafter,
    TokenTrie,
    catch_up,
    catchup_tokens,
    known_next,
    register_drafter,
    take_catchup,
)
from agentspec.drafters.copy import CopyDrafter
from agentspec.drafters.gate import Drafted, ModelGate
from agentspec.drafters.grammar import GrammarDrafter
from agentspec.types import DraftProposal

STRONG_COPY = 2  # copy matches at least this long are tried before the model's chain (or read by it)


@register_drafter("tree")
class TreeDrafter:
    """Merge grammar, copy and model drafts (any of them may be None) into one token tree."""

    name = "tree"
    drafts_forced = True
    merges_sources = True  # already a tool drafter: never wrapped in another

    def __init__(self, grammar: GrammarDrafter | None = None, copy: CopyDrafter | None = None,
                 model: Drafter | None = None, node_budget: int = 0, max_forced: int = 16,
                 gate: ModelGate | None = None) -> None:
        """``node_budget``: most nodes per round beyond the forced span and the first candidate
        (0: a single chain); ``max_forced``: most grammar-forced tokens drafted in one round; ``gate``:
        leave the model out of greedy rounds while it costs more than it adds (:class:`ModelGate`)."""
        if node_budget < 0 or max_forced < 0:
            raise ValueError("node_budget and max_forced must be >= 0")
        self.grammar, self.copy, self.model = grammar, copy, model
        self.node_budget, self.max_forced, self.gate = node_budget, max_forced, gate
        self._drafted: Drafted | None = None  # the last greedy round, for the gate to judge
        self.last_model_s = 0.0  # the model's drafting seconds in the last round (0: it sat the round out)

    def reset(self) -> None:
        self._drafted = None
        for d in (self.grammar, self.copy, self.model):
            if d is not None:
                d.reset()

    def remember(self, ctx: DraftContext) -> None:
        if self.copy is not None:
            self.copy.remember(ctx)

    def catchup_tokens(self, tokens: list[int]) -> int:
        """The model drafter's catch-up before its next draft (:func:`~agentspec.drafters.base.catchup_tokens`)."""
        return catchup_tokens(self.model, tokens)

    def catch_up(self, tokens: list[int], next_from: int | None = None) -> None:
        """The model drafter's prefill over ``tokens``, off the critical path (``next_from``: see
        :func:`~agentspec.drafters.base.catch_up`)."""
        catch_up(self.model, tokens, next_from)

    def known_next(self, tokens: list[int]) -> list[int]:
        """The model drafter's greedy next tokens over ``tokens`` (:func:`~agentspec.drafters.base.known_next`)."""
        return known_next(self.model, tokens)

    def take_catchup(self) -> tuple[int, float]:
        """The model drafter's catch-up prefills since the last call (tokens, seconds)."""
        return take_catchup(self.model)

    def prepare(self, ctx: DraftContext) -> None:
        """The grammar's set-up for ``ctx`` (:meth:`GrammarDrafter.prepare`), ahead of a timed proposal."""
        if self.grammar is not None:
            self.grammar.prepare(ctx)

    def set_verify_costs(self, seconds_by_pass_len: Mapping[int, float], flat: float = 1.15,
                         most: int = 32) -> int:
        """Set the node budget to the most tokens a pass can carry for at most ``flat`` times the cost of
        one token (a measured t_v curve keyed by tokens per pass); returns the budget."""
        base = seconds_by_pass_len.get(1)
        if not base:
            raise ValueError("the verify-cost curve needs an entry for 1 token per pass")
        flat_len = max((n for n, s in seconds_by_pass_len.items() if s <= flat * base), default=1)
        self.node_budget = min(max(flat_len - 1, 0), most)
        return self.node_budget

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        gate = self.gate if self.model is not None else None
        started = gate.clock() if gate is not None else 0.0
        forced = self.grammar.forced(ctx)[: self.max_forced] if self.grammar is not None else []
        last, self._drafted = self._drafted, None
        if not ctx.sampling.greedy:
            return self._sampled(ctx, forced, k)
        use_model = self.model is not None and (gate is None or gate.use_model(ctx.tokens, last))
        trie = TokenTrie()
        trie.add_chain(forced)
        drafted: dict[bool, list[list[int]]] = {False: [list(forced)], True: []}  # by "from the model"
        model_s = 0.0
        if k > 0:
            extended = ctx.tokens + forced
            # a model's sibling leaves (tree_width > 1: its next picks, drafted at no extra pass) ride on top
            leaves = k * (getattr(self.model, "tree_width", 1) - 1) if use_model else 0
            budget = len(forced) + k + self.node_budget + leaves
            candidates, model_s = self._candidates(ctx, extended, k, use_model)
            paths = []
            for from_model, cand in candidates:
                if self.grammar is not None and forced:
                    cand = cand[: self.grammar.valid_prefix(forced + cand) - len(forced)]
                elif self.grammar is not None:
                    cand = cand[: self.grammar.valid_prefix(cand)]
                if cand:
                    paths.append((from_model, forced + cand))
            for i, (from_model, path) in enumerate(paths):
                if i and len(trie.tokens) + trie.new_nodes(path) > budget:
                    break
                trie.add_chain(path)
                drafted[from_model].append(path)
            # the gate weighs the model against the round without it, which the first copy would have led
            copy = next((p for from_model, p in paths if not from_model), None)
            if copy is not None and copy not in drafted[False]:
                drafted[False].append(copy)
        self.last_model_s = model_s
        if gate is not None:
            self._drafted = gate.drafted(ctx.tokens, drafted[False], drafted[True], model_s, started)
        if not len(trie.tokens):
            return DraftProposal(source=self.name)
        parents = tuple(trie.parents) if trie.is_branching() else None
        return DraftProposal(tokens=tuple(trie.tokens), parents=parents, source=self._source(forced),
                             num_forced=len(forced))

    def _sampled(self, ctx: DraftContext, forced: list[int], k: int) -> DraftProposal:
        """Sampled rounds: the forced span, then ONE source, never merged or grammar-cut where it was
        sampled — a sampled token's q must be the law it was really drawn from, and keeping or cutting a
        sampled token by its own value would change that law. Copy drafts are deterministic given the
        context, so cutting them to the grammar is safe."""
        tokens, parents, probs = list(forced), list(range(-1, len(forced) - 1)), [None] * len(forced)
        extended = ctx.tokens + forced
        if k > 0 and self.model is not None:
            sub = dataclasses.replace(ctx, tokens=extended)
            prop = self.model.propose(sub, k)
            base = len(tokens)
            tokens += prop.tokens
            parents += [p + base if p >= 0 else base - 1 for p in prop.parent_list()]
            probs += list(prop.draft_probs) if prop.draft_probs is not None else [None] * len(prop)
        elif k > 0 and self.copy is not None:
            found = self.copy.candidates(ctx, k, tokens=extended)
            if found:
                cand = found[0][1]
                if self.grammar is not None:
                    cand = cand[: self.grammar.valid_prefix(forced + cand) - len(forced)]
                tokens += cand
                parents += list(range(len(parents) - 1, len(parents) - 1 + len(cand)))
                probs += [None] * len(cand)
        if not tokens:
            return DraftProposal(source=self.name)
        tree = any(p != i - 1 for i, p in enumerate(parents))
        return DraftProposal(tokens=tuple(tokens), parents=tuple(parents) if tree else None,
                             draft_probs=tuple(probs) if any(q is not None for q in probs) else None,
                             source=self._source(forced), num_forced=len(forced))

    def _candidates(self, ctx: DraftContext, extended: list[int], k: int,
                    use_model: bool) -> tuple[list[tuple[bool, list[int]]], float]:
        """(from the model?, candidate) in the order they are tried, and the model's drafting seconds."""
        copies = self.copy.candidates(ctx, k, tokens=extended) if self.copy is not None else []
        strong = [(False, c) for n, c in copies if n >= STRONG_COPY]
        # a 1-token match is a guess (α ~0.4-0.6 measured): worth verifying only where extra tokens
        # cost nothing, i.e. inside the flat part of the verify-cost curve
        weak = [(False, c) for n, c in copies if n < STRONG_COPY] if self.node_budget > 0 else []
        model: list[tuple[bool, list[int]]] = []
        model_s = 0.0
        if use_model and self.model is not None:
            sub = dataclasses.replace(ctx, tokens=extended)
            clock = self.gate.clock if self.gate is not None else time.perf_counter
            t0 = clock()
            # a model that reads the strongest copy in one pass (ModelDrafter's lead) drafts its own chain for
            # less, having seen where the copy parts from its picks: its chain then comes first
            reads = getattr(self.model, "reads_lead", None)
            lead = strong[0][1] if strong and reads is not None and reads(sub) else None
            proposal = self.model.propose(sub, k) if lead is None else self.model.propose(sub, k, lead=lead)
            model = [(True, p) for p in _paths(proposal)]
            model_s = clock() - t0
            if lead is not None and model:
                return model + strong + weak, model_s
        return strong + model + weak, model_s

    def _source(self, forced: list[int]) -> str:
        parts = (["grammar"] if forced else []) + [d.name for d in (self.copy, self.model) if d is not None]
        return "+".join(parts) or self.name


def _paths(proposal: DraftProposal) -> list[list[int]]:
    """Root-to-leaf token paths of a proposal, its main path first (:meth:`DraftProposal.spine`), then the
    longest first (greedy drafts are deterministic)."""
    if not proposal.tokens:
        return []
    if not proposal.is_tree:
        return [list(proposal.tokens)]
    parents = proposal.parent_list()
    children = {p for p in parents if p >= 0}
    out = []
    for leaf in range(len(parents)):
        if leaf in children:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(proposal.tokens[node])
            node = parents[node]
        out.append(path[::-1])
    spine = [proposal.tokens[i] for i in proposal.spine()]
    out.sort(key=lambda path: (path != spine, -len(path)))
    return out


@register_drafter("default")
def default_drafter(tokenizer: Any, model: Drafter | None = None, index: Any = None,
                    verify_costs: Mapping[int, float] | None = None, gate: ModelGate | None = None) -> TreeDrafter:
    """agentspec's default drafting: grammar (when a tokenizer is known) + copy (+ a model drafter);
    ``gate``: leave the model out while it costs more than it adds (:class:`ModelGate`, may be shared)."""
    grammar = GrammarDrafter(tokenizer) if tokenizer is not None else None
    tree = TreeDrafter(grammar=grammar, copy=CopyDrafter(index=index, max_candidates=3), model=model, gate=gate)
    if verify_costs:
        tree.set_verify_costs(verify_costs)
    return tree
