"""The router's edge shadow: while auto runs another mode, the local model drafter's catch-up also notes its
greedy choice after each token of the answer, and edge's rounds over that text are replayed from those
choices (exactly what its chain would have drafted, under greedy decoding), so edge's estimate follows the
text in hand instead of resting on its last probe."""

from __future__ import annotations

import pytest

from agentspec import models, router
from agentspec.client.edge import EdgeDrafting
from agentspec.client.events import SegmentStats
from agentspec.client.run import Run
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import DraftContext, catch_up, known_next
from agentspec.drafters.replay import replay_chain, replay_known_next
from agentspec.drafters.tree import default_drafter
from agentspec.types import SamplingParams
from tests.helpers import make_prompt, plain_greedy


def test_replay_known_next_counts_whole_rounds_only():
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    #            after:  9  1  2  3  4  5  6  7
    nxt = [1, 2, 0, 4, 5, 6, 0, 8]  # right after 9, 1, 3, 4, 5, 7; wrong after 2 and 6
    r = replay_known_next(nxt, tokens, 1, gamma=3)
    # round 1 at 1: accepts 1, 2, then 0 != 3 -> commits 1 2 3; round 2 at 4: accepts 4 5 6 (γ) -> + bonus 7;
    # round 3 at 8: accepts 8, then runs past the text: not counted
    assert (r.rounds, r.tokens, r.accepted, r.drafted, r.gammas) == (2, 7, 5, 6, [3, 3])
    unknown = [1, 2, -1, 4, 5, 6, 0, 8]
    assert replay_known_next(unknown, tokens, 1, gamma=3).rounds == 0  # round 1 needs the choice after 2
    assert replay_known_next(nxt[:4], tokens, 1, gamma=3).rounds == 1  # only what is known
    assert replay_known_next(nxt, tokens, 1, gamma=0).rounds == 0
    with pytest.raises(ValueError, match="start"):
        replay_known_next(nxt, tokens, 0, gamma=3)


@pytest.mark.parametrize("tree", [False, True])
def test_a_catch_up_notes_the_greedy_chain_exactly(target, tree):
    """Teacher-forced choices from a catch-up replay the drafter's rounds as running it would: the same
    rounds, tokens and accepted drafts as replay_chain, which really drafts (the target's first layer
    drafts: some rounds fail part-way)."""
    prompt = make_prompt(3)
    tokens = prompt + plain_greedy(target, prompt, 24, eos=None)
    small = models.layer_skip_drafter(target, 1)
    model = ModelDrafter(small)
    drafter = default_drafter(target.tokenizer, model) if tree else model
    catch_up(drafter, tokens + [0], next_from=len(prompt) - 1)
    nxt = known_next(drafter, tokens)
    assert nxt[: len(prompt) - 1] == [-1] * (len(prompt) - 1) and min(nxt[len(prompt) - 1:]) >= 0
    shadow = replay_known_next(nxt, tokens, len(prompt), gamma=4)
    real = replay_chain(ModelDrafter(small), tokens[: len(prompt) + shadow.tokens], len(prompt),
                        len(prompt), gamma=4)
    assert shadow.rounds >= 3 and 0 < shadow.accepted < shadow.drafted
    assert (real.rounds, real.tokens, real.accepted) == (shadow.rounds, shadow.tokens, shadow.accepted)
    # the drafter's own next draft is unchanged by the choices it noted
    ctx = DraftContext(tokens, len(prompt))
    assert model.propose(ctx, 4).tokens == ModelDrafter(small).propose(ctx, 4).tokens


def test_an_auto_segment_in_server_mode_moves_edges_estimate(target):
    prompt = make_prompt(5)
    answer = plain_greedy(target, prompt, 24, eos=None)
    drafter = ModelDrafter(target)  # the target's own copy: every choice right
    run = Run([{"role": "user", "content": "hi"}], None, 64, SamplingParams(), [], "auto", drafter)
    run.prompt, run.tokens = prompt, prompt + answer
    catch_up(drafter, run.tokens, next_from=len(prompt) - 1)
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4))
    policy.per_round_kind[("edge", "text")] = (1.2, 4.0)  # what a bad probe left
    seg = SegmentStats("server", len(answer), 6, 0, 0, 1.0, 0.9, 0.0, {}, "text")
    edge = EdgeDrafting(4, None, None, preview=False)
    edge.shadow(run, seg, policy)
    tokens_per_round, gamma = policy.per_round_kind[("edge", "text")]
    assert tokens_per_round == pytest.approx(5.0) and gamma == pytest.approx(policy.config.gamma_max)
    assert run.shadowed_to > len(prompt)
    sums = policy.round_sums[("edge", "text")]
    edge.shadow(run, seg, policy)  # nothing new committed: nothing counted twice
    assert policy.round_sums[("edge", "text")] == sums
    seg_edge = SegmentStats("edge", 1, 1, 0, 0, 1.0, 0.9, 0.0, {}, "text")
    run.tokens = run.tokens + [1]
    edge.shadow(run, seg_edge, policy)  # edge's own rounds speak for its text
    assert run.shadowed_to == len(run.tokens) and policy.round_sums[("edge", "text")] == sums
    sampled = Run([{"role": "user", "content": "hi"}], None, 64, SamplingParams(temperature=1.0), [], "auto",
                  drafter)
    sampled.prompt, sampled.tokens = prompt, prompt + answer
    edge.shadow(sampled, seg, policy)  # a sampled answer: a greedy replay says nothing about it
    assert policy.round_sums[("edge", "text")] == sums
