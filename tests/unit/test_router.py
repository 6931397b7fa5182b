"""The router's closed forms (design.md) and the adaptive draft-length policy, incl. that it stays lossless."""

from __future__ import annotations

import math

import pytest

from agentspec import router
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.drafters.replay import replay_chain, shadow_replays
from agentspec.local import SpecEngine
from agentspec.router import costs
from agentspec.types import SamplingParams
from tests.helpers import make_prompt, plain_greedy
from tests.unit.test_equivalence import ScriptedDrafter


def test_expected_accepted_matches_geometric_sum():
    for alpha in (0.0, 0.3, 0.8, 0.999):
        for gamma in (0, 1, 4, 9):
            assert router.expected_accepted(alpha, gamma) == pytest.approx(sum(alpha**i for i in range(gamma + 1)))
    assert router.expected_accepted(1.0, 4) == 5.0
    with pytest.raises(ValueError, match="alpha"):
        router.expected_accepted(1.5, 2)
    with pytest.raises(ValueError, match="gamma"):
        router.expected_accepted(0.5, -1)


def test_mode_costs_and_break_even():
    alpha, gamma, t_ar, t_d, t_v = 0.8, 4, 0.030, 0.002, 0.040
    ea = router.expected_accepted(alpha, gamma)
    assert router.colocated_cost(alpha, gamma, t_d, t_v) == pytest.approx((gamma * t_d + t_v) / ea)
    rtt = router.break_even_rtt(alpha, gamma, t_ar, t_d, t_v)
    assert rtt == pytest.approx(ea * t_ar - gamma * t_d - t_v)
    # at the break-even RTT synchronous edge costs exactly plain; below it edge wins, above it loses
    assert router.edge_cost(alpha, gamma, t_d, t_v, rtt) == pytest.approx(router.plain_cost(t_ar))
    assert router.edge_cost(alpha, gamma, t_d, t_v, rtt * 0.5) < t_ar < router.edge_cost(alpha, gamma, t_d, t_v, rtt * 2)
    # pipelining hides drafting behind the round trip, so it never costs more than synchronous edge
    for r in (0.0, 0.01, 0.1):
        assert router.pipelined_edge_cost(alpha, gamma, t_d, t_v, r) <= router.edge_cost(alpha, gamma, t_d, t_v, r) + 1e-12
    assert router.capacity_ratio(gamma, t_d, t_v) == pytest.approx(1 + gamma * t_d / t_v)


def test_predicted_speedup_is_one_without_drafts_and_flat_costs():
    assert router.predicted_speedup([0, 0, 0], 0.5, 0.03, 0.0, lambda k: 1.0) == pytest.approx(1.0)
    # flat verify cost, free drafts, α = 1: γ = 3 gives 4 tokens per pass
    assert router.predicted_speedup([3, 3], 1.0, 0.03, 0.0, lambda k: 1.0) == pytest.approx(4.0)
    assert math.isnan(router.predicted_speedup([], 0.5, 0.03, 0.0, lambda k: 1.0))


def test_cost_curve_interpolates_prior_and_scales_by_observations():
    curve = router.CostCurve(prior={0: 1.0, 4: 2.0, 8: 4.0})
    assert curve.seconds(2) == pytest.approx(1.5)
    assert curve.seconds(10) == pytest.approx(5.0)  # extrapolated with the last slope
    curve.observe(0, 0.1)  # real passes are 10x faster than the calibration: keep the shape, rescale
    assert curve.seconds(4) == pytest.approx(0.2)
    assert router.CostCurve().seconds(3) is None
    with pytest.raises(ValueError):
        router.CostCurve(prior={1: -1.0})


def test_acceptance_estimator_shrinks_toward_previous_position():
    est = router.AcceptanceEstimator(prior_alpha=0.5, prior_weight=2.0)
    assert est.expected_tokens(0) == 1.0
    for _ in range(100):
        est.observe(reached=2, accepted=2)
    c = est.conditional(4)
    assert c[0] > 0.97 and c[1] > 0.97
    assert c[2] == pytest.approx(c[1]) and c[3] == pytest.approx(c[1])  # unseen: inherit the last estimate
    with pytest.raises(ValueError):
        est.observe(reached=1, accepted=2)


