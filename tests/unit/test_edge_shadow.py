"""The router's shadows of probed modes: while auto runs another mode, the local model drafter's catch-up also
notes its greedy choice after each token of the answer, and edge's rounds over that text are replayed from
those choices (exactly what its chain would have drafted, under greedy decoding); server's rounds are
replayed from a chain of the copy drafts it makes in prose. Each estimate follows the text in hand instead
of resting on its last probe, or on a warm-up's prose."""

from __future__ import annotations

import pytest

from agentspec import models, router
from agentspec.client.events import SegmentStats
from agentspec.client.run import Run
from agentspec.client.shadow import shadow_segment
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import DraftContext, catch_up, known_next
from agentspec.drafters.copy import CopyDrafter
from agentspec.drafters.grammar import GrammarDrafter
from agentspec.drafters.replay import replay_chain, replay_known_next
from agentspec.drafters.tree import TreeDrafter, default_drafter
from agentspec.models.loading import LoadedModel
from agentspec.types import SamplingParams
from tests.helpers import make_prompt, plain_greedy, tiny_model
from tests.unit.test_tool_drafting import BYTE_TOK, CALL, TOOLS


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


def test_replay_known_next_takes_grammar_spans_free_ahead_of_the_chain():
    """A tool drafter's rounds: the grammar's span (drafted, not fresh) taken while it matches, the model's
    chain after a span taken whole; a span the target left ends what the round takes."""
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    wrong = [0] * 8  # the model never right: what is taken is the grammar's
    spans = {1: [1, 2], 4: [4, 0]}
    r = replay_known_next(wrong, tokens, 1, gamma=2, forced=lambda p: spans.get(p, []))
    # at 1: span 1 2 taken, chain wrong at 3 -> commits 1 2 3; at 4: span left at 0 -> commits 4 5;
    # then plain steps at 6, 7, 8 (the last one's round ends the text: counted, the next is not there)
    assert (r.rounds, r.tokens, r.accepted, r.drafted, r.fresh) == (5, 8, 3, 14, 10)
    right = [1, 2, 3, 4, 5, 6, 7, 8]
    chain = replay_known_next(right, tokens, 1, gamma=2)  # 1 2 +3, 4 5 +6, then past the text
    with_spans = replay_known_next(right, tokens, 1, gamma=2, forced=lambda p: spans.get(p, []))
    assert (chain.rounds, chain.tokens) == (2, 6) and (with_spans.rounds, with_spans.tokens) == (2, 8)
    assert (with_spans.drafted, with_spans.fresh) == (6, 4)  # 1 2 | 3 4 +5, then 6 7 +8
    with pytest.raises(ValueError, match="ahead"):
        replay_known_next(right, tokens, 1, gamma=2, ahead=2, forced=lambda p: [])


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
    shadow_segment(run, seg, policy)
    tokens_per_round, gamma = policy.per_round_kind[("edge", "text")]
    assert tokens_per_round == pytest.approx(5.0) and gamma == pytest.approx(policy.config.gamma_max)
    assert run.shadowed_to > len(prompt)
    sums = policy.round_sums[("edge", "text")]
    shadow_segment(run, seg, policy)  # nothing new committed: nothing counted twice
    assert policy.round_sums[("edge", "text")] == sums
    seg_edge = SegmentStats("edge", 1, 1, 0, 0, 1.0, 0.9, 0.0, {}, "text")
    run.tokens = run.tokens + [1]
    shadow_segment(run, seg_edge, policy)  # edge's own rounds speak for its text
    assert run.shadowed_to == len(run.tokens) and policy.round_sums[("edge", "text")] == sums
    sampled = Run([{"role": "user", "content": "hi"}], None, 64, SamplingParams(temperature=1.0), [], "auto",
                  drafter)
    sampled.prompt, sampled.tokens = prompt, prompt + answer
    shadow_segment(sampled, seg, policy)  # a sampled answer: a greedy replay says nothing about it
    assert policy.round_sums[("edge", "text")] == sums


def _prose_run(prompt: list[int], answer: list[int], sampling: SamplingParams | None = None) -> Run:
    run = Run([{"role": "user", "content": "hi"}], None, 64, sampling or SamplingParams(), [], "auto", None)
    run.prompt, run.tokens = prompt, prompt + answer
    return run


def test_an_auto_segment_in_edge_mode_moves_servers_prose_estimate_off_a_warm_up():
    """A warm-up's novel prose left server's prose estimate at a token a round; the answer edge then wrote
    copies the prompt (an agent citing a tool's result). The server's copy chain replayed over it counts
    with server's rounds, so server's prose estimate follows that text: the same rounds replay_chain counts,
    in segments of the client's length. Server's own segments, sampled answers, a call's JSON and a client
    whose verifier drafts otherwise (no copy chain) move nothing."""
    prompt = make_prompt(7)
    answer = prompt[3:27]  # a copy of the prompt
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4))
    for _ in range(20):  # the warm-up: one token a round
        policy.observe_round("server", 1, 0, 1, wall_s=0.1, server_s=0.1, verify_s=0.1, draft_s=0.0)
    assert policy.per_round_kind[("server", "text")] == pytest.approx((1.0, 1.0))
    run = _prose_run(prompt, answer)
    seg = SegmentStats("edge", len(answer), 6, 24, 18, 1.0, 0.9, 0.1, {}, "text")
    before = policy.round_sums[("server", "text")]
    shadow_segment(run, seg, policy, server_copy=CopyDrafter())
    expected = replay_chain(CopyDrafter(), run.tokens, len(prompt), len(prompt), 4, segment=16)
    after = policy.round_sums[("server", "text")]
    keep = 1 - 1 / policy.config.round_memory
    assert after[2] == pytest.approx(before[2] * keep**expected.rounds + sum(keep**i for i in range(expected.rounds)))
    assert expected.tokens / expected.rounds > 2.5
    assert policy.per_round_kind[("server", "text")][0] > 2.0
    for other in (SegmentStats("server", len(answer), 6, 24, 18, 1.0, 0.9, 0.0, {}, "text"),  # its own rounds
                  SegmentStats("edge", len(answer), 6, 24, 18, 1.0, 0.9, 0.1, {}, "tool"),  # a call's JSON
                  SegmentStats("edge", 1, 1, 4, 0, 1.0, 0.9, 0.1, {}, "text")):  # too short to judge
        shadow_segment(run, other, policy, server_copy=CopyDrafter())
        assert policy.round_sums[("server", "text")] == after
    shadow_segment(_prose_run(prompt, answer, SamplingParams(temperature=1.0)), seg, policy,
                   server_copy=CopyDrafter())
    shadow_segment(run, seg, policy, server_copy=None)
    assert policy.round_sums[("server", "text")] == after


