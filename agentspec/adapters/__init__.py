"""Framework adapters (LangChain ``ChatAgentSpec``, litellm provider). Imported only on demand.

``from agentspec.adapters import ChatAgentSpec`` imports LangChain at that moment, not at ``import agentspec``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

_LAZY = {"ChatAgentSpec": "agentspec.adapters.langchain"}

__all__ = ["ChatAgentSpec"]

if TYPE_CHECKING:
    from agentspec.adapters.langchain import ChatAgentSpec


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentspec.adapters' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
