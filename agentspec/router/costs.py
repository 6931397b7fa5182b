"""design.md's closed forms — the only place they are written: seconds per token of each mode, the
break-even RTT, the capacity gain, and the per-round and per-segment forms the mode policy evaluates.

Notation (seed paper / design.md): γ draft tokens per round, α per-token acceptance, E[A] tokens a round
commits, ``t_ar`` target seconds per token when decoding plainly, ``t_v(γ)`` one verification pass over
γ + 1 tokens, ``t_d`` / ``t_ds`` local / server-side draft seconds per token, ``rtt`` network round trip,
``S`` tokens per streamed segment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def expected_accepted(alpha: float, gamma: int) -> float:
    """E[A] = (1 − α^(γ+1)) / (1 − α): tokens per round, counting the recovered/bonus token."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def edge_round_s(gamma: float, t_d: float, t_v: float, rtt: float) -> float:
    """Seconds of one synchronous edge round: ``γ·t_d + RTT + t_v(γ)``."""
    return gamma * t_d + rtt + t_v


def colocated_round_s(gamma: float, t_ds: float, t_v: float) -> float:
    """Seconds of one co-located round (the server drafts and verifies): ``γ·t_ds + t_v(γ)``."""
    return gamma * t_ds + t_v


def streamed_cost(per_token_s: float, rtt: float, segment_tokens: int) -> float:
    """Seconds per token of a server mode streaming ``S``-token segments: ``RTT / S`` + per-token compute."""
    return rtt / segment_tokens + per_token_s


def plain_cost(t_ar: float) -> float:
    """Seconds per token of plain decoding."""
    return t_ar


def colocated_cost(alpha: float, gamma: int, t_ds: float, t_v: float) -> float:
    """Seconds per token when the server drafts and verifies: ``(γ·t_ds + t_v(γ)) / E[A]``."""
    return colocated_round_s(gamma, t_ds, t_v) / expected_accepted(alpha, gamma)


def edge_cost(alpha: float, gamma: int, t_d: float, t_v: float, rtt: float) -> float:
    """Seconds per token of synchronous edge drafting: ``(γ·t_d + RTT + t_v(γ)) / E[A]``."""
    return edge_round_s(gamma, t_d, t_v, rtt) / expected_accepted(alpha, gamma)


def pipelined_edge_cost(alpha: float, gamma: int, t_d: float, t_v: float, rtt: float) -> float:
    """Seconds per token of pipelined edge drafting: ``max(γ·t_d, RTT + t_v(γ)) / E[A]``.

    The drafts a rejection invalidates are redrafted from the committed tokens: on a rejection
    (probability ``1 − α^γ``) the next round's drafting cannot have overlapped, which adds ``γ·t_d``.
    """
    overlapped = max(gamma * t_d, rtt + t_v)
    wasted = (1.0 - alpha**gamma) * gamma * t_d if gamma else 0.0
    return (overlapped + wasted) / expected_accepted(alpha, gamma)


def break_even_rtt(alpha: float, gamma: int, t_ar: float, t_d: float, t_v: float) -> float:
    """Largest RTT at which synchronous edge drafting still beats plain: ``E[A]·t_ar − γ·t_d − t_v(γ)``."""
    return expected_accepted(alpha, gamma) * t_ar - gamma * t_d - t_v


def capacity_ratio(gamma: int, t_ds: float, t_v: float) -> float:
    """Server compute per token, co-located over edge: ``1 + γ·t_ds / t_v`` (edge drafting's capacity gain)."""
    if t_v <= 0:
        raise ValueError(f"t_v must be > 0, got {t_v}")
    return 1.0 + gamma * t_ds / t_v


def predicted_speedup(gammas: Iterable[int], alpha: float, t_ar: float, t_d: float,
                      cost_ratio: Callable[[int], float]) -> float:
    """Predicted speed-up over plain decoding of in-process rounds with draft lengths ``gammas``.

    time = Σ_r (γ_r·t_d + t_ar·c(γ_r + 1)), tokens = Σ_r E[A](α, γ_r), speed-up = tokens·t_ar / time, where
    ``c(k) = t_v(k)/t_v(1)`` is the measured verify-cost curve over a pass of ``k`` tokens.
    """
    gammas = list(gammas)
    if not gammas:
        return float("nan")
    seconds = sum(g * t_d + t_ar * cost_ratio(g + 1) for g in gammas)
    tokens = sum(expected_accepted(alpha, g) for g in gammas)
    return tokens * t_ar / seconds


def plain_segment_s(tokens: int, t_ar: float, rtt: float) -> float:
    """A plain-decoding (server-ar) segment: one round trip, then ``t_ar`` per token."""
    return rtt + tokens * t_ar


def edge_segment_s(rounds: int, draft_s: float, t_v: float, rtt: float) -> float:
    """An edge segment: Σ over its rounds of ``γ_r·t_d + RTT + t_v`` with the measured drafting seconds."""
    return draft_s + rounds * (rtt + t_v)


def colocated_segment_s(rounds: int, drafted: int, t_ds: float, t_v: float, rtt: float) -> float:
    """A server-mode segment: one round trip, then Σ over its rounds of ``γ_r·t_ds + t_v``."""
    return rtt + rounds * t_v + drafted * t_ds


def segment_s(mode: str, tokens: int, rounds: int, drafted: int, draft_s: float, rtt: float,
              t_v: Callable[[float], float | None], t_ds: float | None) -> float | None:
    """Seconds of a finished segment of ``mode`` by the closed forms, from its own counts and its measured
    local drafting ``draft_s`` (``t_v(γ)``: a pass's seconds, None while unmeasured); None where an input is
    missing or ``mode`` has no closed form."""
    if mode == "server-ar":
        t_ar = t_v(0)
        return None if t_ar is None else plain_segment_s(tokens, t_ar, rtt)
    t_v_mean = t_v(drafted / rounds)  # linear in γ: Σ t_v(γ_i) = rounds · t_v(γ̄)
    if t_v_mean is None:
        return None
    if mode == "edge":
        return edge_segment_s(rounds, draft_s, t_v_mean, rtt)
    if mode == "server" and t_ds is not None:
        return colocated_segment_s(rounds, drafted, t_ds, t_v_mean, rtt)
    return None
