"""``/v1/completions``: the legacy OpenAI text-completion endpoint, with server-side speculation.

One prompt (a string, tokenised with the target's tokenizer as vLLM does, or token ids) runs in a one-off
session like a chat completion, decoded in ``server`` mode when a ``--draft-model`` is loaded and plainly
(``server-ar``) otherwise; the answer is a ``text_completion`` object or its SSE stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from agentspec.protocol import Generate, OpenSession, ProtocolError
from agentspec.text import IncrementalDecoder, StopStrings
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.openai_api import sse_stream
from agentspec.verifier_server.requests import CompletionRequest


async def completion_events(engine: VerifierEngine, req: CompletionRequest, owner: str
                            ) -> AsyncIterator[dict[str, Any]]:
    """Yield ``text_completion`` chunks; the last one carries ``finish_reason`` and usage."""
    tok = engine.target.tokenizer
    if isinstance(req.prompt, str):
        if tok is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        ids = tok.encode(req.prompt)
    else:
        ids = list(req.prompt)
    if bad := [t for t in ids if t >= engine.vocab_size]:
        raise ProtocolError(f"prompt has token id {bad[0]} but the vocabulary has {engine.vocab_size} ids",
                            param="prompt")
    sampling = req.sampling()
    sampling.check_against(engine.vocab_size)  # everything that can refuse does so before a session exists
    info = await engine.open_session(OpenSession(prompt_ids=ids, model=req.model), owner)
    session = engine.store.get(info.session_id, owner)
    created, cid = int(time.time()), "cmpl-" + uuid.uuid4().hex[:24]
    model = req.model or engine.config.served_model_name
    mode: Literal["server", "server-ar"] = "server" if engine.draft_model is not None else "server-ar"
    gen = Generate(base_len=info.committed_len, mode=mode, max_new_tokens=req.max_tokens or 16, sampling=sampling)
    decoder, stops = IncrementalDecoder(tok), StopStrings(req.stops)
    n_completion, finish, offset, first = 0, "length", 0, True

    def chunk(text: str, logprobs: dict[str, Any] | None = None, finish_reason: str | None = None,
              token_ids: list[int] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if req.return_token_ids:  # vLLM's extension: each chunk's new token ids, the prompt's in the first
            choice["token_ids"] = token_ids or []
        return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}

    rounds = engine.generate(session, gen)
    try:
        if req.echo:
            yield chunk(req.prompt if isinstance(req.prompt, str) else decoder.add(ids, final=True))
            decoder = IncrementalDecoder(tok)
        async for reply in rounds:
            kept = [t for t in reply.tokens if t not in session.stop_token_ids]
            n_completion += len(reply.tokens)
            text = stops.feed(decoder.add(kept))
            logprobs = None
            if req.logprobs is not None:
                logprobs, offset = _legacy_logprobs(reply, session.stop_token_ids, offset)
            if text or logprobs or (req.return_token_ids and reply.tokens):
                out = chunk(text, logprobs, token_ids=list(reply.tokens))
                if req.return_token_ids and first:
                    out["choices"][0]["prompt_token_ids"], first = ids, False
                yield out
            if stops.stopped or reply.finished:
                finish = "stop" if stops.stopped else reply.finish_reason or "stop"
                break
        if rest := stops.flush():
            yield chunk(rest)
    finally:
        await rounds.aclose()
        engine.store.release(session)
    last = chunk("", None, finish)
    last["usage"] = {"prompt_tokens": len(ids), "completion_tokens": n_completion,
                     "total_tokens": len(ids) + n_completion,
                     "prompt_tokens_details": {"cached_tokens": info.reused_tokens}}
    yield last


def _legacy_logprobs(reply: Any, stop_ids: frozenset[int], offset: int) -> tuple[dict[str, Any], int]:
    """The legacy ``logprobs`` object of a round's tokens, and the text offset after them."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for x in reply.logprobs or ():
        if x.token in stop_ids:
            continue
        out["tokens"].append(x.text)
        out["token_logprobs"].append(x.logprob)
        out["top_logprobs"].append({t.text: t.logprob for t in x.top})
        out["text_offset"].append(offset)
        offset += len(x.text)
    return out, offset


async def completion(engine: VerifierEngine, req: CompletionRequest, owner: str) -> dict[str, Any]:
    """The non-streaming response, aggregated from the same chunks."""
    text, finish, usage, logprobs, token_ids = "", "length", None, None, []
    async for ch in completion_events(engine, req, owner):
        c = ch["choices"][0]
        text += c["text"]
        token_ids += c.get("token_ids") or []
        finish = c["finish_reason"] or finish
        usage = ch.get("usage", usage)
        if c["logprobs"]:
            logprobs = logprobs or {k: [] for k in c["logprobs"]}
            for k, v in c["logprobs"].items():
                logprobs[k] += v
    if req.logprobs is not None and logprobs is None:
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": "cmpl-" + uuid.uuid4().hex[:24], "object": "text_completion", "created": int(time.time()),
            "model": req.model or engine.config.served_model_name, "choices": [choice], "usage": usage}


def stream_completion(engine: VerifierEngine, req: CompletionRequest, owner: str) -> AsyncIterator[bytes]:
    """SSE lines of the completion."""
    return sse_stream(completion_events(engine, req, owner), bool((req.stream_options or {}).get("include_usage")))
