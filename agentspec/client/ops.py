"""The I/O a request's steps ask for, and the two drivers that perform it: one segment loop, sync or async.

A request runs as one generator of *steps* that yields events and I/O requests and is sent each result
(or has its error thrown in). A :class:`Call` names both forms of one operation (``fn`` blocking, ``afn``
async), so a step is written once. :func:`drive` runs ``fn`` on the caller's thread; :func:`adrive` awaits
``afn``, and runs calls with no ``afn`` (local drafting) on a client-owned thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

Steps = Generator[Any, Any, None]  # yields events and I/O requests; is sent each request's result


class Pools(dict):
    """The client's one-thread pools by name, made on first use: ``"io"`` (sync pipelining), ``"draft"``."""

    def __missing__(self, name: str) -> ThreadPoolExecutor:
        pool = self[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"agentspec-{name}")
        return pool


@dataclass(frozen=True)
class Call:
    """``fn(*args)`` with blocking I/O, ``afn(*args)`` (awaited when awaitable) with async I/O; without
    ``afn`` (local drafting) ``fn`` runs on the drafting thread."""

    fn: Callable[..., Any]
    afn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()

    def run(self, pools: Pools) -> Any:
        return self.fn(*self.args)

    async def arun(self, pools: Pools) -> Any:
        if self.afn is None:
            return await asyncio.get_running_loop().run_in_executor(pools["draft"], self.fn, *self.args)
        result = self.afn(*self.args)
        return await result if inspect.isawaitable(result) else result  # an async generator is not awaited


@dataclass(frozen=True)
class WhileDrafting:
    """A request in flight while local drafting runs: ``post`` while ``draft`` runs; the result is (reply,
    draft's). ``until_reply``: ``draft`` is also passed a last argument, a thread-safe callable that turns
    true once the reply is in (so it can stop early)."""

    post: Call
    draft: Call
    until_reply: bool = False

    def run(self, pools: Pools) -> tuple[Any, Any]:
        pending = pools["io"].submit(self.post.run, pools)
        draft = Call(self.draft.fn, None, (*self.draft.args, pending.done)) if self.until_reply else self.draft
        drafted = draft.run(pools)
        return pending.result(), drafted

    async def arun(self, pools: Pools) -> tuple[Any, Any]:
        pending = asyncio.ensure_future(self.post.arun(pools))
        draft = self.draft
        if self.until_reply:  # the drafting thread may not ask the event loop's future: it asks an Event
            arrived = threading.Event()
            pending.add_done_callback(lambda _: arrived.set())
            draft = Call(self.draft.fn, None, (*self.draft.args, arrived.is_set))
        try:
            drafted = await draft.arun(pools)
        except BaseException:
            pending.cancel()
            raise
        return await pending, drafted


def _advance(steps: Steps, outcome: tuple[Any, Exception | None]) -> Any:
    """The steps' next event or I/O request after sending the last outcome in; None once they are done."""
    value, error = outcome
    try:
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration:
        return None


def drive(steps: Steps, pools: Pools, last: Callable[[], Call | None]) -> Iterator[Any]:
    """Run ``steps`` with blocking I/O on this thread, yielding their events; then ``last()``, however
    they ended (also when the consumer stops early)."""
    outcome: tuple[Any, Exception | None] = (None, None)
    try:
        while (item := _advance(steps, outcome)) is not None:
            outcome = (None, None)
            if isinstance(item, Call | WhileDrafting):
                try:
                    outcome = (item.run(pools), None)
                except Exception as e:  # thrown into the steps
                    outcome = (None, e)
            else:
                yield item
    finally:
        steps.close()  # their own cleanup runs now, then the call that ends the request
        if (call := last()) is not None:
            call.run(pools)


async def adrive(steps: Steps, pools: Pools, last: Callable[[], Call | None]) -> AsyncIterator[Any]:
    """Run ``steps`` with async I/O on the running event loop, yielding their events; then ``last()``."""
    outcome: tuple[Any, Exception | None] = (None, None)
    try:
        while (item := _advance(steps, outcome)) is not None:
            outcome = (None, None)
            if isinstance(item, Call | WhileDrafting):
                try:
                    outcome = (await item.arun(pools), None)
                except Exception as e:  # thrown into the steps
                    outcome = (None, e)
            else:
                yield item
    finally:
        steps.close()
        if (call := last()) is not None:
            await call.arun(pools)
