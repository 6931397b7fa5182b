"""Edge's critical-path drafting follows the text while auto runs another mode. The router prices edge by
its drafting per node on the round's critical path; a pipelined edge run drafts the next round while one is
in flight, so that figure depends on how often a round's draft and guess come true, i.e. on the text. Kept
only from the rounds edge last ran (a warm-up's novel prose, its first rounds not yet pipelined), it stayed
at several times what edge then paid, and priced edge out of prose it drafted well. So edge's pipelined
rounds are replayed over the text server committed, from the drafter's noted greedy choices, with the γ
and draft-ahead length its draft length policy would pick, and their fresh tokens count with its rounds."""

from __future__ import annotations

import pytest

from agentspec import router
from agentspec.client.events import SegmentStats
from agentspec.client.run import Run
from agentspec.client.shadow import shadow_segment
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import catch_up
from agentspec.drafters.replay import replay_known_next
from agentspec.router import ChainReplay, DraftLengthPolicy, LinearCost
from agentspec.types import SamplingParams
from tests.helpers import make_prompt, plain_greedy

TOKENS = [9, 1, 2, 3, 4, 5, 6, 7, 8]
#        after:  9  1  2  3  4  5  6  7
CHOICES = [1, 2, 0, 4, 5, 6, 0, 8]  # right after 9, 1, 3, 4, 5, 7; wrong after 2 and 6


def _counts(r: ChainReplay) -> tuple[int, int, int, int, int, list[int]]:
    return r.rounds, r.tokens, r.drafted, r.fresh, r.accepted, r.gammas


def test_pipelined_rounds_draft_afresh_only_after_a_miss():
    # γ 1, 2 ahead. Round 1 at 1: takes 1, guess 2 right -> the next is ready with 2 (not fresh); round 2 at
    # 3: 0 != 3 -> commits 3, fresh next; round 3 at 4: takes 4, guess 5 right; round 4 at 6: takes 6, 0 != 7;
    # round 5 at 8 takes 8 and runs past the text: not counted
    assert _counts(replay_known_next(CHOICES, TOKENS, 1, 1, ahead=2)) == (4, 7, 6, 2, 3, [1, 2, 1, 2])
    # γ 0: a plain step whose guess drafts ahead; right after 9 and 3 (ready rounds of 2), wrong after 2 and 6
    assert _counts(replay_known_next(CHOICES, TOKENS, 1, 0, ahead=2)) == (5, 8, 4, 0, 3, [0, 2, 0, 2, 0])
    # not pipelined: every round drafts on its critical path
    plain = replay_known_next(CHOICES, TOKENS, 1, 3)
    assert plain.fresh == plain.drafted == 6
    # the round after the first needs the guess after 1: not known, so only the first counts
    assert replay_known_next(CHOICES[:1], TOKENS, 1, 1, ahead=2).rounds == 1
    assert replay_known_next([1, -1] + CHOICES[2:], TOKENS, 1, 1, ahead=2).rounds == 1
    for gamma, ahead in ((-1, None), (1, -1)):
        with pytest.raises(ValueError, match="draft lengths"):
            replay_known_next(CHOICES, TOKENS, 1, gamma, ahead=ahead)


def _measured_policy() -> DraftLengthPolicy:
    policy = DraftLengthPolicy(costs=LinearCost(), probe_every=8, costs_by_nodes=True)
    for gamma, reached, accepted in ((4, 4, 3), (4, 2, 1), (2, 2, 2), (4, 4, 4), (3, 1, 0)):
        policy.observe(gamma, reached, accepted, 0.10 + 0.01 * gamma, draft_s=0.02 * gamma, kind="text")
    return policy


def test_the_pipeline_shape_is_what_choose_picks_and_moves_nothing():
    assert DraftLengthPolicy().pipeline_shape(4) is None  # nothing measured
    policy = _measured_policy()
    shape = policy.pipeline_shape(4, "text")
    assert shape is not None and shape[1] == policy._ahead(4, policy.fresh_seconds_per_token)
    assert policy.last_rates == {} and policy._zero_streak == 0
    assert policy.choose(4, "text", pipelined=True) == shape[0]
    gamma, ahead = policy.pipeline_shape(4, "text", pipelined=False)  # type: ignore[misc]
    assert ahead is None and gamma == policy.choose(4, "text")


