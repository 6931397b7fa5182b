"""The draft-length policy where rounds are drafted ahead while the one before is in flight.

A fresh round (nothing drafted ahead) pays its drafting on the critical path, and the round after it finds a
draft ready only when all of the fresh draft and the guess after it were the target's tokens. The policy
weighs a fresh γ over the rounds that follow (a two-state Markov chain); checked here against a simulation of
those rounds, not against its own formula.
"""

from __future__ import annotations

import random

import pytest

from agentspec.router import DraftLengthPolicy, LinearCost, ModePolicy

T_D = 0.049  # a drafting step of an int4 0.5B on one core


def _wall(gamma: int) -> float:
    return 0.33 + 0.008 * gamma  # a 1.5B verify pass on one core with its request's overheads: nearly flat


def _policy(alpha: float, gamma_max: int = 6) -> DraftLengthPolicy:
    """A policy that has seen rounds with per-token acceptance ``alpha`` at every position (deterministic
    counts), a verify wall time per γ, and fresh drafting at ``T_D`` a token."""
    policy = DraftLengthPolicy()
    for gamma in range(gamma_max + 1):
        policy.costs.observe(gamma, _wall(gamma))
    n = 4000
    for i in range(1, gamma_max + 3):  # position i reached n·α^(i-1) times, accepted n·α^i times
        policy.acceptance.reached.append(round(n * alpha ** (i - 1)))
        policy.acceptance.accepted.append(round(n * alpha**i))
    policy.fresh_seconds_per_token = T_D
    return policy


def _simulated_seconds_per_token(alpha: float, fresh_gamma: int, gamma_max: int, rounds: int = 40000) -> float:
    """Rounds as the client runs them: a fresh round drafts ``fresh_gamma`` tokens then waits for its reply;
    meanwhile the drafter guesses the target's next token and drafts on until the reply is in; the next round
    uses that draft when every drafted token and the guess came true, else drafts afresh."""
    rng = random.Random(7)
    seconds = tokens = 0.0
    ready: int | None = None
    for _ in range(rounds):
        gamma = fresh_gamma if ready is None else ready
        wall = _wall(gamma)
        seconds += wall + (gamma * T_D if ready is None else 0.0)
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        tokens += accepted + 1
        guess_right = accepted == gamma and rng.random() < alpha
        ready = min(gamma_max, max(int(_wall(gamma_max) / T_D) - 1, 0)) if guess_right else None
    return seconds / tokens


def test_pipelined_rates_match_the_rounds_they_model():
    """For each fresh γ, the policy's rate is the simulated rounds' tokens per second (within 2 %)."""
    for alpha in (0.6, 0.85):
        policy = _policy(alpha)
        policy.choose(6, pipelined=True)
        for gamma, rate in policy.last_rates.items():
            simulated = 1.0 / _simulated_seconds_per_token(alpha, gamma, 6)
            assert abs(rate / simulated - 1.0) < 0.02, (alpha, gamma, rate, simulated)


def test_a_pipelined_fresh_round_drafts_less_than_its_own_rate_would():
    """At α 0.85, one round alone pays best drafting 5-6; over the rounds that follow, a fresh round of 2-3 does
    (it costs less on the critical path and reaches a ready draft more often), and the simulation agrees that
    the choice beats drafting fully by several percent."""
    policy = _policy(0.85)
    alone = policy.choose(6)
    pipelined = policy.choose(6, pipelined=True)
    assert alone >= 5 and 1 <= pipelined <= 3
    best = _simulated_seconds_per_token(0.85, pipelined, 6)
    full = _simulated_seconds_per_token(0.85, 6, 6)
    assert best < 0.95 * full
    assert min(_simulated_seconds_per_token(0.85, g, 6) for g in range(7)) > 0.99 * best


def test_a_round_with_its_draft_ready_keeps_weighing_its_own_rate():
    """Tokens drafted ahead cost only verification: a round that has them drafts at least those."""
    policy = _policy(0.85)
    assert policy.choose(6, drafted=5, pipelined=True) >= 5


