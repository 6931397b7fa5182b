"""Copy drafting: continue the longest earlier match of the context's tail.

Sources: the committed tokens, earlier steps of the conversation (``DraftContext.history``) and a bounded
per-key :class:`SuffixIndex` of past outputs. The proposal grows with the match length (SuffixDecoding:
acceptance rises with it): a 1-token match proposes 1 token, a long match the full ``k``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from agentspec.drafters.base import DraftContext, register_drafter
from agentspec.drafters.ngram import merge_into_tree
from agentspec.types import DraftProposal

LEAD = 6  # prompt tokens kept before each remembered output


class SuffixIndex:
    """Past outputs per key (an API key, a tenant), bounded by ``max_tokens`` in total, oldest out first.

    Thread-safe: the verifier server adds from its model thread while request handlers read.
    """

    def __init__(self, max_tokens: int = 1 << 20, max_per_key: int = 256) -> None:
        if max_tokens < 1 or max_per_key < 1:
            raise ValueError("max_tokens and max_per_key must be >= 1")
        self.max_tokens, self.max_per_key = max_tokens, max_per_key
        self._items: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._count: dict[str, int] = {}
        self._next = 0
        self.num_tokens = 0
        self._lock = threading.Lock()

    def add(self, tokens: list[int], key: str = "", lead: list[int] = ()) -> None:
        """Remember one output under ``key`` (outputs shorter than 2 tokens carry nothing to copy).

        ``lead``: the few prompt tokens before the output (e.g. ``<|im_start|>assistant\n``), so the next
        answer's first tokens match too — agents open their answers the same way."""
        if len(tokens) < 2:
            return
        arr = np.asarray((list(lead) + list(tokens))[-self.max_tokens :], dtype=np.int64)
        with self._lock:
            self._items[(key, self._next)] = arr
            self._next += 1
            self._count[key] = self._count.get(key, 0) + 1
            self.num_tokens += len(arr)
            while self.num_tokens > self.max_tokens or self._count[key] > self.max_per_key:
                victim = next((k for k in self._items if k[0] == key), None) \
                    if self._count[key] > self.max_per_key else next(iter(self._items))
                self.num_tokens -= len(self._items.pop(victim))
                self._count[victim[0]] -= 1

    def sources(self, key: str = "") -> list[np.ndarray]:
        """The outputs remembered under ``key``, newest first."""
        with self._lock:
            return [a for (k, _), a in reversed(self._items.items()) if k == key]


@register_drafter("copy")
class CopyDrafter:
    """Copy the continuation of the longest suffix match over the context, history and past outputs."""

    name = "copy"

    def __init__(self, index: SuffixIndex | None = None, max_match: int = 32, min_match: int = 1,
                 length_per_match: float = 2.0, max_candidates: int = 1) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if length_per_match <= 0 or max_candidates < 1:
            raise ValueError("length_per_match must be > 0 and max_candidates >= 1")
        self.index = index
        self.max_match, self.min_match = max_match, min_match
        self.length_per_match, self.max_candidates = length_per_match, max_candidates

    def reset(self) -> None:
        pass

    def remember(self, ctx: DraftContext) -> None:
        """Add the finished answer (``ctx.tokens`` after the prompt) to the cross-conversation index."""
        if self.index is not None:
            start = ctx.num_prompt_tokens
            self.index.add(ctx.tokens[start:], ctx.index_key, lead=ctx.tokens[max(start - LEAD, 0) : start])

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        return merge_into_tree([c for _, c in self.candidates(ctx, k)], source=self.name)

    def candidates(self, ctx: DraftContext, k: int, tokens: list[int] | None = None) -> list[tuple[int, list[int]]]:
        """Up to ``max_candidates`` distinct (match length, continuation) pairs, longest match first.

        ``tokens`` overrides ``ctx.tokens`` (e.g. the context extended by grammar-forced tokens)."""
        tokens = ctx.tokens if tokens is None else tokens
        if k <= 0 or len(tokens) < self.min_match + 1:
            return []
        context = np.asarray(tokens, dtype=np.int64)
        tail = context[-self.max_match :][::-1]  # tail[d] = the token d places before the end
        sources = [context] + [np.asarray(h, dtype=np.int64) for h in ctx.history]
        if self.index is not None:
            sources += self.index.sources(ctx.index_key)
        scored: list[tuple[int, int, int, int]] = []  # (match length, -source order, end, source)
        for si, src in enumerate(sources):
            ends, lengths = _suffix_matches(src, tail)
            for e, n in zip(ends.tolist(), lengths.tolist(), strict=True):
                if n >= self.min_match:
                    scored.append((n, -si, e, si))
        scored.sort(reverse=True)  # longest match first; then the context, then recent sources; latest end
        out: list[tuple[int, list[int]]] = []
        for n, _, end, si in scored:
            length = min(k, max(1, int(round(self.length_per_match * n)) - 1))
            cont = sources[si][end + 1 : end + 1 + length].tolist()
            if cont and all(cont != c for _, c in out):
                out.append((n, cont))
                if len(out) >= self.max_candidates:
                    break
        return out


def _suffix_matches(source: np.ndarray, tail: np.ndarray, limit: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """For the latest ``limit`` positions e of ``source`` with a token after them and
    ``source[e] == tail[0]``: e and the length of the match of ``source[..e]`` against ``tail``."""
    if len(source) < 2 or len(tail) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(source[:-1] == tail[0])[-limit:]
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for d in range(1, len(tail)):
        idx = ends - d
        ok = alive & (idx >= 0)
        ok[ok] = source[idx[ok]] == tail[d]
        if not ok.any():
            break
        lengths += ok
        alive = ok
    return ends, lengths
