"""A delaying TCP proxy on loopback: real network delay for tests and benchmarks without ``tc netem``.

Every chunk travelling in either direction is held for ``one_way_delay_s`` (+ uniform jitter) from the
moment it arrives, so a request/response pair costs one RTT = 2 × the one-way delay, and bandwidth is not
throttled (chunks in flight overlap). Runs its own event loop in a daemon thread::

    with DelayProxy("127.0.0.1", server_port, one_way_delay_s=0.010) as proxy:
        client = SpecClient(f"http://127.0.0.1:{proxy.port}")
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time


class DelayProxy:
    """Forward ``127.0.0.1:<port>`` to ``host:port`` with a fixed one-way delay in both directions."""

    def __init__(self, host: str, port: int, one_way_delay_s: float, jitter_s: float = 0.0, seed: int = 0) -> None:
        if one_way_delay_s < 0 or jitter_s < 0:
            raise ValueError("delays must be >= 0")
        self.host, self.target_port = host, port
        self.delay, self.jitter = one_way_delay_s, jitter_s
        self._rng = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    @property
    def rtt_s(self) -> float:
        return 2 * self.delay

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        fut.result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:  # open connections: cut them, so nothing is left pending when the loop stops
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.close()
            return
        # When the proxy stops it cancels this handler: end quietly (asyncio would log a cancelled handler).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(65536)
                jitter = self._rng.uniform(0, self.jitter) if self.jitter else 0.0
                await queue.put((time.monotonic() + self.delay + jitter, data))
                if not data:
                    break
            await sender
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            writer.close()
