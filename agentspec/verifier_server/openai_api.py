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

from agentspec.protocol import Generate, OpenSession
from agentspec.text import IncrementalDecoder, StopStrings
from agentspec.toolcalls import (
    ToolCallParser,
    add_instruction,
    normalise_tools,
    response_format_instruction,
    tool_choice_instruction,
)
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.requests import ChatRequest

__all__ = ["ChatRequest", "chat_completion", "chat_completion_events", "stream_chunks"]


async def chat_completion_events(engine: VerifierEngine, req: ChatRequest, owner: str
                                 ) -> AsyncIterator[dict[str, Any]]:
    """Yield OpenAI ``chat.completion.chunk`` dicts; the last one carries usage."""
    tools = normalise_tools(req.tools) if req.tool_choice != "none" else None
    single = req.parallel_tool_calls is False and bool(tools)
    structured = req.response_format if (req.response_format or {}).get("type") in ("json_object", "json_schema") \
        else None
    # tool_choice and response_format are enforced by the session's grammar (required/named calls, JSON) and
    # also said in an instruction, so the model knows what the content should be, not only its form
    hints = [h for h in (tool_choice_instruction(req.tool_choice, single), response_format_instruction(structured))
             if h]
    messages = add_instruction(req.messages, " ".join(hints)) if hints else req.messages
    # everything that can refuse the request does so before a session exists (a failed request leaves none)
    sampling = req.sampling()
    sampling.check_against(engine.vocab_size)
    info = await engine.open_session(OpenSession(messages=messages, tools=tools, tool_choice=req.tool_choice,
                                                 response_format=structured, parallel_tool_calls=not single),
                                     owner)
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

    def with_logprobs(chunks: list[dict[str, Any]], entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if entries:  # a round's logprobs ride on its first chunk (an empty delta when its text is held back)
            chunks = chunks or [chunk({})]
            chunks[0]["choices"][0]["logprobs"] = {"content": entries}
        return chunks

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
            out = []
            for ev in parser.feed(text):
                out += _events_to_deltas(ev, calls, chunk)
                calls += bool(ev.call)
            for c in with_logprobs(out, _logprob_entries(reply, session.stop_token_ids)):
                yield c
            if reply.finished or (single and calls):  # parallel_tool_calls=False: the first call ends it
                finish = reply.finish_reason or "stop"
                break
        for ev in parser.feed(stops.flush()) + parser.finish():
            for c in _events_to_deltas(ev, calls, chunk):
                yield c
            calls += bool(ev.call)
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
    structure = "enforced" if info.constrained else "instructed" if hints else None
    last["agentspec"] = {"mode": mode, "structure": structure, "rounds": rounds, "drafted": drafted,
                         "accepted": accepted, "mean_accepted_length": n_completion / rounds if rounds else 0.0}
    yield last


def _events_to_deltas(ev: Any, index: int, chunk: Any) -> list[dict[str, Any]]:
    if ev.call is None:
        return [chunk({"content": ev.text})] if ev.text else []
    c = ev.call
    return [chunk({"tool_calls": [{"index": index, "id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": ""}}]}),
            chunk({"tool_calls": [{"index": index, "function": {"arguments": c.arguments}}]})]


def _logprob_entries(reply: Any, stop_ids: frozenset[int]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries of a round's tokens (stop tokens, which add no text, left out)."""
    return [x.openai() for x in reply.logprobs or () if x.token not in stop_ids]


async def chat_completion(engine: VerifierEngine, req: ChatRequest, owner: str) -> dict[str, Any]:
    """The non-streaming response, aggregated from the same events."""
    content, calls, finish, usage, extra, entries = "", {}, "stop", None, None, []
    async for ch in chat_completion_events(engine, req, owner):
        delta = ch["choices"][0]["delta"]
        entries += (ch["choices"][0].get("logprobs") or {}).get("content") or []
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
    logprobs = {"content": entries} if req.logprobs else None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"id": "chatcmpl-" + uuid.uuid4().hex[:24], "object": "chat.completion", "created": int(time.time()),
            "model": req.model or engine.config.served_model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage, "agentspec": extra}


def sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def sse_stream(chunks: AsyncIterator[dict[str, Any]], include_usage: bool) -> AsyncIterator[bytes]:
    """SSE lines of OpenAI chunks: the usage the last chunk carries goes in a chunk of its own, when the
    request's ``stream_options.include_usage`` asks (agentspec's own statistics never go out)."""
    async def gen() -> AsyncIterator[bytes]:
        async for ch in chunks:
            usage = ch.pop("usage", None)
            ch.pop("agentspec", None)
            yield sse(ch)
            if usage is not None and include_usage:
                yield sse({"id": ch["id"], "object": ch["object"], "created": ch["created"], "model": ch["model"],
                           "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    return gen()


def stream_chunks(engine: VerifierEngine, req: ChatRequest, owner: str) -> AsyncIterator[bytes]:
    """SSE lines of the chat completion."""
    return sse_stream(chat_completion_events(engine, req, owner),
                      bool((req.stream_options or {}).get("include_usage")))
