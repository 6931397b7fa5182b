"""Prompt-lookup drafting: continue the longest recent n-gram match found earlier in the context.

No model, no state: the committed tokens (and any earlier sequences of the same conversation) are the
only source. With ``max_candidates > 1`` the continuations of several different matches are merged into
a token tree (a trie), verified in one pass.
"""

from __future__ import annotations

import numpy as np

from agentspec.drafters.base import DraftContext, TokenTrie, register_drafter
from agentspec.types import DraftProposal


@register_drafter("ngram")
class NgramDrafter:
    """Copy the continuation of the latest earlier occurrence of the context's last n tokens.

    Tries n from ``max_ngram`` down to ``min_ngram``; the first n with a non-empty continuation wins.
    """

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_candidates: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.max_ngram, self.min_ngram, self.max_candidates = max_ngram, min_ngram, max_candidates

    def reset(self) -> None:
        pass

    def shadow(self) -> NgramDrafter | None:
        """A fresh copy the router may replay over committed text (a chain lookup: ``max_candidates ==
        1``), or None when this drafter proposes trees."""
        return NgramDrafter(self.max_ngram, self.min_ngram) if self.max_candidates == 1 else None

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        if k <= 0 or len(ctx.tokens) < self.min_ngram + 1:
            return DraftProposal(source=self.name)
        return merge_into_tree(self.candidates(ctx.tokens, k, extra=ctx.history), source=self.name)

    def candidates(self, tokens: list[int], k: int, extra: list[list[int]] = ()) -> list[list[int]]:
        """Up to ``max_candidates`` distinct continuations (most recent match first) of length <= k."""
        context = np.asarray(tokens, dtype=np.int64)
        sources = [context] + [np.asarray(h, dtype=np.int64) for h in extra]
        found: list[list[int]] = []
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = context[-n:]
            for source in sources:
                for start in _match_starts(source, pattern)[::-1]:
                    cont = source[start + n : start + n + k].tolist()
                    if cont and cont not in found:
                        found.append(cont)
                        if len(found) >= self.max_candidates:
                            return found
            if found:
                return found
        return found


def _match_starts(source: np.ndarray, pattern: np.ndarray) -> np.ndarray:
    """Ascending starts of ``pattern`` in ``source`` with a token after it (so never the context's own tail)."""
    n = len(pattern)
    if len(source) <= n:
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(source[:-1], n)  # [len - n, n]
    return np.flatnonzero((windows == pattern).all(axis=1))


def merge_into_tree(candidates: list[list[int]], source: str) -> DraftProposal:
    """Token sequences as one proposal: a chain for one, else a trie in topological (insertion) order."""
    if len(candidates) <= 1:
        return DraftProposal(tokens=tuple(candidates[0]) if candidates else (), source=source)
    trie = TokenTrie()
    for seq in candidates:
        trie.add_chain(seq)
    return DraftProposal(tokens=tuple(trie.tokens), parents=tuple(trie.parents), source=source)
