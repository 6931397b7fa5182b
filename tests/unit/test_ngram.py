"""Prompt-lookup drafting: what it proposes, on hand-made contexts."""

from __future__ import annotations

import pytest

from agentspec.drafters import NgramDrafter, make_drafter
from agentspec.drafters.base import DraftContext
from agentspec.drafters.ngram import merge_into_tree


def ctx(tokens, history=()):
    return DraftContext(tokens=list(tokens), num_prompt_tokens=len(tokens), history=[list(h) for h in history])


def test_continues_latest_longest_match():
    d = NgramDrafter(max_ngram=2)
    # "1 2" occurs twice; the latest occurrence is followed by 7 8
    assert d.propose(ctx([1, 2, 3, 4, 1, 2, 7, 8, 9, 1, 2]), 3).tokens == (7, 8, 9)


def test_prefers_longer_ngram():
    d = NgramDrafter(max_ngram=3)
    # "5 1 2" matches at the start (-> 6); "1 2" alone would match later (-> 9)
    assert d.propose(ctx([5, 1, 2, 6, 0, 1, 2, 9, 4, 5, 1, 2]), 1).tokens == (6,)


def test_no_match_gives_empty_draft():
    assert NgramDrafter().propose(ctx([1, 2, 3, 4]), 5).tokens == ()
    assert NgramDrafter().propose(ctx([1]), 5).tokens == ()


def test_history_is_a_copy_source():
    d = NgramDrafter(max_ngram=2)
    assert d.propose(ctx([9, 3, 4], history=[[3, 4, 10, 11]]), 2).tokens == (10, 11)


def test_candidates_merge_into_a_tree():
    d = NgramDrafter(max_ngram=1, max_candidates=3)
    p = d.propose(ctx([1, 5, 6, 1, 5, 7, 1, 8, 1]), 2)
    paths = {(p.tokens[i], p.tokens[j]) for j, i in enumerate(p.parents) if i >= 0}
    assert p.is_tree and paths == {(8, 1), (5, 7), (5, 6)}


def test_trie_shares_prefixes():
    p = merge_into_tree([[1, 2, 3], [1, 2, 4], [5]], source="x")
    assert p.tokens == (1, 2, 3, 4, 5) and p.parents == (-1, 0, 1, 1, -1)


def test_registry_and_validation():
    assert isinstance(make_drafter("ngram", max_ngram=2), NgramDrafter)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("nope")
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)