def test_policy_drafts_long_when_verification_is_flat_and_drafts_are_right():
    policy = router.DraftLengthPolicy(costs=router.CostCurve(prior={g: 1.0 for g in range(9)}))
    for _ in range(50):
        policy.observe(drafted=8, reached=8, accepted=8, verify_s=1.0)
    assert policy.choose(8) == 8


def test_policy_stops_drafting_when_verification_is_steep_and_drafts_are_wrong():
    policy = router.DraftLengthPolicy(costs=router.CostCurve(prior={g: 1.0 + g for g in range(9)}), probe_every=4)
    for _ in range(50):
        policy.observe(drafted=4, reached=1, accepted=0, verify_s=5.0)
    choices = [policy.choose(8) for _ in range(8)]
    assert choices.count(0) == 6 and choices.count(1) == 2  # mostly off, probing every 4th round


def test_policy_picks_interior_optimum():
    # cost grows steeply after 2 drafts; drafts are 90% right: γ = 2 maximises tokens per second
    prior = {0: 1.0, 1: 1.05, 2: 1.1, 3: 3.0, 4: 3.5}
    policy = router.DraftLengthPolicy(costs=router.CostCurve(prior=prior),
                                      acceptance=router.AcceptanceEstimator(prior_alpha=0.9, prior_weight=1e6))
    assert policy.choose(4) == 2
    assert max(policy.last_rates, key=policy.last_rates.get) == 2


def test_policy_charges_no_drafting_for_a_draft_made_ahead():
    # drafting costs as much as a verify pass (the drafter is as slow as the target): γ = 0 pays best when
    # the round must draft first, but a draft made while the round before was in flight is sunk cost
    policy = router.DraftLengthPolicy(costs=router.CostCurve(prior={g: 1.0 + 0.02 * g for g in range(9)}),
                                      acceptance=router.AcceptanceEstimator(prior_alpha=0.8, prior_weight=1e6),
                                      draft_seconds_per_token=1.0)
    assert policy.choose(4) == 0
    assert policy.choose(4, drafted=4) == 4
    assert policy.choose(4, drafted=2) == 2  # two made ahead: drafting two more costs more than they add
    mode_policy = router.ModePolicy(edge=policy)
    assert mode_policy.gamma("edge", 4) == 0 and mode_policy.gamma("edge", 4, drafted=4) == 4


def test_replay_chain_counts_rounds_as_the_engine_would():
    # prompt "1 2 3 4 1 2"; output "3 4 9 1 2 3": the n-gram drafter copies "3 4 1 2" after "1 2"
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 9, 1, 2, 3]
    r = replay_chain(NgramDrafter(), tokens, 6, 6, gamma=4)
    # round 1: draft 3 4 1 2 → 3 4 accepted, 9 committed; round 2 after "9": no match → plain 1;
    # round 3 after "9 1": copies "2 3 4 9" → 2 3 accepted (end of output)
    assert (r.rounds, r.tokens) == (3, 6) and r.gammas[0] == 4 and r.accepted == 4
    assert replay_chain(None, tokens, 6, 6, gamma=4).rounds == 6  # plain decoding: one token a round
    seg = replay_chain(NgramDrafter(), tokens, 6, 6, gamma=4, segment=2)
    assert seg.segments == 3 and max(seg.gammas) <= 1  # γ capped by the segment's tokens left
    with pytest.raises(ValueError):
        replay_chain(NgramDrafter(), tokens, 7, 6, gamma=4)


def _feed(policy: router.ModePolicy, mode: str, *, rtt: float, t_v: dict[int, float], text: list[int],
          prompt_len: int, rounds: int, wall_s: float, drafted: int = 0, kind: str | None = None) -> None:
    """One finished segment as the client reports it (the server's n-gram drafter is the shadow)."""
    for g, s in t_v.items():
        policy.server_costs.observe(g, s)
    policy.observe_open(rtt, 0.0)
    policy.observe_segment(mode, wall_s / (len(text) - prompt_len), tokens=len(text) - prompt_len, rounds=rounds,
                           drafted=drafted, kind=kind)
    shadows = {"server": NgramDrafter()} if "server" in policy.config.shadowed else {}
    replays = shadow_replays(shadows, text, prompt_len, prompt_len, policy.config.gamma_max)
    policy.observe_replays(replays, kind=kind)


