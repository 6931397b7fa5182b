"""The verifier's round loop: rounds from concurrent requests, batched onto the one model thread.

:class:`BatchScheduler` waits (an adaptive window; a lone client never waits) until every active session
has a round queued or the batch is full, then runs them as ONE call of ``VerifierEngine.execute``; each
round's outcome (a reply, or that round's own error) goes back to its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from agentspec.protocol import RoundReply, Sampling
from agentspec.types import DraftProposal
from agentspec.verifier_server.kv_store import Session
from agentspec.verifier_server.metrics import current_request


@dataclass
class RoundItem:
    """One round waiting for the model thread."""

    session: Session
    draft: DraftProposal
    sampling: Sampling
    drafter: Any = None  # server mode: draft on the model thread first
    num_draft_tokens: int = 0
    policy: Any = None  # the server-mode DraftLengthPolicy
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None
    request: Any = None  # the HTTP request's metrics record (metrics.RequestRecord), if any


@dataclass
class ItemOutcome:
    reply: RoundReply | None = None
    error: BaseException | None = None


class BatchScheduler:
    """Collects rounds from concurrent requests and runs them in batches on the model thread."""

    def __init__(self, engine: Any, max_batch_size: int, window_s: float,
                 window_frac: float = 0.25, max_window_s: float = 0.05) -> None:
        self.engine, self.max_batch_size, self.window_s = engine, max(1, max_batch_size), window_s
        self.window_frac, self.max_window_s = window_frac, max(max_window_s, window_s)
        self._queue: list[tuple[RoundItem, int | None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.running = 0
        self._recent: dict[str, float] = {}  # session id -> last submit time
        self._pass_s = 0.0  # EMA of one model pass (sets how long waiting for company may take)
        self._jobs, self._job_ended = 0, 0.0  # foreground model-thread jobs now; when the last one ended

    def _active(self, horizon_s: float = 0.25) -> set[str]:
        """Sessions that submitted a round or got a reply lately (their clients are likely to send the next
        one soon). Counting from the reply matters: from the submit, a pass longer than the horizon would
        drop every session of the last batch, and batches would split for good."""
        now = time.perf_counter()
        for sid in [sid for sid, t in self._recent.items() if now - t > horizon_s]:
            del self._recent[sid]
        return set(self._recent)

    def touch(self, session_id: str) -> None:
        """Mark a session active now (its prefill just ended: its first round is on its way)."""
        self._recent[session_id] = time.perf_counter()

    @contextlib.contextmanager
    def foreground_job(self) -> Iterator[None]:
        """Count a model-thread job a long prefill's next chunk waits for (a batch of rounds, a short
        prefill, a session's creation): queued or running now, or ended just now (its request's next job
        is on its way)."""
        self._jobs += 1
        try:
            yield
        finally:
            self._jobs -= 1
            self._job_ended = time.perf_counter()

    async def yield_to_others(self, own: str, max_wait_s: float, quiet_s: float = 0.02) -> None:
        """Wait, at most ``max_wait_s``, while other requests have model jobs queued or running, or had one
        end (or a round reply) within ``quiet_s``: a long prefill's next chunk then goes after them, so a
        short request waits about one chunk in all, not one per step of its own (tokenize, create, prefill,
        each round)."""
        deadline = time.perf_counter() + max_wait_s
        while (now := time.perf_counter()) < deadline:
            busy = self._jobs or self._queue or now - self._job_ended < quiet_s
            if not busy and not any(sid != own and now - t < quiet_s for sid, t in self._recent.items()):
                return
            await asyncio.sleep(0.002)

    def window(self) -> float:
        """How long a batch may wait for the other active sessions' rounds: a fraction of a model pass
        (their clients' turnaround is usually much shorter), at least the configured window."""
        if self.window_s <= 0:
            return 0.0
        return min(self.max_window_s, max(self.window_s, self.window_frac * self._pass_s))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, item: RoundItem, limit: int | None = None) -> RoundReply:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            # a fresh context: the loop serves every request, it must not carry the first one's metrics record
            self._task = loop.create_task(self._loop(), context=contextvars.Context())
        item.future = loop.create_future()
        item.enqueued = time.perf_counter()
        item.request = current_request()
        self._recent[item.session.id] = item.enqueued
        self._queue.append((item, limit))
        self._wake.set()
        outcome: ItemOutcome = await item.future
        if outcome.error is not None:
            raise outcome.error
        if item.request is not None:
            item.request.output(len(outcome.reply.tokens), outcome.reply.finish_reason)
        return outcome.reply

    async def _gather_company(self) -> None:
        """Wait (up to :meth:`window`) until every active session has a round queued or the batch is full.
        A lone client never waits."""
        active = self._active()
        if len(active) < 2 or len(self._queue) >= self.max_batch_size:
            return
        deadline = time.perf_counter() + self.window()
        while len(self._queue) < self.max_batch_size and not active <= {it.session.id for it, _ in self._queue}:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            while self._queue:
                await self._gather_company()
                batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
                batch = [b for b in batch if not b[0].future.cancelled()]  # its request is gone: no work
                if not batch:
                    continue
                items = [b[0] for b in batch]
                self.running = len(items)
                for it in items:
                    it.session.busy += 1
                    if it.request is not None:  # its first pass starts: a running request from now
                        it.request.started()
                t0 = time.perf_counter()
                try:
                    outcomes = await self.engine.run_on_model(self.engine.execute, items, [b[1] for b in batch])
                except Exception as e:  # the whole pass failed: every item gets the error
                    outcomes = [ItemOutcome(error=e) for _ in items]
                finally:
                    for it in items:
                        it.session.busy -= 1
                    self.running = 0
                elapsed = time.perf_counter() - t0
                self._pass_s = elapsed if self._pass_s == 0 else 0.8 * self._pass_s + 0.2 * elapsed
                done = time.perf_counter()
                for it, out in zip(items, outcomes, strict=True):
                    self._recent[it.session.id] = done  # its client is about to send the next round
                    if not it.future.done():
                        it.future.set_result(out)


class session_guard:
    """One request at a time per session (a second one waits; it then sees the new committed length)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def __aenter__(self) -> None:
        if self.session.async_lock is None:
            self.session.async_lock = asyncio.Lock()
        await self.session.async_lock.acquire()
        self.session.busy += 1

    async def __aexit__(self, *exc: object) -> None:
        self.session.busy -= 1
        self.session.async_lock.release()