def test_a_shadow_counts_only_for_a_probed_mode_the_client_drafts_like():
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4, shadowed={"server"}))
    replay = replay_chain(None, [1, 2, 3, 4], 1, 1, 4)
    for mode in ("server", "server-ar", "vllm"):  # server is judged by its replays alone here
        with pytest.raises(ValueError, match="probed mode"):
            policy.observe_shadow(mode, replay)
    policy.observe_shadow("edge", replay)
    assert policy.per_round_kind[("edge", "text")] == pytest.approx((1.0, 0.0))


def test_a_segment_inside_a_calls_json_moves_edges_tool_estimate_and_one_that_opens_a_call_does_not(target):
    """Inside JSON (a JSON answer here) a server segment's tokens are replayed for edge as tool rounds, its own
    tokens only, from the drafter's noted choices; a segment that started in prose and ended inside JSON
    is counted for neither kind."""
    prompt = make_prompt(5)
    answer = plain_greedy(target, prompt, 24, eos=None)
    drafter = ModelDrafter(target)  # the target's own copy: every choice right
    run = Run([{"role": "user", "content": "hi"}], None, 64, SamplingParams(), [], "auto", drafter,
              response_format={"type": "json_object"})
    run.prompt, run.tokens = prompt, prompt + answer
    assert run.kind == "tool"
    catch_up(drafter, run.tokens, next_from=len(prompt) - 1)
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, gamma_max=4))
    opening = SegmentStats("server", len(answer), 6, 0, 0, 1.0, 0.9, 0.0, {}, "text")
    shadow_segment(run, opening, policy)
    assert ("edge", "tool") not in policy.round_sums and ("edge", "text") not in policy.round_sums
    assert run.shadowed_to == len(run.tokens)
    run.shadowed_to = 0
    inside = SegmentStats("server", 12, 3, 0, 0, 1.0, 0.9, 0.0, {}, "tool")
    shadow_segment(run, inside, policy)
    tokens_per_round, gamma = policy.per_round_kind[("edge", "tool")]
    assert tokens_per_round == pytest.approx(5.0) and gamma == pytest.approx(4.0)
    assert policy.round_sums[("edge", "tool")][2] == pytest.approx(1 + (1 - 1 / 12))  # two rounds of its 12
    assert ("edge", "text") not in policy.round_sums


def test_edges_shadow_inside_a_call_takes_its_tool_drafters_grammar_spans():
    """Inside a call's JSON, edge's shadow replays its tool drafter's rounds: the grammar's forced spans,
    drafted free, ahead of the model's chain. A random model's choices are all but never right: its chain
    alone takes nothing, where the spans take the call's keys and punctuation; and the drafting replayed
    is cheaper per node than the model's fresh tokens, as the spans cost no pass."""
    base = tiny_model(seed=5, vocab=len(BYTE_TOK))
    target = LoadedModel(base.model, BYTE_TOK, "tiny-bytes", base.device, base.dtype)
    prompt = BYTE_TOK("<user>weather in Paris?\n<assistant>", add_special_tokens=False)["input_ids"]
    answer = BYTE_TOK(CALL, add_special_tokens=False)["input_ids"]
    estimates = {}
    for grammar in (False, True):
        model = ModelDrafter(target)
        drafter = TreeDrafter(GrammarDrafter(BYTE_TOK, max_forced=64), None, model, max_forced=64) if grammar else model
        run = Run([{"role": "user", "content": "hi"}], TOOLS, 256, SamplingParams(), [], "auto", drafter,
                  response_format={"type": "json_object"})
        run.prompt, run.tokens = prompt, prompt + answer
        catch_up(drafter, run.tokens, next_from=len(prompt) - 1)
        policy = router.ModePolicy(router.ModeConfig(segment_tokens=64, gamma_max=4))
        policy.edge.fresh_seconds_per_token = 0.01
        shadow_segment(run, SegmentStats("server", len(answer) - 11, 6, 0, 0, 1.0, 0.9, 0.0, {}, "tool"), policy)
        estimates[grammar] = policy.per_round_kind[("edge", "tool")], policy.edge_drafting.get("tool")
    (chain_tokens, chain_gamma), chain_drafting = estimates[False]
    (tokens, gamma), (seconds, nodes) = estimates[True]
    assert chain_tokens == pytest.approx(1.0) and chain_gamma == pytest.approx(4.0) and chain_drafting is None
    assert tokens > 4.0 and gamma > 4.0  # spans ride on top of γ
    assert 0 < seconds / nodes < 0.01
