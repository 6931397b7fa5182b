"""Which verifiers a client should use now: a failed one is skipped for a backoff that doubles with each
failure in a row (``BASE_S`` … ``MAX_S``), then re-admitted — the next request's session open is its health
check, and a success clears its record. Failover may go back to an earlier verifier that recovered."""

from __future__ import annotations

import threading
import time

BASE_S, MAX_S = 1.0, 30.0


class VerifierHealth:
    """Failure records of ``n`` verifiers (indices into a client's transports); thread-safe."""

    def __init__(self, n: int, base_s: float = BASE_S, max_s: float = MAX_S) -> None:
        self.n, self.base_s, self.max_s = n, base_s, max_s
        self._down: dict[int, tuple[float, float]] = {}  # index -> (usable again at, current backoff)
        self._lock = threading.Lock()

    def failed(self, i: int) -> None:
        """Verifier ``i`` failed: skip it for twice its last backoff (the base one the first time)."""
        with self._lock:
            backoff = min(self._down[i][1] * 2, self.max_s) if i in self._down else self.base_s
            self._down[i] = (time.monotonic() + backoff, backoff)

    def ok(self, i: int) -> None:
        """Verifier ``i`` answered: it is healthy again."""
        with self._lock:
            self._down.pop(i, None)

    def usable(self, i: int) -> bool:
        with self._lock:
            return i not in self._down or self._down[i][0] <= time.monotonic()

    def first(self) -> int | None:
        """The first usable verifier, in the configured order (None: all are backing off)."""
        return next((i for i in range(self.n) if self.usable(i)), None)

    def after(self, i: int) -> int | None:
        """The next usable verifier after ``i``, wrapping around (earlier ones may have recovered)."""
        return next((j for j in ((i + k) % self.n for k in range(1, self.n)) if self.usable(j)), None)

    def soonest(self) -> int:
        """The verifier whose backoff ends first (when every one is backing off and there is no fallback)."""
        with self._lock:
            return min(range(self.n), key=lambda i: self._down.get(i, (0.0, 0.0))[0])
