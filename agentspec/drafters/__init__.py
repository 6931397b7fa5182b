"""Drafters: where draft tokens come from. Pick one by name with :func:`make_drafter`."""

from typing import Any

from agentspec.drafters.base import DRAFTERS, DraftContext, Drafter, register_drafter
from agentspec.drafters.ngram import NgramDrafter

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "NgramDrafter", "make_drafter", "register_drafter",
           "ModelDrafter"]


def make_drafter(name: str, **kwargs: Any) -> Drafter:
    """Build a registered drafter by name (``ngram``, ``model``, ``copy``, ``grammar``, ``tree``, ``default``)."""
    import agentspec.drafters.model  # noqa: F401  (registers the drafters that import torch, lazily)
    import agentspec.drafters.tree  # noqa: F401  (and copy, grammar)

    try:
        factory = DRAFTERS[name]
    except KeyError:
        raise ValueError(f"unknown drafter {name!r}; registered: {sorted(DRAFTERS)}") from None
    return factory(**kwargs)


def __getattr__(name: str):
    if name == "ModelDrafter":  # imports torch; keep it lazy
        from agentspec.drafters.model import ModelDrafter

        return ModelDrafter
    raise AttributeError(name)
