"""Framework adapters (LangChain ``ChatAgentSpec``, litellm provider), imported only on demand: importing
``ChatAgentSpec`` from here imports LangChain at that moment, not at ``import agentspec``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ChatAgentSpec"]

if TYPE_CHECKING:
    from agentspec.adapters.langchain import ChatAgentSpec


def __getattr__(name: str) -> Any:
    if name != "ChatAgentSpec":
        raise AttributeError(f"module 'agentspec.adapters' has no attribute {name!r}")
    from agentspec.adapters.langchain import ChatAgentSpec

    return ChatAgentSpec