def _shadowed() -> router.ModePolicy:
    """A policy without an edge drafter, judging server mode by its n-gram drafter's shadow replays."""
    return router.ModePolicy(router.ModeConfig(has_drafter=False, shadowed={"server"}, segment_tokens=16))


def test_mode_policy_judges_unrun_modes_by_shadow_replays_and_never_probes_them():
    """Copyable text: server mode with an n-gram drafter (shadowed) beats plain decoding at a long RTT, and
    the policy knows it from server-ar segments alone; nothing shadowed is ever probed."""
    t_v = {0: 0.050, 1: 0.055, 2: 0.058, 3: 0.060, 4: 0.062}
    text = list(range(1, 21)) + list(range(1, 17))  # the output repeats the prompt: every draft right
    policy = _shadowed()
    policy.t_ds = 0.0005
    for _ in range(3):
        _feed(policy, "server-ar", rtt=0.1, t_v=t_v, text=text, prompt_len=20, rounds=16, wall_s=0.9)
    mean_accepted, gamma = policy.per_round["server"]
    assert mean_accepted > 3 and gamma > 2  # from the shadow, without a single server-mode round
    assert policy.closed_form("server") < policy.closed_form("server-ar")
    policy.seconds_per_token.update({"server": 1.0})  # even a stale, bad measurement does not matter
    picks = [policy.choose() for _ in range(40)]
    assert picks.count("server") == 40
    assert policy.probing is None and policy.last_probe == 0


def test_mode_policy_correction_absorbs_per_round_overhead():
    """A segment slower than its closed form (per-round JSON/HTTP work) scales that mode's prediction."""
    t_v = {0: 0.050}
    policy = router.ModePolicy(router.ModeConfig(has_drafter=False, segment_tokens=16))
    text = list(range(1, 37))
    _feed(policy, "server-ar", rtt=0.0, t_v=t_v, text=text, prompt_len=20, rounds=16, wall_s=0.96)
    assert policy.correction["server-ar"] == pytest.approx(1.2)
    assert policy.predicted("server-ar") == pytest.approx(0.060)


def test_mode_policy_correction_is_against_the_closed_form_not_the_reported_server_time():
    """Server mode: a segment of 4 rounds of γ = 4 at RTT 20 ms on t_v(4) = 60 ms and t_ds = 1 ms/token
    has a closed-form time of 20 + 4·60 + 16·1 = 276 ms. Whatever the server reported for it, a wall time
    of 331.2 ms is a correction of 1.2 — the server's work around its passes counts as overhead — and the
    prediction of the next segment carries it."""
    t_v = {g: 0.040 + 0.005 * g for g in range(5)}
    policy = _shadowed()
    policy.t_ds = 0.001
    text = list(range(1, 21)) + list(range(1, 17))  # every draft right: 4 rounds of 4 tokens
    _feed(policy, "server", rtt=0.020, t_v=t_v, text=text, prompt_len=20, rounds=4, drafted=16, wall_s=0.3312)
    assert policy.correction["server"] == pytest.approx(1.2)
    mean_accepted, gamma = policy.per_round["server"]
    closed = 0.020 / 16 + (gamma * 0.001 + policy.server_costs.seconds(gamma)) / mean_accepted
    assert policy.predicted("server") == pytest.approx(1.2 * closed)


def test_draft_length_policy_keeps_acceptance_per_content_kind():
    """Drafts inside tool-call JSON always taken, drafts of prose never: γ is the maximum in the one and
    0 in the other, where one pooled estimate would give both the same γ."""
    policy = router.DraftLengthPolicy(costs=router.CostCurve(prior={g: 1.0 + 0.25 * g for g in range(5)}))
    for _ in range(12):
        policy.observe(drafted=4, reached=4, accepted=4, verify_s=None, kind="tool")
        policy.observe(drafted=4, reached=1, accepted=0, verify_s=None, kind="text")
    assert policy.choose(4, kind="tool") == 4
    assert policy.choose(4, kind="text") == 0
    assert policy.current_acceptance("other") is policy.acceptance  # a kind never seen: the pooled estimate


