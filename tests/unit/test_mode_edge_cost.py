"""Edge mode's closed form against what its rounds measure: the drafting it charges a round is what the rounds
drafted on their critical path, per node of the tree the closed form's γ̄ counts.

The agent benchmark's shape (agent_trials12's RTT 50, fix_mean): the 0.5B drafts a width-2 tree of ~8 nodes
over a 4-position spine, half the rounds find their draft made while the round before was in flight, and the
γ policy's t_d is per spine position. Charged as γ̄ (nodes) × t_d, edge's prose came out at 253 ms a token
while its segments measured 94-158, and auto ran 150 tokens of an answer in server-ar at ~280.
"""

from __future__ import annotations

import pytest

from agentspec import router
from tests.unit.test_router import _agent_policy, _t_v

NODES, SPINE, FRESH_S = 8, 4, 0.2  # a fresh round drafts its 4 positions at 50 ms a step


def _edge_segment(policy: router.ModePolicy, rounds: int, kind: str = "text") -> float:
    """Edge rounds as the client reports them, every other one drafted ahead (0 s on the critical path),
    then the segment; returns its measured seconds per token."""
    wall = tokens = 0.0
    for i in range(rounds):
        draft_s = FRESH_S if i % 2 == 0 else 0.0
        verify = _t_v(NODES)
        policy.observe_round("edge", NODES, 3, 4, wall_s=verify + 0.05, server_s=verify, verify_s=verify,
                             draft_s=draft_s, kind=kind, fresh=SPINE if draft_s else 0,
                             taken=((SPINE, SPINE, 3), None))
        wall, tokens = wall + verify + 0.05 + draft_s, tokens + 4
    policy.observe_segment("edge", wall / tokens, tokens=int(tokens), rounds=rounds, drafted=NODES * rounds,
                           draft_s=FRESH_S * ((rounds + 1) // 2), kind=kind)
    return wall / tokens


def test_edge_closed_form_charges_the_drafting_its_rounds_did_on_the_critical_path():
    policy = _agent_policy()
    measured = _edge_segment(policy, 12)
    assert policy.closed_form("edge", kind="text") == pytest.approx(measured, rel=0.05)
    assert policy.predicted("edge", "text") == pytest.approx(measured, rel=0.05)


def test_edge_drafting_is_kept_per_kind():
    """A tool call's rounds carry grammar-forced nodes that cost no drafting: prose is not priced by them."""
    policy = _agent_policy()
    text = _edge_segment(policy, 12)
    for _ in range(12):  # a call: 16 nodes a round, drafted ahead or forced, nothing on the critical path
        policy.observe_round("edge", 16, 7, 8, wall_s=_t_v(16) + 0.05, server_s=_t_v(16), verify_s=_t_v(16),
                             draft_s=0.0, kind="tool", fresh=0, taken=((SPINE, SPINE, 3), None))
    assert policy.closed_form("edge", kind="text") == pytest.approx(text, rel=0.05)
    assert policy.closed_form("edge", kind="tool") < 0.6 * text
