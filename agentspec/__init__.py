"""agentspec: lossless speculative decoding for LLM agent loops.

The public API is imported lazily: ``import agentspec`` loads neither torch, transformers, litellm nor
langchain. Attributes resolve on first use (``agentspec.SpecClient``, ``agentspec.ChatAgentSpec``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentspec.types import DraftProposal, RoundStats, SamplingParams, SparseDist, SpecStats, VerifyResult

__version__ = "0.1.0"

_LAZY = {name: module for module, names in {
    "agentspec.local": ("SpecEngine", "GenerationResult"),
    "agentspec.models": ("load_model", "LoadedModel", "ModelLoadError"),
    "agentspec.drafters.base": ("DraftContext", "Drafter"),
    "agentspec.drafters": ("make_drafter",),
    "agentspec.drafters.ngram": ("NgramDrafter",),
    "agentspec.drafters.model": ("ModelDrafter",),
    "agentspec.router": ("DraftLengthPolicy",),
    "agentspec.client": ("SpecClient",),  # httpx only; litellm loads on the first API-fallback call
    "agentspec.adapters.langchain": ("ChatAgentSpec",),  # loads langchain_core on first use
}.items() for name in names}

__all__ = [
    "ChatAgentSpec", "DraftContext", "DraftLengthPolicy", "DraftProposal", "Drafter", "GenerationResult",
    "LoadedModel", "ModelDrafter", "ModelLoadError", "NgramDrafter", "RoundStats", "SamplingParams",
    "SparseDist", "SpecClient", "SpecEngine", "SpecStats", "VerifyResult", "load_model", "make_drafter",
]

if TYPE_CHECKING:
    from agentspec.adapters.langchain import ChatAgentSpec
    from agentspec.client import SpecClient
    from agentspec.drafters import DraftContext, Drafter, make_drafter
    from agentspec.drafters.model import ModelDrafter
    from agentspec.drafters.ngram import NgramDrafter
    from agentspec.local import GenerationResult, SpecEngine
    from agentspec.models import LoadedModel, ModelLoadError, load_model
    from agentspec.router import DraftLengthPolicy


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentspec' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