def test_mode_policy_chooses_per_content_kind():
    """Server mode's n-gram drafts copy a tool call's arguments from the prompt but only get rejected in
    prose: with the estimates kept per kind, the policy picks server mode for a segment that starts inside
    a tool call and plain decoding (server-ar) for one that starts in text."""
    t_v = {g: 0.050 + 0.010 * g for g in range(5)}
    policy = _shadowed()
    policy.t_ds = 0.0005
    prompt = list(range(1, 21))
    copied = prompt + list(range(1, 17))  # the tool call repeats the prompt: every draft right
    prose = prompt + [t for i in range(1, 9) for t in (i, 100 + i)]  # each draft (i+1 …) rejected
    for _ in range(3):
        _feed(policy, "server-ar", rtt=0.05, t_v=t_v, text=copied, prompt_len=20, rounds=16, wall_s=0.9, kind="tool")
        _feed(policy, "server-ar", rtt=0.05, t_v=t_v, text=prose, prompt_len=20, rounds=16, wall_s=0.9, kind="text")
    assert policy.per_round_kind[("server", "tool")][0] > 3 > 1.5 > policy.per_round_kind[("server", "text")][0]
    policy.seconds_per_token.update({"server": 0.01})  # every mode has run
    assert policy.choose(kind="tool") == "server"
    policy.current = None  # a new request: no hysteresis from the last choice
    assert policy.choose(kind="text") == "server-ar"


def _edge_and_server(t_catchup: float) -> router.ModePolicy:
    """A policy where edge rounds (3 tokens each) are a little cheaper than server mode's, both measured."""
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=16, hysteresis=0.0))
    for g in range(5):
        policy.server_costs.observe(g, 0.100)
    policy.observe_open(0.0, 0.0)
    policy.t_ds, policy.edge.draft_seconds_per_token = 0.001, 0.002
    policy.per_round.update({"edge": (3.0, 4.0), "server": (2.5, 4.0)})
    policy.seconds_per_token.update({m: 0.05 for m in policy.modes})
    policy.observe_catchup(500, 500 * t_catchup)
    return policy


def test_mode_policy_charges_the_drafters_catch_up_to_entering_edge():
    """Edge costs (4·2 ms + 100 ms) / 3 = 36 ms a token, server (4·1 ms + 100 ms) / 2.5 = 41.6 ms: edge wins
    while the local drafter is up to date. 300 tokens committed in server mode would cost it a 300 × 4 ms
    = 1.2 s prefill, 75 ms a token over a 16-token segment: server wins until edge has caught up."""
    policy = _edge_and_server(t_catchup=0.004)
    assert policy.t_catchup == pytest.approx(0.004)
    assert policy.choose(catchup_tokens=300) == "server"
    assert policy.choose(catchup_tokens=0) == "edge"
    policy.observe_catchup(0, 0.0)  # nothing fed: nothing learned
    assert policy.t_catchup == pytest.approx(0.004)


def test_a_probe_is_judged_without_the_catch_up_it_paid():
    """An edge probe whose 8 tokens took 0.3 s of rounds plus a 1.2 s catch-up prefill ran at its predicted
    rate: it is not a lost probe (no back-off), its measured rate and the correction leave the prefill out."""
    policy = _edge_and_server(t_catchup=0.004)
    policy.current, policy.probing = "server", "edge"
    rounds_s = 8 * policy.predicted("edge")
    policy.observe_segment("edge", (rounds_s + 1.2) / 8, tokens=8, rounds=3, drafted=12, draft_s=0.024,
                           catchup_s=1.2)
    assert policy.probe_interval[("edge", "text")] == policy.config.probe_every
    assert policy.seconds_per_token["edge"] < 0.05
    assert policy.correction["edge"] < 1.1
    policy.current, policy.probing = "server", "edge"
    policy.observe_segment("edge", (rounds_s + 1.2) / 8, tokens=8, rounds=3, drafted=12, draft_s=0.024)
    assert policy.probe_interval[("edge", "text")] > policy.config.probe_every  # the same time, uncounted: lost


