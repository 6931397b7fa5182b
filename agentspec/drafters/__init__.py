"""Drafters: where draft tokens come from. Pick one by name with :func:`make_drafter`."""

from agentspec.drafters.base import DRAFTERS, DraftContext, Drafter, make_drafter, register_drafter
from agentspec.drafters.ngram import NgramDrafter

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "NgramDrafter", "make_drafter", "register_drafter",
           "ModelDrafter"]


def __getattr__(name: str):
    if name == "ModelDrafter":  # imports torch; keep it lazy
        from agentspec.drafters.model import ModelDrafter

        return ModelDrafter
    raise AttributeError(name)
