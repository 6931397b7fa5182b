"""Online estimates the closed forms are fed with (plain Python): an EMA, t_v(γ) curves (:class:`CostCurve`,
:class:`LinearCost`), per-position acceptance (:class:`AcceptanceEstimator`) and replayed chain-drafter
rounds (:class:`ChainReplay`, made by :func:`agentspec.drafters.replay.replay_chain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


def ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: ``new`` when there is no ``old`` yet."""
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class CostCurve:
    """Seconds of one decode-time target pass as a function of the number of draft tokens γ in it.

    ``prior`` is a calibration (γ → seconds); observations are averaged per γ (EMA, weight ``ema``). A γ
    never observed is scaled from the nearest observed one by the prior's shape (or linearly without one).
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
        self.observed[gamma] = ema(self.observed.get(gamma), seconds, self.ema)

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
        lo = max(g for g in keys if g <= gamma)
        hi = min(g for g in keys if g >= gamma)
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
class LinearCost:
    """``t_v(γ) ≈ a + b·γ`` fitted by least squares over every observed pass, older ones decayed by
    ``decay`` per observation. Pooling all draft lengths is far less noisy than one average per γ when
    a 2-core CPU's pass times scatter by 10-20 %; with a single γ observed it is a flat line."""

    decay: float = 0.97
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    observed: dict[int, float] = field(default_factory=dict)  # latest value per γ, for reports

    def observe(self, gamma: int, seconds: float) -> None:
        """Record one decode pass with ``gamma`` draft tokens that took ``seconds``."""
        if gamma < 0 or seconds <= 0:
            return
        d = self.decay
        self._w, self._x, self._y = d * self._w + 1, d * self._x + gamma, d * self._y + seconds
        self._xx, self._xy = d * self._xx + gamma * gamma, d * self._xy + gamma * seconds
        self.observed[gamma] = seconds

    def seconds(self, gamma: float) -> float | None:
        """Estimated seconds of a pass with ``gamma`` draft tokens, or None before any observation."""
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        slope = max((self._xy / self._w - mx * my) / var, 0.0) if var > 1e-9 else 0.0
        return max(my + slope * (gamma - mx), 1e-9)


@dataclass
class AcceptanceEstimator:
    """Per-position conditional acceptance ``c_i = P(position i accepted | position i reached)``.

    Each estimate is shrunk toward the previous position's (the first toward ``prior_alpha``) with
    ``prior_weight`` pseudo-observations, so positions never reached inherit the last estimate: longer
    drafts stay worth trying when short ones are always accepted."""

    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, reached: int, accepted: int) -> None:
        """One round: the draft reached ``reached`` positions on the target's path; ``accepted`` were taken."""
        if accepted > reached or accepted < 0:
            raise ValueError(f"accepted ({accepted}) must be in [0, reached={reached}]")
        grow = reached - len(self.reached)  # [0] * a negative count is empty
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
            prior = (a + self.prior_weight * prior) / (n + self.prior_weight)
            out.append(prior)
        return out

    def expected_tokens(self, gamma: int) -> float:
        """Expected tokens a round with ``gamma`` drafts commits: ``1 + Σ_j Π_{i≤j} c_i``."""
        total, survive = 1.0, 1.0
        for c in self.conditional(gamma):
            survive *= c
            total += survive
        return total


@dataclass
class ChainReplay:
    """A chain drafter's round loop replayed over output that is already known (under greedy decoding the
    real run takes exactly this path): rounds, tokens, draft lengths, accepted drafts, drafting time, and the
    tokens drafted on the rounds' critical path (``fresh``: all of them, unless rounds were drafted ahead)."""

    rounds: int = 0
    tokens: int = 0
    drafted: int = 0
    fresh: int = 0
    accepted: int = 0
    segments: int = 0
    draft_s: float = 0.0
    gammas: list[int] = field(default_factory=list)
