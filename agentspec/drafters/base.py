"""The drafter protocol: ``propose(ctx, k) -> DraftProposal``.

A drafter sees one :class:`DraftContext` (which can grow new fields without changing call sites) and
returns a chain or a tree of draft tokens. Drafters are chosen by name from :data:`DRAFTERS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentspec.types import DraftProposal, SamplingParams


@dataclass
class DraftContext:
    """Everything a drafter may look at for one round.

    ``tokens`` are all committed tokens (prompt + generated so far); the drafter proposes what follows.
    ``history`` holds earlier token sequences of the same conversation/agent (copy sources).
    """

    tokens: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: Any = None  # torch.Generator for sampled drafts; None for greedy
    history: list[list[int]] = field(default_factory=list)


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


def make_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build a registered drafter by name (``ngram``, ``model``, ...)."""
    import agentspec.drafters.model  # noqa: F401  (registers the built-in drafters)
    import agentspec.drafters.ngram  # noqa: F401

    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; registered: {sorted(DRAFTERS)}") from None
    return factory(**kwargs)
