"""SpecClient: one chat call, routed per segment between edge, server, server-ar, vllm and API modes.

``stream()`` is the primitive, ``generate()`` aggregates it, ``astream``/``agenerate`` are their native async
twins. Modules: ``spec_client`` (the segment loop, sessions, failover), ``run`` (one request's state and wire
requests), ``edge`` (local drafting), ``ops`` (I/O and its drivers), ``api`` (the litellm fallback),
``deployment`` (the vllm mode: an OpenAI-compatible deployment of the target), ``events`` (events and
statistics).
"""

from agentspec.client.deployment import Deployment
from agentspec.client.edge import PIPELINE_MIN_DRAFT_S
from agentspec.client.events import (
           ClientStats,
           FinalEvent,
           PreviewEvent,
           SegmentStats,
           TextEvent,
           ToolCallEvent,
)
from agentspec.client.spec_client import MODES, SpecClient

__all__ = ["MODES", "PIPELINE_MIN_DRAFT_S", "ClientStats", "Deployment", "FinalEvent", "PreviewEvent", "SegmentStats",
           "SpecClient", "TextEvent", "ToolCallEvent"]
