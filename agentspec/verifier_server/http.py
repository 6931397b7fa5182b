"""uvicorn's h11 protocol with a deadline on request headers: a client that opens a connection and then
sends its headers slowly (slowloris) or not at all is answered 408 and disconnected, instead of holding a
connection slot forever. Bodies have their own deadline (``--body-timeout``, in the app); idle keep-alive
connections between requests are uvicorn's ``timeout_keep_alive``.

A connection beyond ``--max-connections`` is answered 503 and closed inside ``accept()`` itself
(:class:`CappedListener`): idle connections opened by the hundred then hold no file descriptor beyond the cap,
not even for the few event-loop turns between an accept and its protocol running, so they cannot exhaust the
process's open-file limit (which the CLI keeps above the cap) and stop it accepting anyone."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentspec.verifier_server.config import ACCEPT_BATCH

_BODY = json.dumps({"error": {"message": "the request headers did not arrive in time (--header-timeout)",
                              "type": "timeout_error", "param": None, "code": "request_timeout"}}).encode()
_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(_BODY)) + _BODY
_BUSY = json.dumps({"error": {"message": "too many connections (--max-connections); retry shortly",
                              "type": "server_busy", "param": None, "code": "too_many_connections"}}).encode()
_503 = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(_BUSY)) + _BUSY


class CappedListener(socket.socket):
    """A listening socket whose ``accept()`` hands the event loop at most ``cap`` open connections: one
    beyond them is answered 503 and closed before ``accept()`` returns. asyncio accepts a batch per wake-up
    and closes a refused connection only three loop turns later (task, transport, protocol), so a flood
    refused by the protocol alone holds several batches of descriptors beyond the cap at once."""

    def __init__(self, sock: socket.socket, cap: int, refuse_per_call: int = ACCEPT_BATCH) -> None:
        """Take over ``sock`` (bound; ``sock`` is detached). ``refuse_per_call``: refusals before one
        ``accept()`` yields to the loop (a flood cannot hold the loop for long)."""
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.cap, self.open, self.refused, self.refuse_per_call = cap, 0, 0, refuse_per_call

    def accept(self) -> tuple[socket.socket, Any]:
        for _ in range(self.refuse_per_call):
            fd, addr = self._accept()  # type: ignore[attr-defined]  # BlockingIOError: none waiting
            if self.open < self.cap:
                self.open += 1
                return _Admitted(self, fd), addr
            with socket.socket(self.family, self.type, self.proto, fileno=fd) as conn:
                conn.setblocking(False)
                try:
                    conn.send(_503)  # a fresh connection's send buffer holds it whole
                    conn.recv(65536)  # what the client already sent: unread, the close would reset
                except OSError:
                    pass
            self.refused += 1
        raise BlockingIOError  # more may be waiting: the loop's next wake-up takes them

    def _release(self) -> None:
        self.open -= 1


class _Admitted(socket.socket):
    """An accepted connection that gives its slot back to the listener when it closes."""

    def __init__(self, listener: CappedListener, fd: int) -> None:
        super().__init__(listener.family, listener.type, listener.proto, fileno=fd)
        self._listener: CappedListener | None = listener
        if self.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets TCP_NODELAY only on sockets created with proto IPPROTO_TCP, and a socket from
            # socket.create_server has proto 0: without it Nagle holds a response's body until the client
            # acknowledges its head, a delayed-ACK stall (~40 ms on Linux) on every round trip
            self.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        if self._listener is not None:
            self._listener._release()
            self._listener = None
        super().close()

    def __del__(self) -> None:  # replaces the C finalizer, which would close the descriptor
        self.close()


class HeaderDeadlineProtocol(H11Protocol):
    """:class:`H11Protocol` whose requests must finish their headers within ``header_timeout_s`` of the
    connection opening (or of a new request's first byte on a kept-alive connection)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = self.loop.call_later(self.header_timeout_s, self._late)

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


def listen(host: str, port: int, cap: int) -> CappedListener:
    """A TCP socket bound to ``host:port`` (port 0: any free one) that holds at most ``cap`` connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return CappedListener(socket.create_server((host, port), family=family), cap)