def test_a_short_server_probe_pays_a_whole_segments_share_of_the_round_trip():
    """At RTT 100 ms a server probe of 6 tokens whose rounds cost 5 % less a token than edge's measured 50 ms
    spent 100 ms on the link, 17 ms a token: as a whole 16-token segment pays 6 ms, it is not a lost probe,
    and its measured rate is what a whole segment would cost. Its correction still sees the wall time it
    took (the closed form charged it the whole RTT). Edge pays the RTT per round: nothing is taken off."""
    policy = _edge_and_server(t_catchup=0.004)
    policy.rtt_open = 0.1  # session opens measured the link
    policy.current, policy.probing, policy.measured_kind[("edge", "text")] = "edge", "server", 0.050
    wall = 0.1 + 6 * 0.95 * 0.050
    policy.observe_segment("server", wall / 6, tokens=6, rounds=3, drafted=12)
    assert policy.probe_interval[("server", "text")] == policy.config.probe_every
    assert policy.measured_kind[("server", "text")] == pytest.approx(0.95 * 0.050 + 0.1 / 16)
    closed = costs.segment_s("server", 6, 3, 12, 0.0, policy.network_s(), policy.server_costs.seconds, policy.t_ds)
    assert policy.correction["server"] == pytest.approx(wall / closed)
    policy.current, policy.probing = "server", "edge"
    policy.observe_segment("edge", wall / 6, tokens=6, rounds=3, drafted=12, draft_s=0.006)
    assert policy.measured_kind[("edge", "text")] == pytest.approx(0.7 * 0.050 + 0.3 * wall / 6)


def test_a_cold_first_edge_round_is_charged_to_entering_edge():
    """An edge probe's first round drafts all its nodes on its critical path (nothing was drafted ahead):
    counted per node, two such rounds in a three-round probe made edge look five times dearer to draft than
    it runs. Its drafting is the price of entering edge, charged once per cold segment as a catch-up is;
    the per-node estimate keeps the rounds that follow."""
    policy = _edge_and_server(t_catchup=0.004)
    for entry, draft_s in ((True, 0.24), (False, 0.012), (False, 0.0)):
        policy.observe_round("edge", 6, 3, 4, wall_s=0.1, server_s=0.1, verify_s=0.1, draft_s=draft_s,
                             entry=entry)
    assert policy.entry_drafting["text"] == pytest.approx(0.24)
    seconds, nodes = policy.edge_drafting["text"]
    assert seconds / nodes == pytest.approx(0.012 * 11 / 12 / (6 * 11 / 12 + 6))
    policy.choose(kind="text", cold=False)
    warm = policy.last_predictions["edge"]
    policy.choose(kind="text", cold=True)
    assert policy.last_predictions["edge"] == pytest.approx(warm + 1e3 * 0.24 / policy.config.segment_tokens)
    # a probe that paid it is judged without it, as a catch-up is; its correction sees its whole wall time
    policy.current, policy.probing, policy.measured_kind[("server", "text")] = "server", "edge", 0.05
    policy.observe_segment("edge", (8 * 0.05 + 0.24) / 8, tokens=8, rounds=3, drafted=18, draft_s=0.252,
                           entry_s=0.24)
    assert policy.probe_interval[("edge", "text")] == policy.config.probe_every
    assert policy.measured_kind[("edge", "text")] == pytest.approx(0.05)
    closed = costs.segment_s("edge", 8, 3, 18, 0.252, policy.network_s(), policy.server_costs.seconds, policy.t_ds)
    assert policy.correction_kind[("edge", "text")] == pytest.approx(min(max((8 * 0.05 + 0.24) / closed, 0.5), 3))



    """Server is the better mode (edge's drafting made dear). Edge's probe falls due every ``probe_every``
    segments; while the local drafter has tokens to catch up on it waits, up to one more interval, then
    runs all the same (a drafter that never catches up between segments must not shut edge out)."""
    policy = _edge_and_server(t_catchup=0.004)
    policy.edge.draft_seconds_per_token = 0.05
    every = policy.config.probe_every

    def probes(catchup_tokens: int, segments: int) -> list[int]:
        policy.current, policy.segments, policy.last_probe = "server", 0, 0
        policy.last_used = {("server", "text"): 0, ("edge", "text"): 0}
        return [i for i in range(1, segments + 1)
                if policy.choose(catchup_tokens=catchup_tokens) == "edge" and policy.probing == "edge"]

    assert probes(0, every)[0] == every
    assert probes(300, 2 * every) == [2 * every]


