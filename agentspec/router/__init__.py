"""The router (plain Python, no torch, no drafters: the client runs drafters and hands it numbers).

Measurements (round replies, segment times, shadow replays) feed :mod:`~agentspec.router.estimators`;
design.md's closed forms, written only in :mod:`~agentspec.router.costs`, turn them into the choices of
:class:`DraftLengthPolicy` (γ per round) and :class:`ModePolicy` (mode per segment).
"""

from agentspec.router.config import ModeConfig
from agentspec.router.costs import (
    break_even_rtt,
    capacity_ratio,
    colocated_cost,
    edge_cost,
    expected_accepted,
    pipelined_edge_cost,
    plain_cost,
    predicted_speedup,
)
from agentspec.router.estimators import AcceptanceEstimator, ChainReplay, CostCurve, LinearCost, ema
from agentspec.router.gamma import DraftLengthPolicy
from agentspec.router.modes import ModePolicy

__all__ = ["AcceptanceEstimator", "ChainReplay", "CostCurve", "DraftLengthPolicy", "LinearCost", "ModeConfig",
           "ModePolicy", "break_even_rtt", "capacity_ratio", "colocated_cost", "edge_cost", "ema",
           "expected_accepted", "pipelined_edge_cost", "plain_cost", "predicted_speedup"]
