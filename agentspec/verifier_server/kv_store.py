"""Sessions and their KV caches: ownership by API key, LRU eviction under a memory cap, prefix reuse.

A :class:`Session` holds the committed tokens and the target's KV cache for a prefix of them
(``num_cached`` positions, always ``tokens[:num_cached]``). Closed sessions stay in the store as
reusable prefixes until memory is needed. The store never guesses: an evicted id is remembered (for a
while) so the client gets ``session_evicted`` and resends its prefix.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec import models
from agentspec.protocol import SESSION_EVICTED, SESSION_NOT_FOUND, ProtocolError, Sampling


def key_owner(api_key: str | None) -> str:
    """A stable, non-reversible owner tag for an API key (sessions never store the key itself)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


@dataclass
class Session:
    """Server-side state of one sequence."""

    id: str
    owner: str
    tokens: list[int]
    num_prompt_tokens: int
    cache: Any
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    num_cached: int = 0
    closed: bool = False
    busy: int = 0  # rounds in flight; a busy session is never evicted
    last_used: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    finished: bool = False
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    seed: int | None = None
    async_lock: Any = None  # asyncio.Lock, created on the server's event loop
    decoder: Any = None  # IncrementalDecoder of the generated text (the replies' ``text``)
    drafter: Any = None  # server mode: this session's drafter (with its own KV cache)
    drafter_kind: str = ""  # which kind ``drafter`` is (the Generate request's ``drafter``)
    structure: tuple[Any, Any, Any] = (None, None, None)  # (tools, tool_choice, response_format): grammar drafting
    constraint: Any = None  # agentspec.constraint.Constraint: the grammar every answer is decoded under

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    def rng(self, sampling: Sampling) -> torch.Generator | None:
        """The generator sampled rounds draw from (None for greedy ones), reseeded when a request sets a new
        seed: one stream per session, so a seeded answer is reproducible round after round."""
        if sampling.greedy:
            return None
        if self.generator is None or sampling.seed is not None and self.seed != sampling.seed:
            self.generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else torch.seed())
            self.seed = sampling.seed
        return self.generator