MAX_NEW = 40


@pytest.mark.parametrize("seed", [0, 1])
def test_adaptive_engine_is_lossless(target, wrong_drafter_model, seed):
    """γ changing every round (incl. 0) must not change a single token, for chains and trees."""
    prompt = make_prompt(seed)
    reference = plain_greedy(target, prompt, MAX_NEW)
    for drafter in (ModelDrafter(target), ModelDrafter(wrong_drafter_model, tree_width=2), NgramDrafter()):
        engine = SpecEngine(target, drafter, num_draft_tokens=6)
        curve = engine.calibrate(prompt, reps=1, probe_every=3)
        assert sorted(curve) == list(range(1, 8))
        result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert result.tokens == reference, drafter
        assert engine.draft_policy is not None and engine.draft_policy.costs.observed


def test_adaptive_engine_learns_to_draft_fully_for_a_free_perfect_drafter(target):
    """A drafter that costs nothing and is always right, on a flat verify curve: draft the maximum."""
    prompt = make_prompt(3)
    drafter = ScriptedDrafter(plain_greedy(target, prompt, MAX_NEW), j=MAX_NEW)
    engine = SpecEngine(target, drafter, num_draft_tokens=4,
                        draft_policy=router.DraftLengthPolicy(costs=router.CostCurve(prior={g: 1.0 for g in range(5)})))
    result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert result.stats.alpha == 1.0
    late = [r.drafted for r in result.stats.rounds[:-1]]  # the last round is cut by max_new_tokens
    assert late and all(g == 4 for g in late), late


def _t_v(drafted: float) -> float:
    return 0.40 + 0.01 * drafted  # a 1.5B-like verify pass on one core: nearly flat in the tokens it carries


def _rounds(policy: router.ModePolicy, mode: str, rounds: list[tuple[str, int, int, float]],
            seg_kind: str) -> None:
    """A segment as the client reports it: each round's reply under the kind it drafted in (``(kind, tokens,
    drafted, between_s)``: client work between the replies, outside every request's wall time, as building and
    masking a grammar-cut tree), then the segment under the kind it started in. The link costs 20 ms a round."""
    wall = drafted_sum = 0.0
    for kind, tokens, drafted, between in rounds:
        verify = _t_v(drafted)
        server = verify + (0.001 * drafted if mode == "server" else 0.0)
        policy.observe_round(mode, drafted, max(tokens - 1, 0), tokens, wall_s=server + 0.02, server_s=server,
                             verify_s=verify, draft_s=0.0, kind=kind, segment_kind=seg_kind)
        wall, drafted_sum = wall + server + 0.02 + between, drafted_sum + drafted
    tokens = sum(r[1] for r in rounds)
    policy.observe_segment(mode, wall / tokens, tokens=tokens, rounds=len(rounds), drafted=int(drafted_sum),
                           kind=seg_kind)


def _agent_policy() -> router.ModePolicy:
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=32))
    policy.observe_open(0.02, 0.0)
    return policy


def test_mode_policy_judges_each_round_under_the_kind_it_drafted_in():
    """A tool call opens in text (its fence) and copies well; the prose answer after it does not. Server
    mode's prose estimate is its prose rounds' (one token each), not the call's, from the first prose
    segment on; its estimate over all kinds follows the recent rounds (a ratio of decayed sums)."""
    policy = _agent_policy()
    _rounds(policy, "server", [("text", 1, 2, 0.0)] + [("tool", 4, 6, 0.0)] * 8, seg_kind="text")
    assert policy.per_round_kind[("server", "tool")] == pytest.approx((4.0, 6.0))
    _rounds(policy, "server", [("text", 1, 2, 0.0)] * 30, seg_kind="text")
    assert policy.per_round_kind[("server", "text")] == pytest.approx((1.0, 2.0))
    assert policy.per_round["server"][0] < 1.2  # 30 rounds on: the call's rounds weigh little
    t_ds = policy.t_ds
    assert policy.closed_form("server", kind="text") == pytest.approx(2 * t_ds + _t_v(2) + 0.02 / 32, rel=1e-3)
    assert policy.closed_form("server", kind="tool") == pytest.approx((6 * t_ds + _t_v(6)) / 4 + 0.02 / 32,
                                                                      rel=1e-3)
    with pytest.raises(ValueError, match="round_memory"):
        router.ModeConfig(round_memory=0)
    with pytest.raises(ValueError, match="probe_rounds"):
        router.ModeConfig(probe_rounds=0)
    with pytest.raises(ValueError, match="opening_rounds"):
        router.ModeConfig(opening_rounds=0)


