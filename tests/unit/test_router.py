"""The router's closed forms (design.md) and the adaptive draft-length policy, incl. that it stays lossless."""

from __future__ import annotations

import math

import pytest

from agentspec import router
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.engine import SpecEngine
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
