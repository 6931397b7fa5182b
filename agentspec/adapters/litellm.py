"""A litellm custom provider: ``litellm.completion(model="agentspec/<served-model>", api_base=URL, ...)``.

After :func:`register`, litellm routes ``agentspec/...`` calls to :class:`AgentSpecLLM`;
:func:`~agentspec.adapters.litellm_request.parse_request` validates them (``api_base``: verifier URLs,
comma-separated for failover). Drafting happens on the verifier (``mode`` auto, server or server-ar).

Every call runs :meth:`SpecClient.astream` in a task feeding a queue and waits under a ``timeout`` deadline:
litellm passes ``timeout`` to custom providers but does not enforce it, so this module does (the task is
cancelled, ``litellm.Timeout`` raised). Sync calls run on one private event-loop thread; SpecClients are
cached per event loop and settings. Only verified events leave (text as committed, each tool call once,
complete); verifier errors become litellm exception types so ``litellm.Router`` retries and fallbacks apply.
``tool_choice`` "required" or a named function and a JSON ``response_format`` are said in an instruction
and enforced by the verifier's grammar (constrained decoding, lossless under speculation).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Any

import httpx

from agentspec.adapters.litellm_request import Request, UnsupportedRequest, parse_request
from agentspec.client import Deployment, FinalEvent, SpecClient, TextEvent, ToolCallEvent
from agentspec.client.api import litellm_module
from agentspec.transport import VerifierError, VerifierUnavailable

litellm = litellm_module()  # this module is imported only on demand; litellm comes with it (offline-safe settings)

PROVIDER = "agentspec"
DEFAULT_TIMEOUT_S = 600.0
_MAX_CLIENTS_PER_LOOP = 16
_background: set[asyncio.Task] = set()  # cancelled streams finishing their cleanup (kept from the GC)
_registered: set[str] = set()  # "provider/name" keys whose model info litellm has
_registered_lock = threading.Lock()
_MAX_REGISTERED = 1024


def register(provider: str = PROVIDER, models: Iterable[str] = ()) -> AgentSpecLLM:
    """Add the ``agentspec/`` provider to ``litellm.custom_provider_map`` (idempotent); return its handler.

    ``models``: served names whose model info to register now, so ``litellm.supports_function_calling(
    "agentspec/<name>")`` and ``litellm.get_model_info`` answer before the first call (every call
    registers its own name too; costs are 0: the verifier is the user's own).
    """
    for name in models:
        register_model_info(provider, name)
    for item in litellm.custom_provider_map:
        if item["provider"] == provider and isinstance(item["custom_handler"], AgentSpecLLM):
            return item["custom_handler"]
    handler = AgentSpecLLM(provider)
    litellm.custom_provider_map = [
        *(i for i in litellm.custom_provider_map if i["provider"] != provider),
        {"provider": provider, "custom_handler": handler},
    ]
    from litellm.utils import custom_llm_setup  # adds the name to litellm.provider_list / _custom_providers

    custom_llm_setup()
    return handler


def register_model_info(provider: str, name: str) -> None:
    """Tell litellm what ``provider/name`` supports and costs (once per name): without it
    ``supports_function_calling`` says False and ``completion_cost`` raises ``ModelNotMappedError``."""
    key = f"{provider}/{name}"
    with _registered_lock:
        if key in _registered or len(_registered) >= _MAX_REGISTERED:  # names a caller varies without bound
            return
        litellm.register_model({key: {
            "litellm_provider": provider, "mode": "chat", "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0, "supports_function_calling": True, "supports_tool_choice": True,
            "supports_parallel_function_calling": True, "supports_system_messages": True,
            "supports_response_schema": True,  # json_object / json_schema, enforced by the verifier's grammar
        }})
        _registered.add(key)


class AgentSpecLLM(litellm.CustomLLM):
    """litellm ``CustomLLM`` backed by :class:`SpecClient`; unused keyword arguments land in ``kwargs``."""

    def __init__(self, provider: str = PROVIDER) -> None:
        super().__init__()
        self.provider = provider
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, SpecClient]] = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()
        self._loop_thread = _LoopThread()

    def completion(self, model: str, messages: list, api_base: str | None = None, api_key: str | None = None,
                   optional_params: dict | None = None, model_response: Any = None, timeout: Any = None,
                   **kwargs: Any) -> Any:
        """Blocking chat completion: the async path, run on the adapter's private event-loop thread."""
        req = self._request(model, messages, api_base, api_key, optional_params, timeout, kwargs)
        final = None
        for ev in self._loop_thread.iterate(lambda: self._events(req)):
            final = ev
        return _response(req, final, model_response)

    def streaming(self, model: str, messages: list, api_base: str | None = None, api_key: str | None = None,
                  optional_params: dict | None = None, timeout: Any = None, **kwargs: Any
                  ) -> Iterator[dict[str, Any]]:
        """Blocking stream of ``GenericStreamingChunk`` dicts: verified text and complete tool calls only."""
        req = self._request(model, messages, api_base, api_key, optional_params, timeout, kwargs)
        for ev in self._loop_thread.iterate(lambda: self._events(req)):
            if (chunk := _chunk(ev)) is not None:
                yield chunk

    async def acompletion(self, model: str, messages: list, api_base: str | None = None,
                          api_key: str | None = None, optional_params: dict | None = None,
                          model_response: Any = None, timeout: Any = None, **kwargs: Any) -> Any:
        """Async chat completion on the caller's event loop."""
        req = self._request(model, messages, api_base, api_key, optional_params, timeout, kwargs)
        final = None
        async for ev in self._events(req):
            final = ev
        return _response(req, final, model_response)

    async def astreaming(self, model: str, messages: list, api_base: str | None = None,
                         api_key: str | None = None, optional_params: dict | None = None, timeout: Any = None,
                         **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
        """Async stream of ``GenericStreamingChunk`` dicts on the caller's event loop."""
        req = self._request(model, messages, api_base, api_key, optional_params, timeout, kwargs)
        async for ev in self._events(req):
            if (chunk := _chunk(ev)) is not None:
                yield chunk

    def _request(self, model: str, messages: list, api_base: str | None, api_key: str | None,
                 optional_params: dict | None, timeout: Any, kwargs: dict[str, Any]) -> Request:
        """The validated request; its model's info registered with litellm (capabilities, zero cost)."""
        litellm_params = kwargs.get("litellm_params") or {}
        drop = litellm.drop_params is True or litellm_params.get("drop_params") is True
        req = _request(model, messages, api_base, api_key, optional_params, timeout, drop)
        register_model_info(self.provider, req.model)
        return req

    async def _events(self, req: Request) -> AsyncIterator[Any]:
        """SpecClient events under the request's deadline (errors translated for litellm); on timeout the
        stream's task is cancelled and left to close its verifier session in the background."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout_s if req.timeout_s is not None else None
        client = self._client(req, loop)
        events: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()

        stream = client.astream(req.messages, req.tools, max_tokens=req.max_tokens, sampling=req.sampling,
                                stop=req.stop, mode=req.mode, model=req.model, tool_choice=req.tool_choice,
                                response_format=req.response_format, parallel_tool_calls=not req.single_call)
        task = loop.create_task(_pump(stream, events.put_nowait))  # its errors are raised to the consumer below
        _background.add(task)
        task.add_done_callback(_background.discard)
        try:
            while True:
                try:
                    async with _timeout_at(deadline):  # spans only the wait, never a yield to the caller
                        ok, item = await events.get()
                except TimeoutError as e:
                    raise litellm.Timeout(message=f"agentspec: no complete answer within {req.timeout_s} s",
                                          model=req.model, llm_provider=PROVIDER) from e
                if ok:
                    if req.single_call and isinstance(item, ToolCallEvent) and item.index > 0:
                        continue  # parallel_tool_calls=False: the first call is the answer
                    if req.single_call and isinstance(item, FinalEvent):
                        item = dataclasses.replace(item, tool_calls=item.tool_calls[:1])
                    yield item
                elif item is None:
                    return
                elif isinstance(item, VerifierError):
                    raise _translate(item, req.model) from item
                elif isinstance(item, ValueError):  # SpecClient's argument checks
                    raise litellm.BadRequestError(message=str(item), model=req.model, llm_provider=PROVIDER) from item
                else:
                    raise item
        finally:
            task.cancel()  # no-op once finished; otherwise SpecClient's cleanup runs in the background

    def _client(self, req: Request, loop: asyncio.AbstractEventLoop) -> SpecClient:
        # An httpx.AsyncClient's pool belongs to one event loop: cache per loop, then per settings.
        with self._lock:
            per_loop = self._clients.setdefault(loop, {})
            client = per_loop.get(req.client_key)
            if client is None:
                if len(per_loop) >= _MAX_CLIENTS_PER_LOOP:  # settings vary without bound: drop the oldest
                    per_loop.pop(next(iter(per_loop))).close()
                dep = Deployment(req.vllm_base_url, req.model, req.api_key) if req.vllm_base_url else None
                client = SpecClient(list(req.urls), api_key=req.api_key, num_draft_tokens=req.num_draft_tokens,
                                    timeout=req.timeout_s or DEFAULT_TIMEOUT_S, segment_tokens=req.segment_tokens,
                                    deployment=dep)
                per_loop[req.client_key] = client
            return client


class _LoopThread:
    """One private event loop on a daemon thread; sync calls iterate an async generator run on it."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def _get(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="agentspec-litellm", daemon=True).start()
            return self._loop

    def iterate(self, make: Callable[[], AsyncIterator[Any]]) -> Iterator[Any]:
        """Yield ``make()``'s items in this thread; the generator runs as one task on the private loop."""
        items: queue.Queue[tuple[bool, Any]] = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(_pump(make(), items.put), self._get())
        try:
            while True:
                ok, item = items.get()
                if ok:
                    yield item
                elif item is None:
                    return
                else:
                    raise item
        finally:
            future.cancel()  # the consumer stopped early: cancel the request (no-op when it finished)


async def _pump(items: AsyncIterator[Any], put: Callable[[tuple[bool, Any]], Any]) -> None:
    """Hand ``items`` to ``put`` as ``(True, item)``, then ``(False, None)`` or ``(False, error)``."""
    try:
        async for item in items:
            put((True, item))
        put((False, None))
    except Exception as e:
        put((False, e))


def _request(model: str, messages: list, api_base: str | None, api_key: str | None,
             optional_params: dict | None, timeout: Any, drop_params: bool) -> Request:
    try:
        return parse_request(model, messages, api_base, api_key, optional_params or {}, timeout, drop_params)
    except UnsupportedRequest as e:
        raise litellm.BadRequestError(message=str(e), model=model, llm_provider=PROVIDER) from e


def _response(req: Request, final: FinalEvent | None, model_response: Any) -> Any:
    """Fill litellm's ``ModelResponse`` from the final event (content, OpenAI tool calls, usage)."""
    assert isinstance(final, FinalEvent), "SpecClient streams end with a FinalEvent"
    response = model_response if model_response is not None else litellm.ModelResponse()
    calls = [_openai_call(c) for c in final.tool_calls]
    response.choices[0].message = litellm.Message(content=final.text or (None if calls else ""),
                                                  role="assistant", tool_calls=calls or None)
    response.choices[0].finish_reason = final.finish_reason
    if final.logprobs is not None:
        response.choices[0].logprobs = {"content": final.logprobs}
    response.model = req.model
    response.usage = litellm.Usage(**final.usage)
    response._hidden_params["agentspec"] = final.stats.to_dict()
    return response


def _chunk(ev: Any) -> dict[str, Any] | None:
    """A ``GenericStreamingChunk`` for a verified event; ``None`` for a preview (never streamed)."""
    chunk: dict[str, Any] = {"text": "", "tool_use": None, "is_finished": False, "finish_reason": "",
                             "usage": None, "index": 0}
    if isinstance(ev, TextEvent):
        return {**chunk, "text": ev.text} if ev.text else None
    if isinstance(ev, ToolCallEvent):
        return {**chunk, "tool_use": {**_openai_call(ev), "index": ev.index}}
    if isinstance(ev, FinalEvent):
        return {**chunk, "is_finished": True, "finish_reason": ev.finish_reason, "usage": dict(ev.usage)}
    return None


def _openai_call(call: ToolCallEvent) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _translate(e: VerifierError, model: str) -> Exception:
    """A verifier error as the litellm exception type that Router retries and fallbacks understand."""
    msg, kw = f"agentspec verifier: {e}", {"model": model, "llm_provider": PROVIDER}
    if any(isinstance(c, httpx.TimeoutException) for c in _causes(e)):
        return litellm.Timeout(message=msg, **kw)
    if isinstance(e, VerifierUnavailable) and e.status is None:
        return litellm.APIConnectionError(message=msg, **kw)
    by_status = {400: litellm.BadRequestError, 401: litellm.AuthenticationError, 404: litellm.NotFoundError,
                 413: litellm.BadRequestError, 422: litellm.BadRequestError, 429: litellm.RateLimitError,
                 503: litellm.ServiceUnavailableError}
    if e.status in by_status:
        return by_status[e.status](message=msg, **kw)
    if e.status is not None and e.status >= 500:
        return litellm.InternalServerError(message=msg, **kw)
    return litellm.APIError(status_code=e.status or 500, message=msg, **kw)


def _causes(e: BaseException | None) -> Iterator[BaseException]:
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


if sys.version_info >= (3, 11):
    _timeout_at = asyncio.timeout_at
else:  # pragma: no cover - Python 3.10 has no asyncio.timeout_at

    @contextlib.asynccontextmanager
    async def _timeout_at(deadline: float | None) -> AsyncIterator[None]:
        if deadline is None:
            yield
            return
        task, fired = asyncio.current_task(), []
        handle = asyncio.get_running_loop().call_at(deadline, lambda: (fired.append(1), task.cancel()))
        try:
            yield
        except asyncio.CancelledError as e:
            if fired:
                raise TimeoutError from e
            raise
        finally:
            handle.cancel()
