"""Trees drafted ahead: a draft's main path (its spine), cuts of a tree at a spine depth, a tail hung below
the spine, and edge rounds with sibling leaves pipelined on the spine's hypothesis, output unchanged."""

from __future__ import annotations

import pytest

from agentspec.client.edge import EdgeDrafting, _join
from agentspec.client.events import SegmentStats
from agentspec.client.run import Run
from agentspec.drafters import DraftContext, ModelDrafter
from agentspec.local import SpecEngine
from agentspec.router import ModePolicy
from agentspec.types import DraftProposal, SamplingParams
from tests.helpers import make_prompt, plain_greedy

# a chain a-b-c with a sibling leaf at each position (x, y, z), as ModelDrafter(tree_width=2) drafts it
SIBLINGS = DraftProposal(tokens=(10, 20, 11, 21, 12, 22), parents=(-1, -1, 0, 0, 2, 2), num_forced=0)


def test_the_spine_is_the_first_root_then_each_first_child():
    assert SIBLINGS.spine() == [0, 2, 4]
    assert DraftProposal(tokens=(1, 2, 3)).spine() == [0, 1, 2]
    assert DraftProposal().spine() == []
    merged = DraftProposal(tokens=(1, 2, 3, 7, 8), parents=(-1, 0, 1, 0, 3))  # a copy branch after node 0
    assert merged.spine() == [0, 1, 2]


@pytest.mark.parametrize(("start", "stop", "tokens", "parents"), [
    (0, 3, (10, 20, 11, 21, 12, 22), (-1, -1, 0, 0, 2, 2)),  # all of it
    (0, 2, (10, 20, 11, 21), (-1, -1, 0, 0)),  # two positions, with their leaves
    (1, 3, (11, 21, 12, 22), (-1, -1, 0, 0)),  # under the first spine node: its siblings go
    (2, 3, (12, 22), (-1, -1)),
    (3, 3, (), None),
])
def test_a_cut_keeps_the_subtree_under_a_spine_node_to_a_depth(start, stop, tokens, parents):
    cut = SIBLINGS.cut(start, stop)
    assert cut.tokens == tokens and cut.parents == parents


def test_a_cut_of_a_chain_shifts_the_forced_lead():
    chain = DraftProposal(tokens=(1, 2, 3, 4), num_forced=2)
    assert (chain.cut(1, 4).tokens, chain.cut(1, 4).num_forced) == ((2, 3, 4), 1)
    assert chain.cut(0, 1).num_forced == 1


def test_a_tail_hangs_below_the_spines_last_node():
    tail = DraftProposal(tokens=(13, 23), parents=(-1, -1))
    joined = _join(SIBLINGS, tail)
    assert joined.tokens == (*SIBLINGS.tokens, 13, 23) and joined.parents[-2:] == (4, 4)
    assert [joined.tokens[i] for i in joined.spine()] == [10, 11, 12, 13]
    chain = _join(DraftProposal(tokens=(1, 2)), DraftProposal(tokens=(3,)))
    assert chain.tokens == (1, 2, 3) and not chain.is_tree


def test_a_tree_round_drafts_the_next_one_ahead_on_its_spine(target):
    """With sibling leaves, the round after is drafted ahead assuming the spine is accepted and the guess
    follows; when that holds, the next round sends that draft (leaves included) for no drafting."""
    tokens = make_prompt(2)
    drafter = ModelDrafter(target, tree_width=2)
    run = Run([{"role": "user", "content": "x"}], None, 64, SamplingParams(), (), "edge", drafter)
    run.prompt, run.tokens = list(tokens), list(tokens)
    seg = SegmentStats("edge", 0, 0, 0, 0, 0.0, 0.0, 0.0, {}, "text")
    edge = EdgeDrafting(4, True, None, preview=False)
    prop = edge.round(run, seg, ModePolicy()).prop
    assert prop.is_tree and edge.pipelines(run, prop)
    edge.draft_ahead(run, seg, prop, lambda: False)
    spine = [prop.tokens[i] for i in prop.spine()]
    guess = run.ahead[0][-1]
    assert run.ahead[0] == (*tokens, *spine, guess)
    run.tokens = list(run.ahead[0])  # the spine was accepted, then the guess
    sent = edge.round(run, seg, ModePolicy()).prop
    fresh = ModelDrafter(target, tree_width=2).propose(DraftContext(run.tokens, len(tokens)), 4)
    assert seg.pipelined == 1 and (sent.tokens, sent.parents) == (fresh.tokens, fresh.parents)


@pytest.mark.parametrize("drafter_is_target", [True, False])
def test_sibling_leaves_leave_the_output_plain_greedy(target, wrong_drafter_model, drafter_is_target):
    for seed in (1, 4):
        prompt = make_prompt(seed)
        drafter = ModelDrafter(target if drafter_is_target else wrong_drafter_model, tree_width=2)
        out = SpecEngine(target, drafter, num_draft_tokens=4).generate(prompt, SamplingParams(max_new_tokens=40))
        assert out.tokens == plain_greedy(target, prompt, 40)
