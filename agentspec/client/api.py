"""The API fallback, and the one door to litellm: :func:`litellm_module`.

With no verifier left (or ``mode="api"``), the request continues on ``fallback_model`` through litellm,
streamed, with every argument of the request (sampling, limits, stop strings, tools, ``tool_choice``,
``response_format``) and the client's ``api_kwargs`` (``api_base``, ``api_key``, ...). Text already
committed by a verifier is sent as a partial assistant answer, all of it (also what stop strings or the
tool-call parser still hold back), and none when nothing was. The provider's chunks become the events the
speculative path emits (text as it arrives, each tool call once, complete); its usage and model name are
recorded on the :class:`Run`. litellm is imported lazily, here only (``import agentspec`` never loads it).
"""

from __future__ import annotations

import inspect
import os
import time
import uuid
from functools import partial
from typing import Any

from agentspec.client.events import SegmentStats
from agentspec.client.ops import Call, Steps
from agentspec.client.run import Run

# set per request by agentspec; an ``api_kwargs`` entry for one of them would silently lose or break it
RESERVED_API_KWARGS = frozenset({"model", "messages", "stream", "stream_options"})


def litellm_module() -> Any:
    """litellm, imported lazily with offline-safe settings (no cost-map or tokenizer downloads)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.disable_hf_tokenizer_download = True
    return litellm


def check_api_kwargs(api_kwargs: dict[str, Any]) -> None:
    """Refuse ``api_kwargs`` that agentspec sets itself for every provider call."""
    if reserved := sorted(RESERVED_API_KWARGS & set(api_kwargs)):
        raise ValueError(f"api_kwargs must not set {reserved}: agentspec sets them for every call (the "
                         "fallback_model, the request's messages, streaming with usage)")


def api_request(run: Run, model: str, timeout: float, extra: dict[str, Any], same_vocab: bool = False
                ) -> dict[str, Any]:
    """litellm ``completion`` arguments for the rest of ``run``; ``extra`` (``api_kwargs``) comes last, so
    it can override a computed value (e.g. ``temperature`` for a provider that rejects 0). ``same_vocab``:
    ``model`` is the target itself (a deployment of it), so ``logit_bias``'s token ids mean the same."""
    messages = list(run.messages)
    if run.committed_text:  # continue the partial answer: all of it, also what stop strings or the parser hold
        messages.append({"role": "assistant", "content": run.committed_text})
    s = run.sampling
    request: dict[str, Any] = {"model": model, "messages": messages, "timeout": timeout, "stream": True,
                               "stream_options": {"include_usage": True},
                               "max_tokens": max(run.max_tokens - run.generated, 1),
                               # 0 is agentspec's greedy, sent as such so a switch mid-answer keeps decoding
                               "temperature": s.temperature}
    if s.top_p != 1.0:
        request["top_p"] = s.top_p
    if s.top_k:
        request["top_k"] = s.top_k  # litellm refuses it for providers without top_k (unless drop_params)
    if s.seed is not None:
        request["seed"] = s.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(s, name):
            request[name] = getattr(s, name)
    if s.logit_bias and same_vocab:
        request["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    elif s.logit_bias:  # ids of the target's vocabulary: they would mean other tokens to another model
        raise ValueError("logit_bias names the target's token ids and cannot be sent to the fallback model "
                         f"{model!r}, whose tokenizer differs; drop logit_bias or the API fallback")
    if s.logprobs is not None:
        request.update(logprobs=True, top_logprobs=s.logprobs)
    if run.stop:
        request["stop"] = list(run.stop)
    if run.tools:
        request["tools"] = run.tools
    if run.tool_choice is not None and (run.tools or run.tool_choice != "none"):
        request["tool_choice"] = run.tool_choice  # "none" without tools: no tools were sent at all
    if run.response_format is not None:
        request["response_format"] = run.response_format
    if run.tools and not getattr(run, "parallel_tool_calls", True):
        request["parallel_tool_calls"] = False
    return {**request, **extra}


def api_segment(run: Run, model: str | None, timeout: float, extra: dict[str, Any], mode: str = "api",
                same_vocab: bool = False) -> Steps:
    """The rest of ``run`` from the API model ``model``, streamed (``extra``: the client's ``api_kwargs``),
    counted as a segment of ``mode``."""
    if model is None:
        raise ValueError("the API fallback needs a fallback_model (a litellm model id, e.g. 'openai/gpt-4o')")
    litellm, request = litellm_module(), api_request(run, model, timeout, extra, same_vocab)
    t0 = time.perf_counter()
    seg = SegmentStats(mode, 0, 1, 0, 0, 0.0, 0.0, 0.0, kind=run.kind)
    run.stats.segments.append(seg)
    pending: dict[int, list[str]] = {}  # tool calls being streamed, by index: [id, name, arguments]
    finish, chunks = None, None
    try:
        chunks = yield Call(partial(litellm.completion, **request), partial(litellm.acompletion, **request))
        while (chunk := (yield Call(next, anext, (chunks, None)))) is not None:
            run.api_model = getattr(chunk, "model", None) or run.api_model or model
            if (usage := getattr(chunk, "usage", None)) is not None:
                run.api_usage = {k: int(getattr(usage, k, 0) or 0)
                                 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
                seg.tokens = run.api_usage["completion_tokens"]
            # after a stop string matched, read on only for the usage (the provider stops there too)
            for choice in (getattr(chunk, "choices", None) or ())[:1] if run.finish is None else ():
                finish = getattr(choice, "finish_reason", None) or finish
                delta = getattr(choice, "delta", None)
                for tc in getattr(delta, "tool_calls", None) or ():
                    index = getattr(tc, "index", None) or 0
                    for done in [i for i in pending if i < index]:  # providers stream calls in order
                        yield run.add_call(*pending.pop(done))
                    slot = pending.setdefault(index, [f"call_{uuid.uuid4().hex[:24]}", "", ""])
                    slot[0] = getattr(tc, "id", None) or slot[0]
                    fn = getattr(tc, "function", None)
                    slot[1] += getattr(fn, "name", None) or ""
                    slot[2] += getattr(fn, "arguments", None) or ""
                if run.logprobs is not None and (lp := getattr(choice, "logprobs", None)) is not None:
                    run.logprobs += [_entry(x) for x in getattr(lp, "content", None) or ()]
                if text := getattr(delta, "content", None):
                    yield from run.feed_text(text)
        for index in sorted(pending):
            yield run.add_call(*pending.pop(index))
        run.api_model = run.api_model or model
        run.finish = run.finish or {"length": "length"}.get(finish or "stop", "stop")
    finally:  # an API segment cut short still reports its time (and the usage that arrived)
        seg.wall_s = time.perf_counter() - t0
        _close(chunks)


def _entry(x: Any) -> dict[str, Any]:
    """A provider's logprobs entry (an object or a dict) in OpenAI's plain-dict form."""
    def plain(e: Any) -> dict[str, Any]:
        return {k: e.get(k) if isinstance(e, dict) else getattr(e, k, None) for k in ("token", "logprob", "bytes")}
    top = x.get("top_logprobs") if isinstance(x, dict) else getattr(x, "top_logprobs", None)
    return {**plain(x), "top_logprobs": [plain(t) for t in top or ()]}


def _close(chunks: Any) -> None:
    """End a sync provider stream now (a consumer stopped early, or a stop string matched) rather than at
    garbage collection; an async one's close is a coroutine this step cannot await: it ends when collected."""
    close = getattr(getattr(chunks, "completion_stream", None), "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        close()
