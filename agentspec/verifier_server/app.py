"""The verifier's HTTP routes (FastAPI): speculation API, OpenAI-compatible API, health, metrics.

Every error leaves as the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
that says what to fix (5xx only for the server's own faults); a bad request never affects other sessions.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentspec import __version__
from agentspec.protocol import (
    PROTOCOL_VERSION,
    Detokenize,
    Generate,
    OpenSession,
    ProtocolError,
    Tokenize,
    VerifyRound,
    error_body,
)
from agentspec.verifier_server.completions import completion, stream_completion
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.kv_store import key_owner
from agentspec.verifier_server.metrics import (
    RequestStatsMiddleware,
    current_request,
    mark_failed,
    sse_finish_reason,
    track_model_jobs,
)
from agentspec.verifier_server.openai_api import ChatRequest, chat_completion, stream_chunks
from agentspec.verifier_server.openapi import document
from agentspec.verifier_server.requests import CompletionRequest
from agentspec.verifier_server.stats_log import StatsLogger

log = logging.getLogger("agentspec.verifier")

DISCONNECT_POLL_S = 0.1  # how often a non-streamed request checks that its client is still there
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_busy_error", 504: "timeout_error"}


def create_app(engine: VerifierEngine) -> FastAPI:
    """The ASGI app around a (possibly still loading) :class:`VerifierEngine`."""
    config = engine.config
    app = FastAPI(title="agentspec-verifier", version=str(PROTOCOL_VERSION), docs_url=None, redoc_url=None)
    app.router.redirect_slashes = False  # "/health/" is a 404 naming the path, not a 307 to follow
    app.state.engine = engine
    keys = tuple(k.encode() for k in config.api_keys)
    too_large = f"request body is larger than this server's limit of {config.max_body_bytes} bytes"

    def owner_of(request: Request) -> str:
        """Authenticate (constant-time, every configured key compared) and return the caller's owner tag."""
        if not keys:
            return key_owner(None)
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ProtocolError("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key",
                                status=401)
        given = token.strip().encode()
        if not any([hmac.compare_digest(given, k) for k in keys]):  # a list: compare every key, no short cut
            raise ProtocolError("invalid API key", code="invalid_api_key", status=401)
        return key_owner(token.strip())

    async def admit(request: Request, model: Any) -> tuple[str, Any]:
        """Authenticate, require a loaded model, then read and validate the body: (owner, request)."""
        owner = owner_of(request)
        if not engine.ready:
            raise ProtocolError("the model is still loading; retry when /health says ok", code="not_ready",
                                status=503)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ProtocolError(too_large, code="body_too_large", status=413)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(config.body_timeout_s):  # a body that stalls must not hold a slot
                async for part in request.stream():
                    size += len(part)
                    if size > config.max_body_bytes:
                        raise ProtocolError(too_large, code="body_too_large", status=413)
                    chunks.append(part)
        except TimeoutError:
            raise ProtocolError(f"the request body did not arrive within {config.body_timeout_s:g} s "
                                "(--body-timeout)", code="request_timeout", status=408) from None
        body = b"".join(chunks)
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"request body is not valid JSON: {e}", code="invalid_json") from e
        except RecursionError:
            raise ProtocolError("request body is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ProtocolError("request body must be a JSON object", code="invalid_json")
        try:
            return owner, model.model_validate(data, strict=True)  # "1", true and "yes" are not 1 or True
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e

    async def timed(coro: Any, endpoint: str, request: Request | None = None) -> Any:
        """Await ``coro`` under the request timeout, tracking the request under ``endpoint`` (its latency
        is observed by :class:`RequestStatsMiddleware` once the whole response is over). With ``request``,
        the work is cancelled as soon as its client disconnects: nobody would read the answer."""
        if engine.metrics:
            engine.metrics.admit(endpoint)
        task = asyncio.ensure_future(asyncio.wait_for(coro, timeout=config.request_timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S if request else None)
                if done:
                    return task.result()
                if request is not None and await request.is_disconnected():
                    raise ProtocolError("the client closed the connection", code="client_closed", status=499)
        except asyncio.TimeoutError:
            raise ProtocolError(f"request took longer than {config.request_timeout_s:.0f} s", code="timeout",
                                status=504) from None
        finally:
            task.cancel()

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_names:
            raise ProtocolError(f"model {name!r} is not served here; this server serves "
                                f"{', '.join(map(repr, config.served_names))}", param="model",
                                code="model_not_found", status=404)

    # -- errors ------------------------------------------------------------------------------------

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, e: ProtocolError) -> JSONResponse:
        kind = ERROR_TYPES.get(e.status, "invalid_request_error")
        return JSONResponse(error_body(e.message, kind, e.param, e.code, **e.extra), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        msg = first.get("msg", "invalid request").removeprefix("Value error, ")
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        return JSONResponse(error_body(f"{param}: {msg}{more}" if param else msg + more, param=param,
                                       code="invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        headers = dict(e.headers or {})
        if e.status_code == 405:  # every method the path takes, not only the first matching route's
            methods = {m for r in app.router.routes if getattr(r, "path_regex", None) is not None
                       and r.path_regex.match(request.url.path) for m in getattr(r, "methods", None) or ()}
            headers["Allow"] = ", ".join(sorted(methods)) or headers.get("Allow", "")
        return JSONResponse(error_body(str(e.detail), ERROR_TYPES.get(e.status_code, "invalid_request_error"),
                                       code=str(e.status_code)), status_code=e.status_code, headers=headers)

    app.add_middleware(_InternalErrors)
    # outermost: sees a streamed response to its last byte, or the client leave
    stats = app.state.stats_logger = StatsLogger(engine, config.log_stats_interval_s)
    app.add_middleware(RequestStatsMiddleware, on_request=stats.start)
    if engine.metrics:
        track_model_jobs(engine)

    # -- operations --------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": config.served_model_name})

    app.head("/health", include_in_schema=False)(health)  # load balancers probe with HEAD

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            return Response(b"", media_type="text/plain")
        load = engine.load()
        body = engine.metrics.render(load.sessions, load.kv_cache_bytes / max(load.kv_cache_capacity_bytes, 1))
        return Response(body, media_type="text/plain; version=0.0.4")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "agentspec",
                "max_model_len": config.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        owner_of(request)
        return {"object": "list", "data": [model_card(name) for name in config.served_names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> dict:
        owner_of(request)
        check_model(model_id)
        return model_card(model_id)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__, "protocol_version": PROTOCOL_VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        _, req = await admit(request, Tokenize)
        check_model(req.model)
        tok = engine.target.tokenizer
        if req.messages is not None:
            ids = engine.render(req.messages, req.tools, req.add_generation_prompt)
        elif tok is None:
            raise ProtocolError("this model has no tokenizer", param="prompt")
        else:
            ids = tok.encode(req.prompt, add_special_tokens=False)
        return {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        _, req = await admit(request, Detokenize)
        if engine.target.tokenizer is None:
            raise ProtocolError("this model has no tokenizer", param="tokens")
        if any(t >= engine.vocab_size for t in req.tokens):
            raise ProtocolError(f"token ids must be below the vocabulary size {engine.vocab_size}", param="tokens")
        return {"prompt": engine.target.tokenizer.decode(req.tokens)}

    # -- speculation API ---------------------------------------------------------------------------

    @app.post("/v1/spec/sessions")
    async def open_session(request: Request) -> dict:
        owner, req = await admit(request, OpenSession)
        check_model(req.model)
        info = await timed(engine.open_session(req, owner), "open_session", request)
        return info.model_dump()

    @app.get("/v1/spec/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict:
        owner = owner_of(request)
        return engine.info(engine.store.get(session_id, owner)).model_dump()

    @app.delete("/v1/spec/sessions/{session_id}")
    async def close_session(session_id: str, request: Request) -> dict:
        owner = owner_of(request)
        engine.store.close(session_id, owner)
        return {"session_id": session_id, "closed": True}

    @app.post("/v1/spec/sessions/{session_id}/rounds")
    async def verify_round(session_id: str, request: Request) -> dict:
        owner, req = await admit(request, VerifyRound)
        session = engine.store.get(session_id, owner)
        reply = await timed(engine.verify_round(session, req), "round", request)
        return reply.model_dump()

    @app.post("/v1/spec/sessions/{session_id}/generate")
    async def generate(session_id: str, request: Request) -> StreamingResponse:
        owner, req = await admit(request, Generate)
        session = engine.store.get(session_id, owner)
        req.check_against(engine.vocab_size, config.max_draft_tokens)
        rounds = engine.generate(session, req)
        first = await timed(rounds.__anext__(), "generate")  # errors before streaming starts become 4xx

        async def body() -> AsyncIterator[bytes]:
            try:
                yield (first.model_dump_json() + "\n").encode()
                async for reply in rounds:
                    yield (reply.model_dump_json() + "\n").encode()
            except ProtocolError as e:
                mark_failed()
                yield (json.dumps(error_body(e.message, code=e.code, param=e.param)) + "\n").encode()
            except Exception as e:  # the stream ends with an error line, never silently
                mark_failed()
                yield (json.dumps(_internal_error(request.url.path, e)) + "\n").encode()
            finally:
                await rounds.aclose()

        return StreamingResponse(body(), media_type="application/x-ndjson")

    # -- OpenAI-compatible -------------------------------------------------------------------------

    async def openai_answer(request: Request, req: Any, endpoint: str, complete: Any, stream: Any) -> Any:
        """An OpenAI-style answer: the whole object, or an SSE stream whose first chunk is computed before
        the response starts (so a refusal is still a 4xx) and whose failure ends it with an error event."""
        check_model(req.model)
        owner, rec = request.state.owner, current_request()
        if not req.stream:
            result = await timed(complete(engine, req, owner), endpoint, request)
            if rec is not None:  # the answer's own reason (tool_calls, a stop string), not the last round's
                rec.finish_reason = result["choices"][0]["finish_reason"]
            return result
        chunks = stream(engine, req, owner)
        first = await timed(chunks.__anext__(), endpoint)

        async def body() -> AsyncIterator[bytes]:
            yield first
            try:
                async for c in chunks:
                    reason = sse_finish_reason(c)
                    if reason is not None and rec is not None:
                        rec.finish_reason = reason
                    yield c
            except ProtocolError as e:
                mark_failed()
                yield f"data: {json.dumps(error_body(e.message, code=e.code, param=e.param))}\n\n".encode()
            except Exception as e:  # the stream ends with an error event, never silently
                mark_failed()
                yield f"data: {json.dumps(_internal_error(request.url.path, e))}\n\n".encode()

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        request.state.owner, req = await admit(request, ChatRequest)
        return await openai_answer(request, req, "chat_completions", chat_completion, stream_chunks)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        request.state.owner, req = await admit(request, CompletionRequest)
        return await openai_answer(request, req, "completions", completion, stream_completion)

    document(app, {"/tokenize": Tokenize, "/detokenize": Detokenize, "/v1/spec/sessions": OpenSession,
                   "/v1/spec/sessions/{session_id}/rounds": VerifyRound,
                   "/v1/spec/sessions/{session_id}/generate": Generate, "/v1/chat/completions": ChatRequest,
                   "/v1/completions": CompletionRequest})
    return app


class _InternalErrors:
    """Any other exception: a 500 in the OpenAI envelope (or, once a response has started, the log only). Not
    re-raised: the server would then drop the connection before the client reads the answer."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:
            body = _internal_error(scope.get("path", ""), e)
            if not started and scope["type"] == "http":
                await JSONResponse(body, status_code=500)(scope, receive, send)


def _internal_error(path: str, e: BaseException) -> dict[str, Any]:
    """A 5xx body: the exception goes to the log, never to the client (it may carry another tenant's data)."""
    log.error("internal error on %s", path, exc_info=e)
    return error_body("internal server error; the request was not completed (details are in the server log)",
                      "server_error", code="internal_error")
