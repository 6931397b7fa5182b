"""The drafter protocol: ``propose(ctx, k) -> DraftProposal``.

A drafter sees one :class:`DraftContext` (which can grow new fields without changing call sites) and
returns a chain or a tree of draft tokens. Drafters are chosen by name from :data:`DRAFTERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentspec.types import DraftProposal, SamplingParams

# a model drafter's first feed this long is a prefill; shorter ones (a recovered token, a rejected branch) draft
CATCHUP_MIN = 16


@dataclass
class DraftContext:
    """Everything a drafter may look at for one round.

    ``tokens`` are all committed tokens (prompt + generated so far); the drafter proposes what follows.
    ``history`` holds earlier token sequences of the same conversation/agent (copy sources).
    ``tools``/``tool_choice``/``response_format`` are the request's, for grammar drafting;
    ``index_key`` names the cross-conversation copy index to use (the API key, server-side).
    ``constraint`` (an :class:`agentspec.constraint.Constraint`) is set when the answer is grammar-constrained:
    a sampling drafter masks its law with it, and :func:`propose_round` prunes what it forbids.
    ``stop``: a draft made ahead (while the round before is in flight) ends once ``stop()`` turns true, its
    round's reply being in: a model drafter then drafts no further token after its first, so drafting that
    was to be hidden never delays the next request by more than the step under way.
    """

    tokens: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: Any = None  # torch.Generator for sampled drafts; None for greedy
    history: list[list[int]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    index_key: str = ""
    constraint: Any = None
    stop: Callable[[], bool] | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the target to verify."""

    name: str

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        """Propose up to ``k`` draft tokens along any root-to-leaf path (a tree may hold more nodes)."""
        ...

    def reset(self) -> None:
        """Forget per-sequence state (e.g. the drafter's KV cache)."""
        ...


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register_drafter(name: str) -> Callable[[Callable[..., Drafter]], Callable[..., Drafter]]:
    """Class decorator adding a drafter factory to :data:`DRAFTERS`."""

    def deco(factory: Callable[..., Drafter]) -> Callable[..., Drafter]:
        DRAFTERS[name] = factory
        return factory

    return deco


class TokenTrie:
    """Token sequences merged into a tree: nodes in topological (insertion) order with parent indices."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    def new_nodes(self, seq: list[int]) -> int:
        """How many nodes adding ``seq`` would create."""
        parent, i = -1, 0
        while i < len(seq) and (parent, seq[i]) in self._children:
            parent = self._children[(parent, seq[i])]
            i += 1
        return len(seq) - i

    def add_chain(self, seq: list[int]) -> None:
        parent = -1
        for tok in seq:
            node = self._children.get((parent, tok))
            if node is None:
                node = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(parent)
                self._children[(parent, tok)] = node
            parent = node

    def is_branching(self) -> bool:
        return any(p != i - 1 for i, p in enumerate(self.parents))


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    if len(a) <= len(b) and a == b[: len(a)]:
        return len(a)  # the usual case each round (the context grew): one C-level comparison
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def catchup_tokens(drafter: Drafter | None, tokens: list[int]) -> int:
    """Tokens ``drafter`` would prefill before drafting after ``tokens`` (a model drafter's cache behind the
    committed tokens); 0 for drafters with nothing to catch up on."""
    behind = getattr(drafter, "catchup_tokens", None)
    return behind(tokens) if behind is not None else 0


def catch_up(drafter: Drafter | None, tokens: list[int], next_from: int | None = None) -> None:
    """Let ``drafter`` prefill over ``tokens`` now, off the critical path (drafters without a cache: nothing);
    ``next_from``: and note its greedy next token after each position from there on (:func:`known_next`)."""
    prefill = getattr(drafter, "catch_up", None)
    if prefill is not None and next_from is None:
        prefill(tokens)
    elif prefill is not None:
        prefill(tokens, next_from)


def known_next(drafter: Drafter | None, tokens: list[int]) -> list[int]:
    """A model drafter's greedy next token after each position of ``tokens`` it has seen (-1: not computed;
    see :meth:`~agentspec.drafters.model.ModelDrafter.known_next`); [] for drafters without one."""
    known = getattr(drafter, "known_next", None)
    return known(tokens) if known is not None else []


def take_catchup(drafter: Drafter | None) -> tuple[int, float]:
    """The catch-up prefills (tokens, seconds) ``drafter`` made since the last call; (0, 0.0) for none."""
    take = getattr(drafter, "take_catchup", None)
    return take() if take is not None else (0, 0.0)


def propose_round(drafter: Drafter | None, ctx: DraftContext, k: int) -> DraftProposal:
    """One round's draft: ``k`` free draft tokens (the γ policy's choice) — plus, from drafters that know
    them (``drafts_forced``), the grammar-forced tokens, which are drafted even when ``k`` is 0.
    ``k < 0`` means no draft at all (speculation off for this round)."""
    if drafter is None or k < 0 or (k == 0 and not getattr(drafter, "drafts_forced", False)):
        return DraftProposal()
    if ctx.constraint is None:
        return drafter.propose(ctx, max(k, 0))
    ctx.constraint.sync(ctx.tokens, ctx.num_prompt_tokens)
    proposal = drafter.propose(ctx, max(k, 0))
    if len(proposal):  # a draft the grammar forbids is never verified
        ctx.constraint.sync(ctx.tokens, ctx.num_prompt_tokens)
        proposal = ctx.constraint.prune(proposal)
    return proposal


def remember_output(drafter: Drafter | None, ctx: DraftContext) -> None:
    """Hand a finished generation to drafters that index past outputs (cross-conversation copying)."""
    remember = getattr(drafter, "remember", None)
    if remember is not None:
        remember(ctx)
