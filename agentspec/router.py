"""The router's arithmetic: design.md's closed forms, and online estimates that feed them.

Notation (seed paper / design.md): γ draft tokens per round, α per-token acceptance, ``t_ar`` target
seconds per token when decoding plainly, ``t_v(γ)`` one verification pass over γ + 1 tokens, ``t_d``
local draft seconds per token, ``t_ds`` server-side draft seconds per token, ``rtt`` network round trip.

* :func:`expected_accepted` and the per-mode costs (:func:`plain_cost`, :func:`colocated_cost`,
  :func:`edge_cost`, :func:`pipelined_edge_cost`), :func:`break_even_rtt`, :func:`capacity_ratio`;
* :class:`CostCurve`: t_v(γ) measured online (EMA per γ), seeded by a calibration curve;
* :class:`AcceptanceEstimator`: per-position conditional acceptance with a shrinkage prior;
* :class:`DraftLengthPolicy`: picks γ for the next round, maximising expected tokens per second.

Everything here is plain Python (no torch), so the client can use it without loading a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

# ---- closed forms ------------------------------------------------------------------------------------


def expected_accepted(alpha: float, gamma: int) -> float:
    """E[A] = (1 − α^(γ+1)) / (1 − α): tokens per round, counting the recovered/bonus token."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def plain_cost(t_ar: float) -> float:
    """Seconds per token of plain decoding."""
    return t_ar


def colocated_cost(alpha: float, gamma: int, t_ds: float, t_v: float) -> float:
    """Seconds per token when the server drafts and verifies: ``(γ·t_ds + t_v(γ)) / E[A]``."""
    return (gamma * t_ds + t_v) / expected_accepted(alpha, gamma)


def edge_cost(alpha: float, gamma: int, t_d: float, t_v: float, rtt: float) -> float:
    """Seconds per token of synchronous edge drafting: ``(γ·t_d + RTT + t_v(γ)) / E[A]``."""
    return (gamma * t_d + rtt + t_v) / expected_accepted(alpha, gamma)


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


# ---- online estimates --------------------------------------------------------------------------------


@dataclass
class CostCurve:
    """Seconds of one decode-time target pass as a function of the number of draft tokens γ in it.

    ``prior`` is a calibration (γ → seconds, e.g. from :func:`agentspec.models.measure_verify_cost`);
    online observations are averaged per γ with an exponential moving average (weight ``ema``). A γ never
    observed is estimated from the nearest observed one, scaled by the prior's shape (or linearly when
    there is no prior).
    """

    prior: dict[int, float] = field(default_factory=dict)
    ema: float = 0.2
    observed: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"ema must be in (0, 1], got {self.ema}")
        if any(g < 0 or s <= 0 for g, s in self.prior.items()):
            raise ValueError("prior must map gamma >= 0 to seconds > 0")

    def observe(self, gamma: int, seconds: float) -> None:
        """Record one decode pass with ``gamma`` draft tokens that took ``seconds``."""
        if gamma < 0 or seconds <= 0:
            return
        old = self.observed.get(gamma)
        self.observed[gamma] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds

    def _shape(self, gamma: int) -> float:
        """Relative cost from the prior (interpolated), or linear growth when there is none."""
        if not self.prior:
            return 1.0 + 0.1 * gamma
        keys = sorted(self.prior)
        if gamma <= keys[0]:
            return self.prior[keys[0]]
        if gamma >= keys[-1]:
            last, before = keys[-1], keys[-2] if len(keys) > 1 else keys[-1]
            slope = (self.prior[last] - self.prior[before]) / (last - before) if last != before else 0.0
            return self.prior[last] + slope * (gamma - last)
        lo = max(k for k in keys if k <= gamma)
        hi = min(k for k in keys if k >= gamma)
        if lo == hi:
            return self.prior[lo]
        w = (gamma - lo) / (hi - lo)
        return (1 - w) * self.prior[lo] + w * self.prior[hi]

    def seconds(self, gamma: int) -> float | None:
        """Estimated seconds of a pass with ``gamma`` draft tokens, or None with no data at all."""
        if gamma in self.observed:
            return self.observed[gamma]
        if self.observed:
            near = min(self.observed, key=lambda g: (abs(g - gamma), g))
            return self.observed[near] * self._shape(gamma) / self._shape(near)
        if self.prior:
            return self._shape(gamma)
        return None


