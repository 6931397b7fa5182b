"""The API fallback, and the one door to litellm: :func:`litellm_module`.

With no verifier left, the request continues on ``fallback_model`` through litellm, the committed text sent
as a partial assistant answer. litellm is imported lazily, here only (``import agentspec`` never loads it).
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import Any

from agentspec.client.events import SegmentStats
from agentspec.client.ops import Call, Steps
from agentspec.client.run import Run


def litellm_module() -> Any:
    """litellm, imported lazily with offline-safe settings (no cost-map or tokenizer downloads)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.disable_hf_tokenizer_download = True
    return litellm


def api_segment(run: Run, model: str | None, timeout: float, extra: dict[str, Any]) -> Steps:
    """The rest of ``run`` from the API model ``model`` (``extra``: the client's ``api_kwargs``)."""
    litellm, messages = litellm_module(), list(run.messages)
    if run.text:  # continue the partial answer (the API model only sees committed text)
        messages.append({"role": "assistant", "content": run.text})
    request: dict[str, Any] = {"model": model, "messages": messages, "timeout": timeout,
                               "max_tokens": max(run.max_tokens - run.generated, 1), **extra}
    if run.tools:
        request["tools"] = run.tools
    if not run.sampling.greedy:
        request["temperature"] = run.sampling.temperature
    if run.stop:
        request["stop"] = run.stop
    t0 = time.perf_counter()
    resp = yield Call(partial(litellm.completion, **request), partial(litellm.acompletion, **request))
    choice = resp.choices[0]
    events = run.feed_text(choice.message.content or "")
    for tc in getattr(choice.message, "tool_calls", None) or ():
        events.append(run.add_call(tc.id, tc.function.name, tc.function.arguments))
    n = getattr(getattr(resp, "usage", None), "completion_tokens", 0) or 0
    run.stats.segments.append(SegmentStats("api", n, 1, 0, 0, time.perf_counter() - t0, 0.0, 0.0))
    run.finish = {"length": "length"}.get(choice.finish_reason or "stop", "stop")
    yield from events  # after the request's state is complete
