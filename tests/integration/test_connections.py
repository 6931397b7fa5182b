"""Slow and greedy clients: a body that stalls is cut with a 408, connections beyond --max-connections get
a 503 and the server goes on serving the others."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _reply(s: socket.socket) -> str:
    """One whole HTTP response: the head and then Content-Length bytes of body, however the kernel splits
    them across reads (a single recv may return the head alone)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            return data.decode()
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_a_stalled_body_gets_a_408_and_others_are_served(target):
    with LoopbackServer(target, config(body_timeout_s=0.5)) as srv:
        s = _connect(srv.url)
        s.sendall(b"POST /v1/spec/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt_ids\"")  # 87 bytes short, then silence
        t0 = time.monotonic()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # not blocked meanwhile
        reply = _reply(s)
        assert reply.startswith("HTTP/1.1 408") and "--body-timeout" in reply, reply
        assert time.monotonic() - t0 < 5
        s.close()


def test_connections_beyond_the_cap_get_a_503(target):
    with LoopbackServer(target, config(max_connections=3)) as srv:
        idle = [_connect(srv.url) for _ in range(3)]
        time.sleep(0.2)  # let the server accept them
        r = httpx.get(srv.url + "/health", timeout=10)
        assert r.status_code == 503
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_idle_connections_beyond_the_cap_are_answered_and_closed_at_once(target):
    """A flood of idle connections holds no descriptor beyond the cap: each one past it gets a 503 and is
    closed on accept, not at the header deadline, and the server serves again once the flood ends."""
    with LoopbackServer(target, config(max_connections=3, header_timeout_s=30)) as srv:
        idle = [_connect(srv.url) for _ in range(3)]
        time.sleep(0.2)
        flood = [_connect(srv.url) for _ in range(20)]
        t0 = time.monotonic()
        replies = [_reply(s) for s in flood]
        assert all(r.startswith("HTTP/1.1 503") and "--max-connections" in r for r in replies), replies[:2]
        assert time.monotonic() - t0 < 5  # answered on accept (the header deadline is 30 s)
        assert all(s.recv(1) == b"" for s in flood)  # and closed by the server
        assert len(srv.server.server_state.connections) <= 3
        for s in idle + flood:
            s.close()
        time.sleep(0.2)
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def _generated(srv) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("agentspec:generation_tokens_total"))


def test_a_non_streamed_request_stops_when_its_client_leaves(target):
    """The client gives up after 0.3 s; the server stops generating for it instead of finishing 900 tokens
    nobody will read (the end-of-text token is biased away so the answer would run to max_tokens)."""
    from tests.helpers import EOS

    with LoopbackServer(target, config(max_model_len=1024)) as srv:
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
                "logit_bias": {str(EOS): -100}}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=0.3)
        time.sleep(0.5)
        first = _generated(srv)
        time.sleep(0.5)
        assert _generated(srv) == first < 900  # nothing more was generated
        assert not any(s.busy for s in srv.engine.store._sessions.values())


def test_slow_headers_get_a_408_and_free_their_connection(target):
    with LoopbackServer(target, config(header_timeout_s=0.5)) as srv:
        silent, slow = _connect(srv.url), _connect(srv.url)
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.monotonic()
        for s in (silent, slow):
            reply = _reply(s)
            assert reply.startswith("HTTP/1.1 408") and "--header-timeout" in reply, reply
            assert s.recv(4096) == b""  # closed
        assert time.monotonic() - t0 < 5
        with httpx.Client(base_url=srv.url, timeout=10) as c:  # a normal client, keep-alive across the deadline
            assert c.get("/health").status_code == 200
            time.sleep(0.8)
            assert c.get("/health").status_code == 200