class KVStore:
    """All sessions of one server, under a session-count and a KV-memory cap."""

    def __init__(self, model: Any, max_sessions: int, capacity_bytes: int, remember_evicted: int = 4096) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.model = model
        self.max_sessions = max_sessions
        self.capacity_bytes = capacity_bytes
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_evicted
        self._lock = threading.RLock()
        self.evictions = 0
        self.bytes_per_token = 0  # KV bytes per cached position (set by the engine after its warm-up)
        # Each round re-allocates a session's KV and glibc keeps the freed pages, so RSS creeps above the
        # cap: after this many freed bytes they go back to the OS, but only while RSS is above
        # ``rss_soft_limit`` (weights + cap): the next round page-faults its cache back in (84-90 vs 66-74 ms
        # per step, SmolLM2-135M, 600 tokens). KV on a GPU does not live on the heap.
        on_cpu = getattr(getattr(model, "device", None), "type", "cpu") == "cpu"
        self.trim_every_bytes = 16 * 1024**2 if on_cpu else None
        self.rss_soft_limit: int | None = None
        self.trims = 0
        self._churn = 0

    # -- lookup ------------------------------------------------------------------------------------

    def get(self, session_id: str, owner: str) -> Session:
        """The open session ``session_id`` of ``owner``; another key's session is reported as not found."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None or s.closed or not hmac.compare_digest(s.owner, owner):
                if session_id in self._evicted:
                    raise ProtocolError(f"session {session_id} was evicted (KV memory or session limit); open "
                                        "a new session with your full prefix", code=SESSION_EVICTED, status=404)
                raise ProtocolError(f"no open session {session_id} for this API key; open a new session with "
                                    "your full prefix", code=SESSION_NOT_FOUND, status=404)
            s.last_used = time.monotonic()
            self._sessions.move_to_end(session_id)
            return s

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._sessions.values())

    def num_open(self) -> int:
        with self._lock:
            return sum(not s.closed for s in self._sessions.values())

    # -- lifecycle ---------------------------------------------------------------------------------

    def create(self, owner: str, tokens: list[int], max_new_tokens: int, stop_token_ids: frozenset[int]
               ) -> tuple[Session, int]:
        """(a new session for ``tokens``, positions reused from ``owner``'s longest cached prefix).

        Room for the whole prompt's KV is made *before* the prefill (never evicting the prefix donor), so
        the cap holds while the new cache grows."""
        with self._lock:
            donor, reuse = self._best_prefix(owner, tokens)
            keep = donor.id if donor is not None else None
            self._make_room_for_session(owner, keep)  # at the session cap, an agent's last step is its donor
            need = self.bytes_per_token * models.spare_positions(len(tokens))  # the room its buffers keep
            if need:
                self._evict_until(self.capacity_bytes - need, owner, keep=keep)
            cache = models.new_cache(self.model, spare=True)  # rounds append in place: no copy of the cache
            if donor is not None and reuse > 0:
                cache = models.copy_cache_prefix(self.model, donor.cache, reuse, spare=True)
            session = Session(id="s-" + secrets.token_urlsafe(12), owner=owner, tokens=list(tokens),
                              num_prompt_tokens=len(tokens), cache=cache, max_new_tokens=max_new_tokens,
                              stop_token_ids=stop_token_ids, num_cached=reuse)
            session.nbytes = models.cache_nbytes(cache)
            self._sessions[session.id] = session
            return session, reuse

    def close(self, session_id: str, owner: str) -> None:
        """Close a session; its KV stays as a reusable prefix until memory is needed."""
        with self._lock:
            self.release(self.get(session_id, owner))

    def release(self, session: Session) -> None:
        """Close ``session`` if it is still stored (no error if it was evicted meanwhile)."""
        with self._lock:
            if self._sessions.get(session.id) is session:
                session.closed = True
                self._sessions.move_to_end(session.id, last=False)  # first to go when memory is needed

    def drop(self, session_id: str) -> None:
        """Forget a session entirely (e.g. one created for a single OpenAI request)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def update_size(self, session: Session) -> None:
        """Re-measure a session's KV bytes after a round and evict others if over the cap."""
        with self._lock:
            nbytes = models.cache_nbytes(session.cache)
            self._churn += max(session.nbytes, nbytes)  # what this round (or a chunked prefill) freed, roughly
            session.nbytes = nbytes
            evicted = self._evict_until(self.capacity_bytes, session.owner, keep=session.id)
            if not evicted and self.trim_every_bytes is not None and self._churn > self.trim_every_bytes:
                rss = rss_bytes()
                if self.rss_soft_limit is None or rss is None or rss > self.rss_soft_limit:
                    _return_freed_memory()
                    self.trims += 1
                self._churn = 0

    # -- internals ---------------------------------------------------------------------------------

    def _best_prefix(self, owner: str, tokens: list[int]) -> tuple[Session | None, int]:
        """The owner's session sharing the longest cached prefix with ``tokens`` (at most len - 1)."""
        best, best_len = None, 0
        limit = len(tokens) - 1  # the last prompt token is always run, to get its logits
        for s in self._sessions.values():
            if s.owner != owner or s.busy:
                continue
            n = _common_prefix_len(s.tokens, tokens, min(s.num_cached, limit))
            if n > best_len:
                best, best_len = s, n
        return best, best_len

    def _make_room_for_session(self, owner: str, keep: str | None = None) -> None:
        while len(self._sessions) >= self.max_sessions:
            victim = self._victim(owner, keep)
            if victim is None:
                mine = sum(s.owner == owner and not s.closed for s in self._sessions.values())
                raise ProtocolError(f"all {self.max_sessions} sessions (--max-sessions) are busy or other API "
                                    f"keys' fair share (this key holds {mine} open); close sessions you no longer "
                                    "need, or retry shortly", code="server_busy", status=503)
            self._evict(victim)

    def _evict_until(self, capacity: int, owner: str, keep: str | None = None) -> bool:
        """Evict sessions (see :meth:`_victim`) until the KV bytes fit ``capacity``; True if any went."""
        used = self.used_bytes
        evicted = False
        while used > capacity:
            victim = self._victim(owner, keep)
            if victim is None:
                break  # only busy sessions left: they finish their round, then become evictable
            used -= victim.nbytes
            self._evict(victim)
            evicted = True
        if evicted:
            _return_freed_memory()
            self._churn = 0
        return evicted

    def _victim(self, owner: str, keep: str | None = None) -> Session | None:
        """The session to evict to make room for ``owner`` (fair between API keys, LRU within one).

        Closed sessions (reusable prefixes only) go first: ``owner``'s own, then those of the key holding
        the most KV bytes. Then the open sessions of another key holding more than its fair share
        (``max_sessions`` or the KV cap split evenly over the keys with open sessions), the heaviest key's
        first; then ``owner``'s own idle sessions. So one key's flood evicts its own sessions, never a
        tenant within its share."""
        idle = [s for s in self._sessions.values() if not s.busy and s.id != keep]  # LRU order
        closed = [s for s in idle if s.closed]
        held: dict[str, list[int]] = {}  # owner -> [open sessions, bytes]
        for s in self._sessions.values():
            h = held.setdefault(s.owner, [0, 0])
            h[0] += not s.closed
            h[1] += s.nbytes
        if closed:
            mine = [s for s in closed if s.owner == owner]
            return mine[0] if mine else max(closed, key=lambda s: held[s.owner][1])
        keys = len({o for o, h in held.items() if h[0]} | {owner})
        over = [s for s in idle if s.owner != owner and (held[s.owner][0] > self.max_sessions / keys
                                                         or held[s.owner][1] > self.capacity_bytes / keys)]
        if over:
            return max(over, key=lambda s: held[s.owner][1])
        mine = [s for s in idle if s.owner == owner]
        return mine[0] if mine else None

    def _evict(self, s: Session) -> None:
        self._sessions.pop(s.id, None)
        s.cache = s.drafter = None
        if not s.closed:
            self._evicted[s.id] = None
            while len(self._evicted) > self._remember:
                self._evicted.popitem(last=False)
        self.evictions += 1


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None


def rss_bytes() -> int | None:
    """This process's resident set size now (Linux ``/proc/self/statm``), or None where unknown."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _return_freed_memory() -> None:
    """Give freed heap pages back to the OS (glibc's ``malloc_trim``; a no-op where there is none)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = 0
    while n < min(limit, len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def snapshot(session: Session) -> Callable[[], None]:
    """A function putting ``session`` back as it is now: committed tokens, turn start, finish state, text
    decoder, RNG (a sampled round may draw before it fails). The KV cache needs no copy: a failed round
    crops it back to ``num_cached`` itself (:meth:`VerifierEngine.execute`), and drafters follow the
    committed tokens."""
    n, prompt, finished, reason = len(session.tokens), session.num_prompt_tokens, session.finished, \
        session.finish_reason
    cached = session.num_cached
    decoder, generator, seed = session.decoder, session.generator, session.seed
    state = generator.get_state() if generator is not None else None

    def restore() -> None:
        del session.tokens[n:]
        session.num_prompt_tokens, session.finished, session.finish_reason = prompt, finished, reason
        session.decoder, session.generator, session.seed = decoder, generator, seed
        if generator is not None:
            generator.set_state(state)
        if session.num_cached != cached or models.cache_length(session.cache) > cached:
            models.crop_cache(session.cache, cached)  # a commit that wrote before the failure: undo its KV too
            session.num_cached = cached

    return restore
