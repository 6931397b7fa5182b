"""The verifier's listening socket: connections beyond the cap are answered 503 and closed inside accept(),
so a flood of idle connections never holds a descriptor beyond the cap (and cannot exhaust the open-file
limit: the accept loop would then fail for everyone)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from agentspec.verifier_server.http import CappedListener, listen

pytestmark = pytest.mark.integration


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def test_accept_admits_up_to_the_cap_and_refuses_the_rest_at_once():
    listener = listen("127.0.0.1", 0, cap=2)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(5)]
    try:
        admitted = [listener.accept()[0] for _ in range(2)]
        # small writes go out at once (Nagle would hold a response body for the client's delayed ACK)
        assert all(a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for a in admitted)
        with pytest.raises(BlockingIOError):  # the three beyond the cap are refused in this same call
            listener.accept()
        assert (listener.open, listener.refused) == (2, 3)
        for c in clients[2:]:
            reply = _read_all(c)  # the whole 503, then end of stream: the server side is closed
            assert reply.startswith(b"HTTP/1.1 503") and b"--max-connections" in reply, reply
        admitted[0].close()
        admitted[0].close()  # closing twice gives one slot back, not two
        assert listener.open == 1
        late = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = _accept_when_ready(listener)
        assert listener.open == 2
        conn.sendall(b"ok")
        assert late.recv(2) == b"ok"
        for s in [conn, late, admitted[1]]:
            s.close()
        assert listener.open == 0
    finally:
        for c in clients:
            c.close()
        listener.close()


def _accept_when_ready(listener: CappedListener) -> tuple[socket.socket, object]:
    import select

    select.select([listener], [], [], 5)
    return listener.accept()


# An asyncio server (the verifier's event loop, without a model) whose protocol holds every connection it is
# given, under an open-file limit of 64 with a cap of 32: 300 idle connections, then a new client.
_SERVER = textwrap.dedent("""
    import asyncio, resource, socket, sys, threading
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    from agentspec.verifier_server.http import CappedListener

    class Hold(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport

    async def main():
        sock = socket.create_server(("127.0.0.1", 0))
        listener = CappedListener(sock, cap=32) if sys.argv[1] == "capped" else sock
        server = await asyncio.get_running_loop().create_server(Hold, sock=listener, backlog=64)
        print(listener.getsockname()[1], flush=True)
        loop, done = asyncio.get_running_loop(), asyncio.Event()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(done.set)), daemon=True).start()
        try:  # until the test closes stdin: a fixed lifetime ran out on a loaded machine before 300 connects
            await asyncio.wait_for(done.wait(), float(sys.argv[2]))
        except TimeoutError:
            pass
        server.close()
    asyncio.run(main())
""")


@pytest.mark.skipif(sys.platform != "linux", reason="open-file limits and asyncio's accept loop as on Linux")
def test_a_flood_never_exhausts_the_descriptors_of_a_capped_server():
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, "capped", "60"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
        new = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert _read_all(new).startswith(b"HTTP/1.1 503")  # answered at once, not left waiting
        new.close()
    finally:
        for s in held:
            s.close()
        _, err = proc.communicate(timeout=30)
    assert "Too many open files" not in err and "out of system resource" not in err, err[-2000:]