def test_a_segment_is_priced_by_the_kinds_its_start_kind_goes_on_in():
    """An agent's calls open in text (the fence) and go on in JSON, which edge drafts well; its answers are
    prose, which it drafts poorly. A segment that starts in text is priced by the share of its tokens each
    round kind committed, not as prose alone (which priced the calls' opening segments at twice what edge
    measured there, and lost them to plain decoding at a 100 ms link); plain decoding is priced as before."""
    policy = router.ModePolicy(router.ModeConfig(segment_tokens=32))
    policy.observe_open(0.1, 0.0)
    for _ in range(4):  # an opening segment: one fence round, then the call's JSON
        _rounds(policy, "edge", [("text", 1, 4, 0.0)] + [("tool", 5, 5, 0.0)] * 6, seg_kind="text")
        _rounds(policy, "edge", [("text", 2, 4, 0.0)] * 4, seg_kind="text")  # an answer
    mix = policy.kind_mix["text"]
    assert 0.6 < mix["tool"] / sum(mix.values()) < 30 / 39  # decayed: the answers came last
    text, tool = policy._predicted_in("edge", "text"), policy._predicted_in("edge", "tool")
    assert text > 2 * tool
    assert policy.predicted("edge", "text") == pytest.approx((mix["text"] * text + mix["tool"] * tool)
                                                             / sum(mix.values()))
    assert policy.predicted("edge", "text") < 0.6 * text
    assert policy.predicted("edge", "tool") == tool  # tool segments stayed in JSON
    assert policy.predicted("server-ar", "text") == policy._predicted_in("server-ar", "text")


def test_mode_policy_corrects_each_content_kind_apart():
    """Edge rounds inside a tool call take twice their closed form (client work on a grammar-cut tree between
    the replies), in prose their closed form: the prose prediction is not inflated by the calls."""
    policy = _agent_policy()
    for _ in range(3):
        _rounds(policy, "edge", [("tool", 5, 8, _t_v(8) + 0.02)] * 6, seg_kind="tool")
    _rounds(policy, "edge", [("text", 3, 4, 0.0)] * 10, seg_kind="text")
    assert policy.correction_kind[("edge", "tool")] == pytest.approx(2.0, rel=0.01)
    assert policy.correction_kind[("edge", "text")] == pytest.approx(1.0, rel=0.01)
    assert policy.predicted("edge", "text") == pytest.approx((_t_v(4) + 0.02) / 3, rel=0.01)
    assert policy.predicted("edge", "tool") == pytest.approx(2 * (_t_v(8) + 0.02) / 5, rel=0.01)


def test_a_probe_backs_off_once_per_margin_it_lost_by():
    """A probe within ``probe_margin`` of the incumbent resets the interval; one that lost doubles it once per
    factor of ``1 + probe_margin`` it lost by (at least once), never past ``max_probe_every``."""
    c = router.ModeConfig(probe_every=8, max_probe_every=128, probe_margin=0.25)
    assert c.backed_off(64, 1.25) == 8  # within the margin: not lost
    assert c.backed_off(8, 1.3) == 16  # lost by less than 1.25²: doubled once
    assert c.backed_off(8, 1.25**2 + 1e-9) == 32
    assert c.backed_off(8, 2.0) == 64  # log(2) / log(1.25) = 3.1: three doublings
    assert c.backed_off(16, 1e6) == 128  # capped
    assert router.ModeConfig(probe_margin=0.0, probe_every=8).backed_off(8, 5.0) == 16  # no margin: doubles