def test_rounds_drafted_ahead_do_not_cheapen_fresh_drafting():
    """A round whose draft was made in flight reports no drafting seconds: it lowers the drafting cost per
    drafted token (what edge mode costs on average) but not the cost of drafting one more token fresh."""
    policy = DraftLengthPolicy()
    for _ in range(20):
        policy.observe(drafted=5, reached=5, accepted=5, verify_s=0.33, draft_s=5 * T_D, fresh=5)
        policy.observe(drafted=5, reached=5, accepted=3, verify_s=0.33, draft_s=0.0, fresh=0)
    assert abs(policy.fresh_seconds_per_token - T_D) < 1e-9
    assert policy.draft_seconds_per_token < 0.8 * T_D
    # a round drafted ahead and then extended: its seconds are the extension's tokens'
    policy.observe(drafted=6, reached=6, accepted=6, verify_s=0.33, draft_s=2 * T_D, fresh=2)
    assert abs(policy.fresh_seconds_per_token - T_D) < 1e-9


def test_an_edge_policys_pass_costs_follow_the_lengths_it_stopped_choosing():
    """An edge round's γ moves from round to round. One EMA per γ kept the cost of an early, slow pass (a
    cold first round, a busy minute on a shared host) at a γ the policy then judged too dear and so never
    measured again: γ = 0 stayed at 0.49 s while plain steps took 0.30, and after a miss the pipelined policy
    never weighed a plain step with the drafter drafting ahead meanwhile. The edge policy fits one line over
    every pass, so passes at the γs it does choose move its cost at all of them."""
    edge = ModePolicy().edge
    edge.costs.observe(0, 0.49)
    for _ in range(40):
        for gamma in (4, 5, 6):
            edge.costs.observe(gamma, _wall(gamma) - 0.03)
    assert abs(edge.costs.seconds(0) - (_wall(0) - 0.03)) < 0.02
    assert edge.costs.seconds(0) < edge.costs.seconds(4) < edge.costs.seconds(6)


def test_an_edge_policy_prices_a_draft_by_the_nodes_its_pass_carries():
    """A width-2 tree carries about two nodes a drafted token (each with a sibling leaf): the edge policy's
    cost line is over a pass's nodes, and a γ is priced at the nodes its rounds carried per draft token."""
    edge = ModePolicy().edge
    for _ in range(30):
        for gamma in (0, 2, 3, 5):
            nodes = 2 * gamma
            edge.observe(gamma, 0, 0, 0.136 + 0.0075 * nodes, pass_tokens=nodes)
    assert abs(edge.nodes_per_draft - 2.0) < 1e-9
    assert abs(edge._t_v(4) - (0.136 + 0.0075 * 8)) < 1e-6
    # rounds drafted ahead carry what the draft made by the reply holds: at γ 4 and 5 alike, 7 to 11 nodes.
    # Over γ the line came out flat (a VM run's fit fell from 16 ms a γ to 0, and the policy then drafted
    # 5 tokens on the critical path as if they cost no pass time); over nodes its slope is the kernel's
    by_gamma, by_nodes = DraftLengthPolicy(costs=LinearCost()), ModePolicy().edge
    for _ in range(10):
        for gamma, nodes in ((4, 11), (5, 8), (4, 7), (5, 10)):
            by_gamma.observe(gamma, 0, 0, 0.136 + 0.0075 * nodes)
            by_nodes.observe(gamma, 0, 0, 0.136 + 0.0075 * nodes, pass_tokens=nodes)
    assert by_gamma._t_v(5) - by_gamma._t_v(0) < 0.01
    assert abs(by_nodes._t_v(5) - by_nodes._t_v(0) - 0.0075 * 5 * by_nodes.nodes_per_draft) < 1e-6
    with pytest.raises(ValueError, match="LinearCost"):
        DraftLengthPolicy(costs_by_nodes=True)