@dataclass
class AcceptanceEstimator:
    """Per-position conditional acceptance ``c_i = P(position i accepted | position i reached)``.

    Each estimate is shrunk toward the previous position's (a geometric continuation), the first toward
    ``prior_alpha``, with ``prior_weight`` pseudo-observations; positions never reached therefore inherit
    the last estimate, which keeps longer drafts worth trying when short ones are always accepted.
    """

    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, reached: int, accepted: int) -> None:
        """One round: the draft reached ``reached`` positions on the target's path; ``accepted`` were taken."""
        if accepted > reached or accepted < 0:
            raise ValueError(f"accepted ({accepted}) must be in [0, reached={reached}]")
        grow = reached - len(self.reached)
        if grow > 0:
            self.reached.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for i in range(reached):
            self.reached[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1

    def conditional(self, positions: int) -> list[float]:
        """``[c_1, …, c_positions]``."""
        out, prior = [], self.prior_alpha
        for i in range(positions):
            n = self.reached[i] if i < len(self.reached) else 0
            a = self.accepted[i] if i < len(self.accepted) else 0
            c = (a + self.prior_weight * prior) / (n + self.prior_weight)
            out.append(c)
            prior = c
        return out

    def expected_tokens(self, gamma: int) -> float:
        """Expected tokens a round with ``gamma`` drafts commits: ``1 + Σ_j Π_{i≤j} c_i``."""
        total, survive = 1.0, 1.0
        for c in self.conditional(gamma):
            survive *= c
            total += survive
        return total


@dataclass
class DraftLengthPolicy:
    """Chooses γ each round to maximise expected committed tokens per second (design.md: "the best γ").

    ``rate(γ) = E[A](γ) / (γ·t_d + t_v(γ))`` with the estimates above; γ = 0 (a plain step) is always a
    candidate, so a drafter that does not pay for itself is switched off — but every ``probe_every``
    rounds at zero, one round drafts ``min_probe`` tokens so the estimates can recover.
    """

    costs: CostCurve = field(default_factory=CostCurve)
    acceptance: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    draft_seconds_per_token: float = 0.0
    probe_every: int = 16
    min_probe: int = 1
    _zero_streak: int = 0
    last_rates: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_calibration(cls, seconds_by_pass_len: Mapping[int, float], **kwargs: object) -> DraftLengthPolicy:
        """A policy seeded with a measured verify-cost curve keyed by tokens per pass (γ + 1)."""
        prior = {k - 1: s for k, s in seconds_by_pass_len.items() if k >= 1}
        return cls(costs=CostCurve(prior=prior), **kwargs)  # type: ignore[arg-type]

    def choose(self, k_max: int) -> int:
        """γ for the next round, in ``[0, k_max]``."""
        if k_max <= 0:
            return 0
        if self.costs.seconds(0) is None:
            return k_max  # nothing measured yet: draft fully, observe, then adapt
        self.last_rates = {}
        for gamma in range(k_max + 1):
            t = gamma * self.draft_seconds_per_token + (self.costs.seconds(gamma) or 0.0)
            self.last_rates[gamma] = self.acceptance.expected_tokens(gamma) / t if t > 0 else 0.0
        best = max(self.last_rates, key=lambda g: (self.last_rates[g], -g))
        if best == 0:
            self._zero_streak += 1
            if self._zero_streak >= self.probe_every:
                self._zero_streak = 0
                return min(self.min_probe, k_max)
        else:
            self._zero_streak = 0
        return best

    def observe(self, drafted: int, reached: int, accepted: int, verify_s: float | None,
                draft_s: float = 0.0, pass_tokens: int | None = None) -> None:
        """Feed back one round. ``verify_s`` only for decode-time passes (not the prompt's prefill).

        ``drafted``/``reached``/``accepted`` count the tokens the policy chose (not grammar-forced ones);
        ``pass_tokens`` is the draft's full size when forced tokens rode along (default ``drafted``)."""
        if verify_s is not None:
            self.costs.observe(drafted if pass_tokens is None else pass_tokens, verify_s)
        if reached:
            self.acceptance.observe(reached, accepted)
        if drafted and draft_s > 0:
            per_token = draft_s / drafted
            old = self.draft_seconds_per_token
            self.draft_seconds_per_token = per_token if old == 0 else 0.8 * old + 0.2 * per_token


@dataclass
class ModePolicy:
    """Picks the mode of the next segment of a request from measured costs (design.md's modes).

    * Each mode's seconds per committed token is tracked from finished segments (EMA). A mode with no
      measurement yet is tried first (optimistic start). A mode not used for ``probe_every`` segments is
      probed so its estimate stays fresh; a probe that finds the mode clearly worse (by more than
      ``probe_margin``) doubles that mode's probe interval, up to ``max_probe_every`` (probing a mode that
      costs 3x the best one is itself a cost); a probe that finds it competitive resets the interval.
    * Edge mode's γ comes from its own :class:`DraftLengthPolicy`, whose cost per round is the round's
      wall time minus local drafting: RTT + t_v(γ) as the client sees it.
    * A switch needs the challenger to be ``hysteresis`` cheaper than the current mode (no flapping).
    * A saturated server (rounds waiting) makes server-side drafting cost extra (``busy_penalty``): edge
      drafting saves the server the drafter's compute (capacity ratio ``1 + γ·t_ds/t_v``).
    * ``api`` is never chosen automatically while a verifier works: it runs another model.
    """

    has_drafter: bool = True
    has_api: bool = False
    hysteresis: float = 0.05
    probe_every: int = 8
    max_probe_every: int = 128
    probe_margin: float = 0.25
    busy_penalty: float = 1.25
    ema: float = 0.3
    seconds_per_token: dict[str, float] = field(default_factory=dict)
    last_used: dict[str, int] = field(default_factory=dict)
    last_predictions: dict[str, float] = field(default_factory=dict)
    edge: DraftLengthPolicy = field(default_factory=lambda: DraftLengthPolicy(probe_every=8))
    current: str | None = None
    segments: int = 0
    server_waiting: int = 0
    probe_interval: dict[str, int] = field(default_factory=dict)  # per mode; backs off while probes lose
    probing: str | None = None  # the mode of the segment in flight, when it is a probe
    last_probe: int = 0
    server_costs: CostCurve = field(default_factory=CostCurve)  # server-reported t_v(γ)
    alpha: dict[str, float] = field(default_factory=dict)  # per mode, accepted / drafted (EMA)
    rtt: float | None = None  # wall − server compute − local drafting, per edge round (EMA)
    t_ds: float | None = None  # server-side draft seconds per token (EMA)

    @property
    def modes(self) -> list[str]:
        return (["edge"] if self.has_drafter else []) + ["server", "server-ar"]

    def choose(self) -> str:
        """The mode for the next segment."""
        self.segments += 1
        untried = [m for m in self.modes if m not in self.seconds_per_token]
        self.last_predictions = {m: self.predicted(m) * 1e3 for m in self.modes}
        due = [m for m in self.modes if m != self.current
               and self.segments - self.last_used.get(m, 0) >= self.probe_interval.get(m, self.probe_every)]
        if self.segments - self.last_probe < self.probe_every:
            due = []  # at most one probe every probe_every segments, whatever the number of modes
        self.probing = None
        if untried:
            pick = untried[0]
        elif due and self.current is not None:
            pick = self.probing = min(due, key=lambda m: self.last_used.get(m, -1))
            self.last_probe = self.segments
        else:
            best = min(self.modes, key=self.predicted)
            pick = best
            if self.current in self.modes and self.predicted(best) > (1 - self.hysteresis) * self.predicted(self.current):
                pick = self.current
            self.current = pick
        self.last_used[pick] = self.segments
        return pick

    def predicted(self, mode: str) -> float:
        """Expected seconds per token of ``mode`` now: measured when it has run, else the closed form."""
        cost = self.seconds_per_token.get(mode)
        if cost is None:
            cost = self.closed_form(mode) or 0.0
        if mode == "server" and self.server_waiting > 0:
            cost *= self.busy_penalty
        return cost

    def closed_form(self, mode: str, gamma: int = 4) -> float | None:
        """design.md's formula for ``mode`` from the round-level estimates, or None while they are missing.

        edge: ``(γ·t_d + RTT + t_v(γ)) / E[A]``; server: ``(γ·t_ds + t_v(γ)) / E[A]`` (its RTT is paid once
        per streamed line, not per round); server-ar: ``t_ar`` (= t_v(0) on the server).
        """
        t_v = self.server_costs.seconds(gamma)
        t_ar = self.server_costs.seconds(0)
        if mode == "server-ar":
            return t_ar
        if t_v is None:
            return None
        if mode == "edge" and self.rtt is not None:
            alpha = self.alpha.get("edge")
            if alpha is None:
                return None
            return edge_cost(alpha, gamma, self.edge.draft_seconds_per_token, t_v, self.rtt)
        if mode == "server" and self.t_ds is not None and "server" in self.alpha:
            return colocated_cost(self.alpha["server"], gamma, self.t_ds, t_v)
        return None

    def gamma(self, mode: str, k_max: int) -> int:
        """Draft length for the next edge round."""
        return self.edge.choose(k_max) if mode == "edge" else k_max

    def observe_round(self, mode: str, drafted: int, accepted: int, emitted: int, *, wall_s: float,
                      server_s: float, verify_s: float, draft_s: float, load: dict | None = None) -> None:
        """One round's reply as the client saw it; ``wall_s`` is the request's wall time (drafting excluded)."""
        if load:
            self.server_waiting = int(load.get("waiting", 0))
        if verify_s > 0:
            self.server_costs.observe(drafted, verify_s)
        if drafted:
            a = accepted / drafted
            self.alpha[mode] = a if mode not in self.alpha else (1 - self.ema) * self.alpha[mode] + self.ema * a
        if mode == "server" and drafted and server_s > verify_s:
            t = (server_s - verify_s) / drafted
            self.t_ds = t if self.t_ds is None else (1 - self.ema) * self.t_ds + self.ema * t
        if mode == "edge":
            rtt = max(wall_s - server_s, 0.0)
            self.rtt = rtt if self.rtt is None else (1 - self.ema) * self.rtt + self.ema * rtt
            reached = min(drafted, accepted + 1)
            self.edge.observe(drafted, reached, accepted, max(wall_s, 1e-6), draft_s)

    def observe_segment(self, mode: str, seconds_per_token: float) -> None:
        """A finished segment's wall seconds per committed token in ``mode``."""
        if mode == self.probing and self.current is not None and self.current != mode:
            incumbent = self.predicted(self.current)
            interval = self.probe_interval.get(mode, self.probe_every)
            worse = seconds_per_token > (1 + self.probe_margin) * incumbent
            self.probe_interval[mode] = min(2 * interval, self.max_probe_every) if worse else self.probe_every
        self.probing = None
        old = self.seconds_per_token.get(mode)
        self.seconds_per_token[mode] = (seconds_per_token if old is None
                                        else (1 - self.ema) * old + self.ema * seconds_per_token)
