"""``/v1/chat/completions``: OpenAI-compatible generation with server-side speculation.

The request is rendered with the target's chat template (tools included), run in a one-off session
(reusing any cached prefix of the same API key), decoded with the server's drafter when one is loaded
(``server`` mode) or plainly (``server-ar``), and returned as an OpenAI response or SSE stream. Tool
calls are parsed incrementally from verified text only and emitted as OpenAI tool-call deltas.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentspec.protocol import Generate, OpenSession, Sampling
from agentspec.text import IncrementalDecoder, StopStrings
from agentspec.toolcalls import (
    ToolCallParser,
    add_instruction,
    flatten_content,
    normalise_tools,
    tool_choice_instruction,
)
from agentspec.verifier_server.engine import VerifierEngine


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat-completions request agentspec honours (unknown fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] needs a string 'role'")
            if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role {m['role']!r} is not one of system, developer, user, "
                                 "assistant, tool")
        return flatten_content(v)

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, t in enumerate(v or ()):
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': …, "
                                 "'parameters': {…}}}}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @model_validator(mode="after")
    def _choice(self) -> ChatRequest:
        names = {t["function"]["name"] for t in self.tools or ()}
        tc = self.tool_choice
        if isinstance(tc, str) and tc not in ("auto", "none", "required"):
            raise ValueError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                             "'function': {'name': …}}")
        if isinstance(tc, dict):
            name = (tc.get("function") or {}).get("name")
            if name not in names:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        if tc in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs tools")
        rf = self.response_format
        if rf is not None and rf.get("type") not in ("text", "json_object", "json_schema"):
            raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
        if rf is not None and rf.get("type") == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


async def chat_completion_events(engine: VerifierEngine, req: ChatRequest, owner: str
                                 ) -> AsyncIterator[dict[str, Any]]:
    """Yield OpenAI ``chat.completion.chunk`` dicts; the last one carries usage."""
    tools = normalise_tools(req.tools) if req.tool_choice != "none" else None
    hint = tool_choice_instruction(req.tool_choice)
    messages = add_instruction(req.messages, hint) if hint else req.messages
    structured = req.response_format if (req.response_format or {}).get("type") in ("json_object", "json_schema") \
        else None
    # everything that can refuse the request does so before a session exists (a failed request leaves none)
    sampling = Sampling(temperature=req.temperature or 0.0, top_p=req.top_p or 1.0, seed=req.seed)
    info = await engine.open_session(OpenSession(messages=messages, tools=tools, tool_choice=req.tool_choice,
                                                 response_format=structured), owner)
    session = engine.store.get(info.session_id, owner)
    created, cid = int(time.time()), "chatcmpl-" + uuid.uuid4().hex[:24]
    model = req.model or engine.config.served_model_name
    max_new = req.max_completion_tokens or req.max_tokens or 512
    # co-located speculation with a drafter, or for structured output (grammar + copy drafts need no model)
    speculate = engine.draft_model is not None or bool(tools) or structured is not None
    mode: Literal["server", "server-ar"] = "server" if speculate else "server-ar"
    gen = Generate(base_len=info.committed_len, mode=mode, max_new_tokens=max_new, sampling=sampling)
    decoder = IncrementalDecoder(engine.target.tokenizer)
    parser = ToolCallParser(tools_enabled=bool(tools))
    stops = StopStrings(req.stops)
    n_completion, finish, calls = 0, "stop", 0
    drafted = accepted = rounds = 0

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    rounds_iter = engine.generate(session, gen)
    try:
        yield chunk({"role": "assistant", "content": ""})
        async for reply in rounds_iter:
            rounds += 1
            drafted += reply.drafted
            accepted += reply.accepted
            ids = [t for t in reply.tokens if t not in session.stop_token_ids]
            n_completion += len(reply.tokens)
            text = stops.feed(decoder.add(ids))
            if stops.stopped:
                reply.finished, reply.finish_reason = True, "stop"
            for ev in parser.feed(text):
                for c in _events_to_deltas(ev, calls):
                    calls += bool(ev.call)
                    yield chunk(c)
            if reply.finished:
                finish = reply.finish_reason or "stop"
                break
        for ev in parser.feed(stops.flush()) + parser.finish():
            for c in _events_to_deltas(ev, calls):
                calls += bool(ev.call)
                yield chunk(c)
    finally:
        await rounds_iter.aclose()
        engine.store.release(session)  # its KV stays reusable as the next step's prefix
    if calls and finish == "stop":
        finish = "tool_calls"
    usage = {"prompt_tokens": len(info.prompt_ids), "completion_tokens": n_completion,
             "total_tokens": len(info.prompt_ids) + n_completion,
             "prompt_tokens_details": {"cached_tokens": info.reused_tokens}}
    last = chunk({}, finish)
    last["usage"] = usage
    last["agentspec"] = {"mode": mode, "rounds": rounds, "drafted": drafted, "accepted": accepted,
                         "mean_accepted_length": n_completion / rounds if rounds else 0.0}
    yield last


def _events_to_deltas(ev: Any, index: int) -> list[dict[str, Any]]:
    if ev.call is None:
        return [{"content": ev.text}] if ev.text else []
    c = ev.call
    return [{"tool_calls": [{"index": index, "id": c.id, "type": "function",
                             "function": {"name": c.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": c.arguments}}]}]


async def chat_completion(engine: VerifierEngine, req: ChatRequest, owner: str) -> dict[str, Any]:
    """The non-streaming response, aggregated from the same events."""
    content, calls, finish, usage, extra = "", {}, "stop", None, None
    async for ch in chat_completion_events(engine, req, owner):
        delta = ch["choices"][0]["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls") or ():
            slot = calls.setdefault(tc["index"], {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.get("id") or slot["id"]
            slot["function"]["name"] += (tc.get("function") or {}).get("name") or ""
            slot["function"]["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        finish = ch["choices"][0]["finish_reason"] or finish
        usage, extra = ch.get("usage", usage), ch.get("agentspec", extra)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion", "created": int(time.time()),
            "model": req.model or engine.config.served_model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage, "agentspec": extra}


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def stream_chunks(engine: VerifierEngine, req: ChatRequest, owner: str) -> AsyncIterator[bytes]:
    include_usage = bool((req.stream_options or {}).get("include_usage"))

    async def gen() -> AsyncIterator[bytes]:
        async for ch in chat_completion_events(engine, req, owner):
            usage = ch.pop("usage", None)
            ch.pop("agentspec", None)
            yield sse(ch)
            if usage is not None and include_usage:
                yield sse({"id": ch["id"], "object": "chat.completion.chunk", "created": ch["created"],
                           "model": ch["model"], "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return gen()

