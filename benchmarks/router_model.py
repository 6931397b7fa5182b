"""The arithmetic side of ``benchmarks.router``: calibration replays, the closed forms' predictions, and
break-even RTTs (predicted, and found in the measured curves).

* :func:`replay` runs a mode's round loop against the plain greedy reference with the real drafter (no
  model, no network: under greedy decoding the real run takes the same path), counting rounds, draft and
  accepted lengths, timing the drafter and summing t_v(γ_r + 1) from the calibrated curve;
* :func:`predict` turns a replay and a per-round overhead into the closed form's line ``a + b·RTT``
  (seconds per token) with :mod:`agentspec.router`'s ``edge_cost`` / ``colocated_cost`` / ``plain_cost``;
* :func:`break_even` puts ``router.break_even_rtt`` next to the crossing of the measured curves.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from agentspec import router
from agentspec.drafters.base import Drafter
from agentspec.drafters.replay import replay_chain


@dataclass
class Replay(router.ChainReplay):
    """A mode's round loop replayed against the reference outputs (greedy: the real run takes the same path),
    summed over prompts, with the verify time the calibrated curve gives its rounds."""

    verify_s: float = 0.0  # Σ t_v(γ_r + 1) from the calibrated curve

    def closed_form_inputs(self) -> dict[str, float]:
        """γ̄, E[A] = tokens/round, α fitted so that expected_accepted(α, γ̄) = E[A], t_d, mean t_v."""
        gamma = self.drafted / self.rounds
        mean_accepted = self.tokens / self.rounds
        return {"gamma": gamma, "E[A]": mean_accepted, "alpha": fit_alpha(mean_accepted, gamma),
                "alpha_per_token": self.accepted / self.drafted if self.drafted else 0.0,
                "t_d": self.draft_s / self.drafted if self.drafted else 0.0, "t_v": self.verify_s / self.rounds,
                "segments_per_token": self.segments / self.tokens, "rounds": self.rounds, "tokens": self.tokens}


def fit_alpha(mean_accepted: float, gamma: float) -> float:
    """α with ``expected_accepted(α, γ) = mean_accepted`` (bisection; E[A] grows with α from 1 to γ + 1).

    The method-of-moments α of the paper's i.i.d. model: for drafters whose acceptance is bursty (n-gram
    copies are mostly all right or wrong at the first token) accepted/drafted underestimates E[A] badly."""
    if gamma <= 0 or mean_accepted <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if router.expected_accepted(mid, gamma) < mean_accepted else (lo, mid)
    return (lo + hi) / 2


def replay(drafter: Drafter | None, prompt: list[int], reference: list[int], gamma: int, max_new: int,
           curve: dict[int, float], segment: int | None, into: Replay) -> None:
    """Edge rounds (``segment=None``: γ capped by the request's tokens left) or server rounds (segments of
    ``segment`` tokens, γ capped by the segment's tokens left, output cut at its end), as the code does."""
    if drafter is not None:
        drafter.reset()
    r = replay_chain(drafter, list(prompt) + list(reference), len(prompt), len(prompt), gamma,
                     segment=segment, max_new=max_new)
    for name in ("rounds", "tokens", "drafted", "accepted", "segments", "draft_s"):
        setattr(into, name, getattr(into, name) + getattr(r, name))
    into.gammas += r.gammas
    into.verify_s += sum(curve[g + 1] for g in r.gammas)


def predict(rep: Replay, overhead: float, t_ar: float, kind: str) -> tuple[float, float]:
    """``(a, b)`` of the closed form's seconds per token ``a + b·RTT`` (RTT = the injected round trip).

    edge: ``edge_cost(α, γ̄, t_d, t_v + o, RTT)``; server: ``colocated_cost(α, γ̄, t_ds, t_v + o)`` plus one RTT
    per segment; server-ar: ``plain_cost(t_ar + o)`` plus one RTT per segment; ``o`` is the mode's
    calibrated per-round loopback overhead (so the network round trip is RTT + o)."""
    c = rep.closed_form_inputs()
    if kind == "edge":
        a = router.edge_cost(c["alpha"], c["gamma"], c["t_d"], c["t_v"], overhead)
        return a, 1.0 / router.expected_accepted(c["alpha"], c["gamma"])
    if kind == "server":
        return router.colocated_cost(c["alpha"], c["gamma"], c["t_d"], c["t_v"] + overhead), c["segments_per_token"]
    return router.plain_cost(t_ar + overhead), c["segments_per_token"]


def crossing(edge: tuple[float, float], other: tuple[float, float]) -> float | None:
    """RTT (s) where two linear cost lines meet; None if parallel."""
    slope = edge[1] - other[1]
    return None if abs(slope) < 1e-12 else (other[0] - edge[0]) / slope


def measured_crossing(rtts: list[float], edge: list[float], other: list[float]) -> tuple[float | None, float | None]:
    """Where the measured edge curve crosses ``other``: ``(fitted, interpolated)``.

    Fitted: where least-squares lines through all the sweep points meet (both costs are linear in RTT,
    so every point informs the crossing and one noisy point cannot move it much). Interpolated: linear
    interpolation between the two sweep points around the first sign change (None without one)."""
    fits = [fit_line(rtts, y) for y in (edge, other)]
    fitted = crossing(fits[0], fits[1])
    diff = [e - o for e, o in zip(edge, other, strict=True)]
    for i in range(len(diff) - 1):
        if diff[i] <= 0 < diff[i + 1]:
            return fitted, rtts[i] + (rtts[i + 1] - rtts[i]) * -diff[i] / (diff[i + 1] - diff[i])
    return fitted, None


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    b = sum((a - mx) * (c - my) for a, c in zip(x, y, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def break_even(drafters: list[str], replays: dict[str, Replay], overhead: dict[str, float],
               lines: dict[str, tuple[float, float]], t_ar: float, points: list[dict]) -> dict[str, Any]:
    """Edge vs plain decoding on the server (the paper's break-even) per drafter, and edge vs server mode.

    Predicted: ``router.break_even_rtt(α, γ̄, t_ar + o_ar, t_d, t_v) − o_edge`` is where edge stops beating a
    plain decoder that pays no network; server-ar pays one RTT per segment (``s`` per token), which
    stretches it by ``1 / (1 − E[A]·s)``. RTTs are the injected ones (the loopback overhead is in ``o``)."""
    rtts = [p["rtt_ms"] for p in points]
    curve = {n: [p["modes"][n]["ms_per_token"] for p in points] for n in points[0]["modes"]}
    out = {}
    for d in drafters:
        name = f"edge:{d}"
        c, s_ar = replays[name].closed_form_inputs(), replays["server-ar"].closed_form_inputs()["segments_per_token"]
        paper = router.break_even_rtt(c["alpha"], c["gamma"], t_ar, c["t_d"], c["t_v"])
        pred = ((router.break_even_rtt(c["alpha"], c["gamma"], t_ar + overhead["server-ar"], c["t_d"], c["t_v"])
                 - overhead[name]) / (1 - c["E[A]"] * s_ar)) * 1e3
        assert abs(pred - crossing(lines[name], lines["server-ar"]) * 1e3) < 1e-6 * max(1.0, abs(pred))
        meas, interp = measured_crossing(rtts, curve[name], curve["server-ar"])
        pred_s = crossing(lines[name], lines["server"])
        meas_s, interp_s = measured_crossing(rtts, curve[name], curve["server"])
        in_sweep = 0 < pred <= max(rtts) or interp is not None
        out[d] = {"predicted_ms": pred, "measured_ms": meas, "measured_interpolated_ms": interp,
                  "measured_how": "crossing of least-squares lines through the measured ms/token at every RTT",
                  "in_sweep": in_sweep, "rel_error": abs(meas - pred) / abs(pred) if meas is not None and pred else None,
                  "rel_error_interpolated": abs(interp - pred) / abs(pred) if interp is not None and pred else None,
                  "paper_break_even_rtt_ms": paper * 1e3,
                  "edge_vs_server": {"predicted_ms": pred_s * 1e3 if pred_s is not None else None,
                                     "measured_ms": meas_s, "measured_interpolated_ms": interp_s}}
    return out


def probe_bound(modes: dict[str, dict], drafter: str, probed: list[str]) -> float:
    """auto/best if auto lost only to ModePolicy's probes of the modes in ``probed`` (those it cannot judge
    by shadow replays): the best fixed mode, except that every ``probe_every`` segments the least recently
    used probed mode runs one segment, at the fixed modes' measured ms/token."""
    every = router.ModeConfig().probe_every
    names = {"edge": f"edge:{drafter}", "server": "server", "server-ar": "server-ar"}
    best = min(modes[n]["ms_per_token"] for n in names.values())
    others = [modes[names[m]]["ms_per_token"] for m in probed if modes[names[m]]["ms_per_token"] > best]
    if not others:
        return 1.0
    cycle = every * len(others)  # each probed mode once per len(others)·probe_every segments
    return best / (((cycle - len(others)) * best + sum(others)) / cycle)
