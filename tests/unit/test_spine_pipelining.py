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


@pytest.mark.parametrize(("n", "tokens", "parents"), [
    (6, (10, 20, 11, 21, 12, 22), (-1, -1, 0, 0, 2, 2)),  # room for all of it
    (3, (10, 11, 12), (-1, 0, 1)),  # the chain's depth before any leaf (head(3) would keep 10, 20, 11)
    (4, (10, 20, 11, 12), (-1, -1, 0, 2)),  # then the leaves in order: the shallowest first
    (5, (10, 20, 11, 21, 12), (-1, -1, 0, 0, 2)),
    (1, (10,), (-1,)),
    (0, (), ()),
])
def test_a_capped_round_keeps_the_spine_first_then_leaves_in_order(n, tokens, parents):
    kept = SIBLINGS.within(n)
    assert kept.tokens == tokens and kept.parents == parents
    assert all(p < i for i, p in enumerate(kept.parents))  # topological: every parent before its children


def test_a_capped_round_keeps_the_forced_lead_probs_and_a_prefix_of_each_nodes_children():
    dist = ((1,), (1.0,))
    tree = DraftProposal(tokens=(1, 2, 3, 4, 5, 6), parents=(-1, 0, 1, 1, 1, 2),
                         draft_probs=(None, None, dist, dist, dist, dist), num_forced=2)
    kept = tree.within(5)  # spine 1-2-3-6, then node 2's next child (4) before its last (5)
    assert kept.tokens == (1, 2, 3, 4, 6) and kept.parents == (-1, 0, 1, 1, 2)
    assert kept.num_forced == 2 and kept.draft_probs == (None, None, dist, dist, dist)
    assert tree.within(1).num_forced == 1
    chain = DraftProposal(tokens=(1, 2, 3), num_forced=1)
    assert chain.within(2) == chain.head(2) and chain.within(9) is chain


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
    edge.draft_ahead(run, seg, prop, None, lambda: False)
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


@pytest.mark.parametrize(("committed", "accepted", "depth"), [
    ((10, 11, 12, 99), 3, 3),  # the whole spine, then the target's own token: no position past the spine
    ((10, 21, 99), 2, 2),  # a sibling leaf taken: the path ends there, nothing after it was drafted
    ((10, 11, 99), 2, 3),  # rejected at the third position
    ((99,), 0, 1),  # rejected at the first
    ((10, 11), 2, 2),  # cut short (a stop, the token limit): no next token was judged
])
def test_the_client_reads_a_trees_depth_along_the_targets_path_as_the_server_does(committed, accepted, depth):
    """An edge round's reply says how many draft tokens the target took, not which nodes: the client walks its
    own tree along the committed tokens (:meth:`DraftProposal.depth_along`), as :func:`path_depth` does on the
    server with the verify result."""
    from agentspec.types import VerifyResult
    from agentspec.verify import path_depth

    assert SIBLINGS.depth_along(committed, accepted) == depth
    nodes, node = [], -1
    for tok in committed[:accepted]:
        node = next(i for i, p in enumerate(SIBLINGS.parents) if p == node and SIBLINGS.tokens[i] == tok)
        nodes.append(node)
    nxt = committed[accepted] if len(committed) > accepted else None
    leaf = not any(p == node for p in SIBLINGS.parents)
    result = VerifyResult(tuple(nodes), tuple(committed[:accepted]), nxt, bonus=leaf and nxt is not None)
    assert path_depth(SIBLINGS.parents, result) == depth


def test_an_edge_round_counts_only_the_free_positions_it_drafted_toward_acceptance():
    """The router's γ policy learns per-position acceptance from edge rounds. A width-2 tree of depth 3 has 6
    nodes: a spine taken whole must not count a rejection at position 4 (``min(drafted, accepted + 1)`` did,
    every round, so the estimate fell right past the depth γ last had, and γ stayed there); forced tokens
    are not the policy's positions."""
    policy = ModePolicy()
    for _ in range(6):
        _, reached, accepted = SIBLINGS.free_acceptance(SIBLINGS.depth_along((10, 11, 12, 99), 3), 3)
        policy.observe_round("edge", len(SIBLINGS), 3, 4, wall_s=0.4, server_s=0.38, verify_s=0.38, draft_s=0.0,
                             taken=((len(SIBLINGS.spine()), reached, accepted), (3, 3)))
    assert policy.edge.acceptance.reached == policy.edge.acceptance.accepted == [6, 6, 6]
    assert set(policy.edge.costs.observed) == {6}  # the pass's cost is its nodes', leaves and all
    assert policy.edge.nodes_per_draft == 2.0  # a γ of 3 carried 6 nodes: its pass is priced as 6 nodes'
    assert policy.edge.acceptance.conditional(5)[3] > 0.9  # position 4 inherits, never seen rejected
    forced = DraftProposal(tokens=(5, 6, 10, 11), num_forced=2)
    assert forced.free_acceptance(forced.depth_along((5, 6, 10, 99), 3), 3) == (2, 2, 1)
    assert forced.free_acceptance(forced.depth_along((5, 99), 1), 1) == (2, 0, 0)  # a forced token rejected


def test_a_sibling_leaf_taken_is_path_acceptance_but_breaks_the_spines_hypothesis():
    """A width-2 tree's sibling leaf, when the target takes it, adds a token to the round (path acceptance) but
    the round after it is drafted afresh: the draft ahead assumed the spine. The pipelined γ model weighs its
    odds by the spine's survival, and the guess after the spine is one more position of it."""
    committed = (10, 21, 99)
    assert SIBLINGS.free_acceptance(SIBLINGS.depth_along(committed, 2), 2) == (6, 2, 2)
    assert SIBLINGS.spine_acceptance(committed) == (2, 1)
    assert SIBLINGS.spine_acceptance((10, 11, 12, 13), guess=13) == (4, 4)  # spine and guess right: ready
    assert SIBLINGS.spine_acceptance((10, 11, 12, 14), guess=13) == (4, 3)
    assert SIBLINGS.spine_acceptance((10, 11, 12, 14)) == (3, 3)  # no draft ahead: the guess is not judged
    policy = ModePolicy()
    for _ in range(8):
        policy.observe_round("edge", len(SIBLINGS), 2, 3, wall_s=0.4, server_s=0.38, verify_s=0.38, draft_s=0.0,
                             taken=((3, 2, 2), SIBLINGS.spine_acceptance(committed)))
    assert policy.edge.current_acceptance("text").conditional(2)[1] > 0.8  # the leaf's token was taken
    assert policy.edge.spine_survival("text").conditional(2)[1] < 0.2  # but never the spine's second
