"""uvicorn's h11 protocol with a deadline on request headers: a client that opens a connection and then
sends its headers slowly (slowloris) or not at all is answered 408 and disconnected, instead of holding a
connection slot forever. Bodies have their own deadline (``--body-timeout``, in the app); idle keep-alive
connections between requests are uvicorn's ``timeout_keep_alive``.

A connection beyond ``--max-connections`` is answered 503 and closed as soon as it is accepted: idle
connections opened by the hundred then hold no file descriptor beyond the cap, so they cannot exhaust the
process's open-file limit (which the CLI keeps above the cap) and stop it accepting anyone."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_BODY = json.dumps({"error": {"message": "the request headers did not arrive in time (--header-timeout)",
                              "type": "timeout_error", "param": None, "code": "request_timeout"}}).encode()
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(_BODY)) + _BODY
_BUSY = json.dumps({"error": {"message": "too many connections (--max-connections); retry shortly",
                              "type": "server_busy", "param": None, "code": "too_many_connections"}}).encode()
_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(_BUSY)) + _BUSY


class HeaderDeadlineProtocol(H11Protocol):
    """:class:`H11Protocol` whose requests must finish their headers within ``header_timeout_s`` of the
    connection opening (or of a new request's first byte on a kept-alive connection)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            transport.write(_503)  # beyond the cap: free its descriptor now, not at the header deadline
            transport.close()
            return
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._late)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:  # a new request starts
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._late)
        super().data_received(data)
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:  # its headers are in
            self._header_timer.cancel()
            self._header_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the keep-alive timer now watches the idle connection
        if self._header_timer is not None and self.conn.their_state is not h11.IDLE:
            self._header_timer.cancel()
            self._header_timer = None

    def _late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_408)
            self.transport.close()


def header_deadline_protocol(seconds: float) -> Any:
    """The protocol class for uvicorn's ``http`` setting, with headers due within ``seconds``."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": seconds})
