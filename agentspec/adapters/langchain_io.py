"""LangChain ⇄ SpecClient translation for :class:`~agentspec.adapters.langchain.ChatAgentSpec`.

In: LangChain messages → OpenAI-style text dicts, plus a system instruction for ``tool_choice`` or a JSON
``response_format``. Out: each verified event → one chunk (a tool call as one complete ``tool_call_chunk``,
the final event as the last chunk with usage and statistics); unverified previews are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from agentspec.adapters.langchain_errors import ToolChoiceError
from agentspec.client import FinalEvent, TextEvent, ToolCallEvent
from agentspec.toolcalls import flatten_content, tool_choice_instruction


def to_chat_messages(messages: Sequence[BaseMessage], dict_arguments: bool = True) -> list[dict[str, Any]]:
    """OpenAI-style message dicts with string content; ``dict_arguments`` parses tool-call arguments.

    Chat templates (Qwen, Llama, Hermes) render ``arguments`` with ``tojson`` and expect an object;
    a JSON string would be quoted twice. Plain provider APIs (the litellm fallback) expect the string.
    """
    out = []
    for m in flatten_content(convert_to_openai_messages(list(messages), text_format="string")):
        m["content"] = m["content"] or ""
        if dict_arguments:
            for call in m.get("tool_calls") or ():
                fn = call["function"]
                fn["arguments"] = json.loads(fn["arguments"] or "{}")
        out.append(m)
    return out


@dataclass(frozen=True)
class ToolChoice:
    """What ``tool_choice`` asks for: ``kind`` ``auto``, ``none``, ``any`` or ``named`` (``name`` set);
    ``single``: ``parallel_tool_calls=False``. Said in an instruction, enforced by the verifier's grammar
    (required / named, one call when single) and checked on the answer (:meth:`check`)."""

    kind: str = "auto"
    name: str | None = None
    single: bool = False
    allowed: tuple[str, ...] = ()  # the bound tools' names: "any" means a call to one of these

    def instruction(self) -> str | None:
        """The system instruction that asks the target for this choice, if any."""
        return tool_choice_instruction(self.openai(), self.single)

    def openai(self) -> str | dict[str, Any] | None:
        """The choice in OpenAI's form (``None`` for auto), for the drafters' grammar."""
        if self.kind == "named":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required", "none": "none"}.get(self.kind)

    def check(self, calls: Sequence[ToolCallEvent], text: str) -> None:
        """Raise :class:`ToolChoiceError` when the verified calls do not satisfy this choice."""
        if self.single and len(calls) > 1:
            raise ToolChoiceError(f"parallel_tool_calls=False but the target made {len(calls)} calls "
                                  f"({', '.join(c.name for c in calls)}).", raw_text=text)
        if self.kind == "any" and not calls:
            raise ToolChoiceError("tool_choice requires a tool call but the target answered with text only. "
                                  "agentspec does not constrain decoding to the tool grammar yet; use a target "
                                  "that follows tool instructions, or tool_choice='auto'.", raw_text=text)
        unknown = [c.name for c in calls if c.name not in self.allowed]
        if self.kind == "any" and unknown:
            raise ToolChoiceError(f"tool_choice requires a call to one of {list(self.allowed)} but the target "
                                  f"called {unknown}.", raw_text=text)
        if self.kind == "named":
            wrong = [c.name for c in calls if c.name != self.name]
            if not calls or wrong:
                got = f"called {wrong}" if wrong else "answered with text only"
                raise ToolChoiceError(f"tool_choice requires a call to {self.name!r} but the target {got}. "
                                      "agentspec does not constrain decoding to the tool grammar yet.",
                                      raw_text=text)


_RESERVED = {"auto", "none", "any", "required"}


def parse_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]] | None,
                      parallel_tool_calls: bool | None = None) -> ToolChoice:
    """Normalise every LangChain/OpenAI form: "auto", "none", "any"/"required"/True, a name, or
    ``{"type": "function", "function": {"name": ...}}``; raises ValueError for a tool not in ``tools``."""
    single = parallel_tool_calls is False
    names = [t["function"]["name"] for t in tools or ()]
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto", single=single, allowed=tuple(names))
    if tool_choice == "none" or tool_choice is False:
        return ToolChoice("none", allowed=tuple(names))
    if tool_choice in ("any", "required") or tool_choice is True:
        kind, name = "any", None
    elif isinstance(tool_choice, str):
        kind, name = "named", tool_choice
    elif isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if isinstance(tool_choice.get("function"), dict) else tool_choice
        kind, name = "named", fn.get("name")
        if not isinstance(name, str) or name in _RESERVED:
            raise ValueError(f"tool_choice dict must name a function, got {tool_choice!r}")
    else:
        raise ValueError(f"unsupported tool_choice {tool_choice!r}: use 'auto', 'none', 'any', 'required', "
                         "a tool name or {'type': 'function', 'function': {'name': ...}}")
    if not names:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools; bind some with bind_tools()")
    if kind == "named" and name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the bound tools {names}")
    return ToolChoice(kind, name, single, tuple(names))


def response_format_instruction(response_format: dict[str, Any] | None) -> str | None:
    """The system instruction for an OpenAI ``response_format`` (json_object / json_schema), if any."""
    kind = response_format.get("type") if response_format else "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return "Respond with one JSON object and nothing else."
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = json.dumps(spec.get("schema", spec), ensure_ascii=False)
        return f"Respond with one JSON object that matches this JSON schema, and nothing else:\n{schema}"
    raise ValueError(f"unsupported response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'")


def event_chunk(event: Any) -> ChatGenerationChunk | None:
    """The chunk for a verified text or tool-call event (None for previews and anything else)."""
    if isinstance(event, TextEvent):
        return ChatGenerationChunk(message=AIMessageChunk(content=event.text)) if event.text else None
    if isinstance(event, ToolCallEvent):
        tcc = tool_call_chunk(name=event.name, args=event.arguments, id=event.id, index=event.index)
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[tcc]))
    return None


def final_chunk(final: FinalEvent, model_name: str) -> ChatGenerationChunk:
    """The last chunk: usage (on this chunk only), finish reason, model name and agentspec statistics."""
    usage = UsageMetadata(input_tokens=final.usage["prompt_tokens"], output_tokens=final.usage["completion_tokens"],
                          total_tokens=final.usage["total_tokens"])
    metadata = {"model_name": model_name, "finish_reason": final.finish_reason,
                "agentspec": final.stats.to_dict()}
    if final.logprobs is not None:  # where ChatOpenAI puts them
        metadata["logprobs"] = {"content": final.logprobs}
    message = AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
    return ChatGenerationChunk(message=message, generation_info={"finish_reason": final.finish_reason})