def _warmed_up() -> router.ModePolicy:
    """A router whose edge rounds so far drafted 12 ms a node, every round fresh (a warm-up)."""
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4))
    for _ in range(6):
        policy.observe_round("edge", 4, 1, 2, wall_s=0.2, server_s=0.15, verify_s=0.15, draft_s=0.048, fresh=4)
    return policy


def _per_node(policy: router.ModePolicy, kind: str = "text") -> float:
    seconds, nodes = policy.edge_drafting[kind]
    return seconds / nodes


def test_replayed_drafting_counts_with_edges_rounds_per_node():
    policy = _warmed_up()
    assert _per_node(policy) == pytest.approx(0.012)
    seconds, nodes = policy.edge_drafting["text"]
    before = policy.round_sums[("edge", "text")]
    replay = ChainReplay(rounds=3, tokens=9, drafted=12, accepted=6)
    drafting = ChainReplay(rounds=10, tokens=20, drafted=16, fresh=4, accepted=10)
    policy.observe_shadow("edge", replay, drafting=drafting)
    keep, per_token = 1 - 1 / policy.config.round_memory, policy.edge.fresh_seconds_per_token
    for _ in range(10):
        seconds, nodes = keep * seconds + 4 * per_token / 10, keep * nodes + 16 / 10
    assert policy.edge_drafting["text"] == pytest.approx((seconds, nodes))
    assert _per_node(policy) < 0.7 * 0.012  # a quarter of its drafting was fresh: the price falls toward 3 ms
    assert policy.round_sums[("edge", "text")] != before  # E[A] and γ̄ from the other replay, as before
    priced = policy.closed_form("edge")
    policy.observe_shadow("edge", ChainReplay(), drafting=ChainReplay(rounds=5, tokens=10, drafted=8, fresh=8))
    assert policy.closed_form("edge") > priced  # all of it fresh: dearer again
    with pytest.raises(ValueError, match="drafting: edge"):
        policy.observe_shadow("server", replay, drafting=drafting)


def test_no_drafting_is_replayed_before_the_drafter_is_measured():
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4))
    policy.observe_shadow("edge", ChainReplay(rounds=2, tokens=4, drafted=8, accepted=2),
                          drafting=ChainReplay(rounds=2, tokens=4, drafted=8, fresh=8, accepted=2))
    assert "text" not in policy.edge_drafting


def _server_segment(target, drafter: ModelDrafter, kind: str = "text", **run_kwargs: object) -> tuple[Run, SegmentStats]:
    prompt = make_prompt(5)
    answer = plain_greedy(target, prompt, 24, eos=None)
    run = Run([{"role": "user", "content": "hi"}], None, 64, SamplingParams(), [], "auto", drafter, **run_kwargs)
    run.prompt, run.tokens = prompt, prompt + answer
    catch_up(drafter, run.tokens, next_from=len(prompt) - 1)
    return run, SegmentStats("server", len(answer), 6, 0, 0, 1.0, 0.9, 0.0, {}, kind)


def test_a_server_segment_of_prose_edge_drafts_well_lowers_its_drafting_price(target):
    """The target's own copy drafts: every choice right, so pipelined rounds after the first find their
    draft ready and edge's price per node falls; unpipelined, every round is fresh and it does not."""
    prices = {}
    for pipelined in (True, False):
        policy = _warmed_up()
        run, seg = _server_segment(target, ModelDrafter(target))
        shadow_segment(run, seg, policy, pipelined=pipelined)
        assert run.shadowed_to > len(run.prompt)
        prices[pipelined] = _per_node(policy)
    assert prices[False] == pytest.approx(0.012)  # a fresh token costs what the warm-up's did, a node each
    assert prices[True] < 0.7 * prices[False]


def test_a_segment_inside_a_calls_json_leaves_edges_drafting_price(target):
    """Inside JSON, edge drafts with a tree whose grammar and copies cost little: the model chain's drafting
    is not replayed there (its E[A] is, as a lower bound)."""
    policy = _warmed_up()
    policy.observe_round("edge", 4, 1, 2, wall_s=0.2, server_s=0.15, verify_s=0.15, draft_s=0.048, fresh=4,
                         kind="tool")
    before = dict(policy.edge_drafting)
    run, seg = _server_segment(target, ModelDrafter(target), "tool", response_format={"type": "json_object"})
    shadow_segment(run, seg, policy, pipelined=True)
    assert ("edge", "tool") in policy.round_sums
    assert policy.edge_drafting == before
