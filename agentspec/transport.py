"""Talking to agentspec-verifier: httpx (HTTP/2, keep-alive), retries for transient failures, typed errors.

Every call returns the server's JSON and the wall time it took, so the client can compute
``RTT = wall − server-reported compute`` for each round.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from tenacity import AsyncRetrying, Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from agentspec.protocol import RESEND_PREFIX_CODES

# Idle connections are dropped after this long, before agentspec-verifier's keep-alive (--keep-alive,
# 75 s by default) would close them under a request.
KEEPALIVE_EXPIRY_S = 60.0


class VerifierError(Exception):
    """The verifier refused or failed a request; ``code`` is the server's error code when it sent one."""

    retryable = False

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.body = status, code, body or {}


class ResendPrefix(VerifierError):
    """The server lost or does not match the session (unknown, evicted, base_len mismatch): reopen it."""


class ModelNotServed(VerifierError):
    """The verifier serves no model of the requested name (HTTP 404 ``model_not_found``)."""


class VerifierUnavailable(VerifierError):
    """The verifier could not be reached, timed out or failed (5xx) after the configured retries."""

    retryable = True


def verifier_base(url: str) -> str:
    """A verifier's base URL as given by users, OpenAI's ``.../v1`` (with or without a slash) included."""
    return url.strip().rstrip("/").removesuffix("/v1")


@dataclass
class Timed:
    body: dict[str, Any]
    wall_s: float


def _stale_connection(e: httpx.TransportError, answered: bool) -> bool:
    """A kept-alive connection the server (or a middlebox) closed while idle, found out by sending on it:
    the peer hung up before any response began, so the request never ran. Sent again once on a fresh
    connection, whatever ``retries`` says; a request that did reach a live server and is sent again finds
    its session's ``base_len`` moved on and is refused (ResendPrefix), so nothing is committed twice."""
    return not answered and isinstance(e, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError)


class _Send(contextlib.AbstractContextManager):
    """One send (``with send: ...``): whether a response began, and the transport error it swallowed."""

    answered, error = False, None

    def __exit__(self, kind: type | None, error: BaseException | None, tb: object) -> bool:
        if isinstance(error, httpx.TransportError):
            self.error = error
        return self.error is not None


class HTTPTransport:
    """A verifier at ``base_url``; sync and async clients share settings, never an event loop."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0, retries: int = 2,
                 http2: bool = True) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.base_url, self.timeout = verifier_base(base_url), timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_keepalive_connections=16, keepalive_expiry=KEEPALIVE_EXPIRY_S)
        settings: dict[str, Any] = {"base_url": self.base_url, "headers": headers, "timeout": timeout,
                                    "http2": http2, "limits": limits}
        self._client, self._aclient = httpx.Client(**settings), httpx.AsyncClient(**settings)
        # transient failures (VerifierUnavailable) are retried with backoff; 4xx raise at once
        self._retry = {"stop": stop_after_attempt(retries + 1), "reraise": True,
                       "wait": wait_exponential(multiplier=0.05, max=1.0),
                       "retry": retry_if_exception(lambda e: isinstance(e, VerifierUnavailable))}

    def _sends(self) -> Iterator[_Send]:
        """The sends of one request: a second only when the first found a stale connection (see
        :func:`_stale_connection`); any other transport error raises as :class:`VerifierUnavailable`."""
        for stale_retry in (True, False):
            send = _Send()
            yield send
            if send.error is None:
                return
            if not (stale_retry and _stale_connection(send.error, send.answered)):
                raise self._unavailable(send.error) from send.error

    def post(self, path: str, body: dict[str, Any]) -> Timed:
        """POST JSON with retries for transient failures; 4xx raise at once (they will not get better)."""
        for attempt in Retrying(**self._retry):
            with attempt:
                t0 = time.perf_counter()
                for send in self._sends():
                    with send, self._client.stream("POST", path, json=body) as r:
                        send.answered = True
                        r.read()
                return Timed(_check(r), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    def stream_lines(self, path: str, body: dict[str, Any]) -> Iterator[Timed]:
        """POST and yield each NDJSON (or SSE) line as it arrives (no retries once streaming has begun)."""
        for send in self._sends():
            t0 = time.perf_counter()
            with send, self._client.stream("POST", path, json=body) as r:
                send.answered = True
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                for line in r.iter_lines():
                    if line and (data := _line(line, r.status_code)) is not None:
                        yield Timed(data, time.perf_counter() - t0)
                        t0 = time.perf_counter()

    def delete(self, path: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # closing is best effort
            self._client.delete(path)

    async def apost(self, path: str, body: dict[str, Any]) -> Timed:
        async for attempt in AsyncRetrying(**self._retry):
            with attempt:
                t0 = time.perf_counter()
                for send in self._sends():
                    with send:
                        async with self._aclient.stream("POST", path, json=body) as r:
                            send.answered = True
                            await r.aread()
                return Timed(_check(r), time.perf_counter() - t0)
        raise AssertionError("unreachable")

    async def astream_lines(self, path: str, body: dict[str, Any]) -> AsyncIterator[Timed]:
        for send in self._sends():
            t0 = time.perf_counter()
            with send:
                async with self._aclient.stream("POST", path, json=body) as r:
                    send.answered = True
                    if r.status_code >= 400:
                        await r.aread()
                        _check(r)
                    async for line in r.aiter_lines():
                        if line and (data := _line(line, r.status_code)) is not None:
                            yield Timed(data, time.perf_counter() - t0)
                            t0 = time.perf_counter()

    async def adelete(self, path: str) -> None:
        with contextlib.suppress(httpx.HTTPError):  # closing is best effort
            await self._aclient.delete(path)

    def _unavailable(self, e: httpx.TransportError) -> VerifierUnavailable:
        """Timeouts and connection failures (httpx.TimeoutException is a TransportError)."""
        if isinstance(e, httpx.TimeoutException):
            return VerifierUnavailable(f"verifier timed out after {self.timeout} s: {e}")
        return VerifierUnavailable(f"verifier unreachable at {self.base_url}: {e}")

    def close(self) -> None:
        self._client.close()

    async def aclose(self) -> None:
        await self._aclient.aclose()


def _check(r: httpx.Response) -> dict[str, Any]:
    data: Any = {}
    with contextlib.suppress(ValueError):
        data = r.json()
    if r.status_code >= 400:
        raise _error_from(data, r.status_code)
    return data


def _line(line: str, status: int) -> dict[str, Any] | None:
    """One streamed JSON line (NDJSON, or an SSE ``data:`` line of an OpenAI-compatible server); an error
    line raises as the error it carries; None for SSE's other lines and its closing ``[DONE]``."""
    if line.startswith(("data:", ":", "event:", "id:", "retry:")):
        line = line[5:].strip() if line.startswith("data:") else ""
        if not line or line == "[DONE]":
            return None
    data = json.loads(line)
    if "error" in data:
        raise _error_from(data, status)
    return data


def _error_from(data: dict[str, Any], status: int) -> VerifierError:
    err = data.get("error") if isinstance(data, dict) else None
    err = err if isinstance(err, dict) else {}
    if status < 400 and err.get("type") == "server_error":
        status = 500  # a stream's error line (after its HTTP 200): the server failed, as a 5xx would say
    message = err.get("message") or f"verifier answered HTTP {status}"
    code = err.get("code")
    kind = VerifierUnavailable if status >= 500 or status == 429 else VerifierError
    kind = ResendPrefix if code in RESEND_PREFIX_CODES else kind
    kind = ModelNotServed if code == "model_not_found" else kind
    return kind(message, status=status, code=code, body=err)