def test_a_probe_is_judged_against_what_the_incumbent_measured_in_its_kind():
    """Server mode predicted cheap prose from a tool call (its correction, say) but ran it at one token a
    pass: an edge probe in prose 15 % cheaper than that measurement is not lost, though 50 % dearer than
    the prediction; a probe lost inside a tool call backs off tool-call probes only."""
    policy = _agent_policy()
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * 8, seg_kind="tool")
    _rounds(policy, "server", [("text", 1, 2, 0.0)] * 30, seg_kind="text")
    measured = policy.measured_kind[("server", "text")]
    policy.correction_kind[("server", "text")] = 0.5  # a prediction that has not caught up
    policy.current, policy.probing = "server", "edge"
    policy.observe_segment("edge", 0.85 * measured, tokens=8, rounds=3, drafted=12, kind="text")
    assert policy.probe_interval[("edge", "text")] == policy.config.probe_every
    policy.current, policy.probing = "server", "edge"
    policy.observe_segment("edge", 3 * policy.measured_kind[("server", "tool")], tokens=8, rounds=2, drafted=16,
                           kind="tool")
    assert policy.probe_interval[("edge", "tool")] == policy.config.backed_off(policy.config.probe_every, 3.0)
    assert policy.probe_interval[("edge", "tool")] > policy.config.probe_every
    assert policy.probe_interval[("edge", "text")] == policy.config.probe_every


def test_mode_policy_runs_server_in_tool_calls_and_edge_in_prose():
    """The agent benchmark's shape: server mode copies tool calls at 4 tokens a pass where edge pays a costly
    tree round for 5; in prose the edge drafter gets 3 tokens a round where the server gets 1. Once each mode
    has run in each kind, auto picks server inside calls and edge in prose (and keeps it there)."""
    policy = _agent_policy()
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * 8, seg_kind="tool")
    _rounds(policy, "server", [("text", 1, 2, 0.0)] * 30, seg_kind="text")
    _rounds(policy, "server-ar", [("text", 1, 0, 0.0)] * 8, seg_kind="text")
    _rounds(policy, "edge", [("tool", 5, 8, 2 * _t_v(8))] * 6, seg_kind="tool")
    _rounds(policy, "edge", [("text", 3, 4, 0.05)] * 10, seg_kind="text")
    policy.current = "server"
    assert [policy.choose(kind="text") for _ in range(3)] == ["edge"] * 3
    assert policy.choose(kind="tool") == "server"


def test_an_edge_probe_drafts_where_the_draft_length_policy_turned_drafting_off():
    """A warm-up's few rejected drafts turn edge drafting off (γ = 0 is the best rate); an edge probe at γ = 0
    would measure plain steps through edge mode, so while the mode policy probes edge it drafts at least one
    token (the best γ ≥ 1), and outside a probe the draft length policy's choice stands."""
    policy = _agent_policy()
    for _ in range(8):
        policy.edge.observe(drafted=4, reached=1, accepted=0, verify_s=_t_v(4), draft_s=0.2, kind="text")
        policy.edge.observe(drafted=0, reached=0, accepted=0, verify_s=_t_v(0), kind="text")
    assert policy.gamma("edge", 8, kind="text") == 0
    policy.probing = "edge"
    assert 1 <= policy.gamma("edge", 8, kind="text") <= 8
    assert policy.edge.choose(8, kind="text", at_least=20) == 8  # never above gamma_max
    policy.probing = "server"
    assert policy.gamma("edge", 8, kind="text") == 0


def test_a_mode_run_only_in_tool_calls_is_still_probed_in_prose():
    """Edge's prose estimate is stale (a warm-up's cold segment); it keeps running in tool calls, where it wins.
    Its prose probes fall due by when it last ran in prose, not by when it last ran at all."""
    policy = _agent_policy()
    policy.current = "server"
    policy.seconds_per_token.update({m: 0.3 for m in policy.modes})
    policy.predicted = lambda mode, kind="text": {"edge": 0.1 if kind == "tool" else 0.9}.get(mode, 0.4)
    picks = []
    for i in range(40):  # calls of two tool-call segments, then answers of three prose ones
        kind = "tool" if i % 5 < 2 else "text"
        picks.append((kind, policy.choose(kind=kind), policy.probing))
    assert all(mode == "edge" for kind, mode, probing in picks if kind == "tool" and probing is None)
    probes = [i for i, (kind, mode, probing) in enumerate(picks, 1) if kind == "text" and probing == "edge"]
    assert probes and probes[0] <= 3 * policy.config.probe_every, picks  # other modes share the probe slots
