"""vLLM-style periodic stats log: every ``--log-stats-interval`` seconds one INFO line with the interval's
prompt and generation throughput, the requests running and waiting, KV-cache use, the prefix-cache hit rate and
the speculative-decoding acceptance; nothing while the server is idle.

It reads the plain running totals :class:`~agentspec.verifier_server.metrics.Metrics` keeps next to its
Prometheus series, so the log and ``/metrics`` always agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger("agentspec.verifier")


class StatsLogger:
    """Logs the interval's stats from a task on the server's event loop (started by the first request)."""

    def __init__(self, engine: Any, interval_s: float) -> None:
        """``interval_s`` <= 0 disables the periodic task (:meth:`tick` still works when called)."""
        self.engine, self.interval_s = engine, interval_s
        self._task: asyncio.Task | None = None
        self._last = self._snapshot()
        self._last_t = time.perf_counter()

    def _snapshot(self) -> dict[str, int]:
        metrics = self.engine.metrics
        return dict(metrics.totals) if metrics is not None else {}

    def start(self) -> None:
        """Start the periodic task once, on the running event loop (called on every request; cheap)."""
        if self._task is None and self.interval_s > 0 and self.engine.metrics is not None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.tick()
            except Exception:  # a broken stats line must not stop the next ones (or the server)
                log.exception("could not log stats")

    def tick(self) -> str | None:
        """Log (and return) the line for the interval since the last tick; None (no line) when nothing ran,
        nothing was generated and no request is in flight."""
        metrics = self.engine.metrics
        if metrics is None:
            return None
        now, snap = time.perf_counter(), self._snapshot()
        d = {k: snap[k] - self._last.get(k, 0) for k in snap}
        dt = max(now - self._last_t, 1e-9)
        self._last, self._last_t = snap, now
        running, waiting = metrics.running, metrics.waiting
        if not any(d.values()) and not running and not waiting:
            return None
        queried = d["prompt"] + d["prompt_reused"]
        kv = self.engine.store.used_bytes / max(self.engine.config.kv_cache_memory, 1)
        if d["drafts"]:  # vLLM's definitions: 1 (the bonus token) + accepted per draft; accepted / drafted
            spec = (f"mean accepted length {1 + d['accepted'] / d['drafts']:.2f}, "
                    f"draft acceptance rate {100 * d['accepted'] / max(d['draft_tokens'], 1):.1f}%")
        else:
            spec = "no drafts"
        line = (f"Avg prompt throughput: {d['prompt'] / dt:.1f} tokens/s, "
                f"Avg generation throughput: {d['generation'] / dt:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, KV cache usage: {100 * kv:.1f}%, "
                f"Prefix cache hit rate: {100 * d['prompt_reused'] / queried if queried else 0.0:.1f}%, "
                f"Spec decode: {spec}")
        log.info("%s", line)
        return line
