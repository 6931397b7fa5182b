"""The router's arithmetic: design.md's closed forms, and online estimates that feed them.

Notation (seed paper / design.md): γ draft tokens per round, α per-token acceptance, ``t_ar`` target
seconds per token when decoding plainly, ``t_v(γ)`` one verification pass over γ + 1 tokens, ``t_d``
local draft seconds per token, ``t_ds`` server-side draft seconds per token, ``rtt`` network round trip.

* :func:`expected_accepted` and the per-mode costs (:func:`plain_cost`, :func:`colocated_cost`,
  :func:`edge_cost`, :func:`pipelined_edge_cost`), :func:`break_even_rtt`, :func:`capacity_ratio`;
* :class:`CostCurve`: t_v(γ) measured online (EMA per γ), seeded by a calibration curve;
* :class:`AcceptanceEstimator`: per-position conditional acceptance with a shrinkage prior;
* :class:`DraftLengthPolicy`: picks γ for the next round, maximising expected tokens per second;
* :func:`replay_chain`: a chain drafter's rounds over known output (shadow acceptance, calibration);
* :class:`ModePolicy`: picks each segment's mode from the closed forms fed with the estimates above.

Everything here is plain Python (no torch), so the client can use it without loading a model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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


def ema(old: float | None, new: float, weight: float) -> float:
    """Exponential moving average: ``new`` when there is no ``old`` yet."""
    return new if old is None else (1 - weight) * old + weight * new


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

    Acceptance is also kept per content ``kind`` (``"tool"``: inside a tool call's or a structured answer's
    JSON, ``"text"``: free text — drafts of JSON keys and copied ids are taken far more often than drafts
    of prose); the caller sets :attr:`kind` before a round, and once that kind has ``min_kind_rounds``
    rounds its own estimate replaces the pooled one.
    """

    costs: CostCurve = field(default_factory=CostCurve)
    acceptance: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    draft_seconds_per_token: float = 0.0
    probe_every: int = 16
    min_probe: int = 1
    kind: str = "text"
    min_kind_rounds: int = 4
    by_kind: dict[str, AcceptanceEstimator] = field(default_factory=dict)
    _zero_streak: int = 0
    last_rates: dict[int, float] = field(default_factory=dict)

    def current_acceptance(self) -> AcceptanceEstimator:
        """The estimator for the current kind when it has enough rounds, else the pooled one."""
        own = self.by_kind.get(self.kind)
        return own if own is not None and own.reached and own.reached[0] >= self.min_kind_rounds else self.acceptance

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
            self.last_rates[gamma] = self.current_acceptance().expected_tokens(gamma) / t if t > 0 else 0.0
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
                draft_s: float | None = None, pass_tokens: int | None = None) -> None:
        """Feed back one round. ``verify_s`` only for decode-time passes (not the prompt's prefill);
        ``draft_s`` when measured: the drafting on the round's critical path (0 for a draft made while the
        round before was in flight, which is how pipelining lowers the draft cost the policy sees).

        ``drafted``/``reached``/``accepted`` count the tokens the policy chose (not grammar-forced ones);
        ``pass_tokens`` is the draft's full size when forced tokens rode along (default ``drafted``)."""
        if verify_s is not None:
            self.costs.observe(drafted if pass_tokens is None else pass_tokens, verify_s)
        if reached:
            self.acceptance.observe(reached, accepted)
            own = self.by_kind.setdefault(self.kind, AcceptanceEstimator(self.acceptance.prior_alpha,
                                                                          self.acceptance.prior_weight))
            own.observe(reached, accepted)
        if drafted and draft_s is not None:
            self.draft_seconds_per_token = ema(self.draft_seconds_per_token or None, draft_s / drafted, 0.2)


@dataclass
class ChainReplay:
    """A chain drafter's round loop replayed over output that is already known (under greedy decoding the
    real run takes exactly this path): rounds, tokens, draft lengths, accepted drafts, drafting time."""

    rounds: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    segments: int = 0
    draft_s: float = 0.0
    gammas: list[int] = field(default_factory=list)


def replay_chain(drafter: Any, tokens: Sequence[int], prompt_len: int, start: int, gamma: int, *,
                 segment: int | None = None, max_new: int | None = None) -> ChainReplay:
    """Replay generating ``tokens[start:]`` after ``tokens[:start]`` with ``drafter`` (None: plain steps).

    Each round drafts ``k = min(γ, max_new − done − 1, segment_left − 1)`` tokens (``max_new``/``segment``
    when given, as the client and server cap them), accepts the longest matching prefix and commits it
    plus one token; a segment ends its last round at its boundary, as server mode does."""
    from agentspec.drafters.base import DraftContext

    if not 0 <= prompt_len <= start <= len(tokens):
        raise ValueError(f"need 0 <= prompt_len ({prompt_len}) <= start ({start}) <= len(tokens) ({len(tokens)})")
    out, done, total = ChainReplay(), 0, len(tokens) - start
    left = segment
    while done < total:
        caps = [gamma] + ([max_new - done - 1] if max_new else []) + ([left - 1] if segment else [])
        k = max(min(caps), 0)
        draft: tuple[int, ...] = ()
        if drafter is not None and k:
            t0 = time.perf_counter()
            proposal = drafter.propose(DraftContext(list(tokens[:start + done]), prompt_len), k)
            out.draft_s += time.perf_counter() - t0
            if proposal.is_tree:
                raise ValueError("replay_chain needs a chain drafter (it proposed a tree)")
            draft = tuple(proposal.tokens)
        acc = 0
        while acc < len(draft) and done + acc < total and draft[acc] == tokens[start + done + acc]:
            acc += 1
        emit = min(acc + 1, total - done, left if segment else total)
        done += emit
        out.rounds += 1
        out.drafted += len(draft)
        out.accepted += min(acc, emit)
        out.gammas.append(len(draft))
        if segment:
            left -= emit
            if left == 0 or done == total:
                out.segments, left = out.segments + 1, segment
    out.tokens = total
    return out


@dataclass
class ModePolicy:
    """Picks the mode of the next segment of a request (design.md's modes) from the closed forms.

    Each mode's seconds per token is predicted from round-level estimates, all measured online:

    * edge: ``(γ̄·t_d + RTT + t_v(γ̄)) / E[A]``; server: ``RTT / S + (γ̄·t_ds + t_v(γ̄)) / E[A]`` (one round
      trip per streamed segment of ``S`` tokens); server-ar: ``RTT / S + t_v(0)``;
    * ``t_v(γ)`` (a line fitted over every reported pass, :class:`LinearCost`) and ``t_ds`` from the
      server's reported timings, ``t_d`` from local drafting, RTT from the
      rounds (wall − server compute) and session opens (they keep it current while no edge round runs);
    * ``E[A]`` and ``γ̄`` per mode from **shadow replays**: after every segment, each cheap chain drafter
      the client could use (its n-gram edge drafter, the server's n-gram drafter) is replayed over the
      tokens just committed (:func:`replay_chain`), so every mode is judged on the *same* text — segment
      costs are dominated by how predictable the text is, and modes run on different segments are not
      comparable. A mode without a shadow takes ``E[A]`` from its own rounds;
    * ``E[A]`` and ``γ̄`` are also kept per content kind (``"tool"``/``"text"``, as the client reports the
      kind at each segment's start): :meth:`choose` with a ``kind`` uses that kind's estimates when there
      are any — a tool call's JSON can favour a mode that free text does not;
    * a per-mode correction, EMA of measured time / the closed form's time for each segment the mode ran
      (evaluated with that segment's own rounds, draft lengths and tokens), absorbs what the closed forms
      leave out (HTTP and JSON per round, the server's bookkeeping around its passes, the t_v fit's error).

    Until a mode's inputs exist its measured seconds per token (EMA) stands in; a mode never run is tried
    first. Modes whose inputs are all observable without running them (shadowed, or server-ar) are never
    probed; the others are probed every ``probe_every`` segments, backing off (doubling, up to
    ``max_probe_every``) while probes find them worse by more than ``probe_margin``. A switch needs the
    challenger ``hysteresis`` cheaper (no flapping). A saturated server (rounds waiting) makes server-side
    drafting cost ``busy_penalty`` more: edge drafting saves the server the drafter's compute. ``api`` is
    never chosen automatically while a verifier works: it runs another model.
    """

    has_drafter: bool = True
    has_api: bool = False
    hysteresis: float = 0.05
    probe_every: int = 8
    max_probe_every: int = 128
    probe_margin: float = 0.25
    busy_penalty: float = 1.25
    ema: float = 0.3
    correction_ema: float = 0.15  # slower: one segment's wall time scatters by 10-20 % on a busy CPU
    gamma_max: int = 4  # γ of the shadow replays (the client sets its num_draft_tokens)
    segment_tokens: int = 16  # S (the client sets its segment_tokens)
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
    server_costs: LinearCost = field(default_factory=LinearCost)  # server-reported t_v(γ), fitted
    shadows: dict[str, Any] = field(default_factory=dict)  # mode -> chain drafter replayed over committed text
    per_round: dict[str, tuple[float, float]] = field(default_factory=dict)  # mode -> (E[A], γ̄), EMA
    per_round_kind: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (mode, kind) -> ...
    kind: str = "text"  # content kind of the segment being chosen / run
    correction: dict[str, float] = field(default_factory=dict)  # mode -> measured / predicted, EMA
    rtt: float | None = None  # wall − server compute − local drafting, per edge round (EMA)
    rtt_open: float | None = None  # the same per session open (EMA)
    _rtt_open_at_edge: float | None = None
    t_ds: float | None = None  # server-side draft seconds per token (EMA)
    t_d_shadow: float | None = None  # local draft seconds per token seen in the edge shadow (EMA)

    @property
    def modes(self) -> list[str]:
        return (["edge"] if self.has_drafter else []) + ["server", "server-ar"]

    def _needs_probes(self, mode: str) -> bool:
        """Whether ``mode``'s estimate only stays fresh by running it (no closed form from shared inputs)."""
        judged_unrun = mode == "server-ar" or mode in self.shadows
        return not judged_unrun or self.closed_form(mode) is None

    def choose(self, kind: str | None = None) -> str:
        """The mode for the next segment; ``kind``: what the segment starts in (``"tool"`` or ``"text"``)."""
        if kind is not None:
            self.kind = self.edge.kind = kind
        self.segments += 1
        untried = [m for m in self.modes if m not in self.seconds_per_token]
        predicted = {m: self.predicted(m) for m in self.modes}
        self.last_predictions = {m: s * 1e3 for m, s in predicted.items()}
        due = [m for m in self.modes if m != self.current and self._needs_probes(m)
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
            pick = min(self.modes, key=predicted.__getitem__)
            if self.current in predicted and predicted[pick] > (1 - self.hysteresis) * predicted[self.current]:
                pick = self.current
            self.current = pick
        self.last_used[pick] = self.segments
        return pick

    def predicted(self, mode: str) -> float:
        """Expected seconds per token of ``mode`` now: the corrected closed form, else the measured EMA."""
        cost = self.closed_form(mode)
        if cost is None:
            cost = self.seconds_per_token.get(mode, 0.0)
        else:
            cost *= self.correction.get(mode, 1.0)
        if mode == "server" and self.server_waiting > 0:
            cost *= self.busy_penalty
        return cost

    def network_s(self) -> float | None:
        """The current round trip estimate: the edge rounds', moved by how session opens have moved since."""
        if self.rtt is None:
            return self.rtt_open
        if self.rtt_open is None or self._rtt_open_at_edge is None:
            return self.rtt
        return max(self.rtt + self.rtt_open - self._rtt_open_at_edge, 0.0)

    def _t_d(self) -> float:
        return self.edge.draft_seconds_per_token or self.t_d_shadow or 0.0

    def closed_form(self, mode: str, per_round: tuple[float, float] | None = None) -> float | None:
        """design.md's seconds per token of ``mode`` (uncorrected), or None while an input is missing.

        ``per_round``: (E[A], γ̄) to use instead of the mode's current estimate."""
        rtt = self.network_s()
        if rtt is None:
            return None
        if mode == "server-ar":
            t_ar = self.server_costs.seconds(0)
            return None if t_ar is None else rtt / self.segment_tokens + t_ar
        mean_accepted, gamma = per_round or self.per_round_kind.get((mode, self.kind)) or self.per_round.get(mode,
                                                                                                        (0.0, 0.0))
        t_v = self.server_costs.seconds(gamma)
        if t_v is None or mean_accepted <= 0:
            return None
        if mode == "edge":
            return (gamma * self._t_d() + rtt + t_v) / mean_accepted
        if mode == "server" and self.t_ds is not None:
            return rtt / self.segment_tokens + (gamma * self.t_ds + t_v) / mean_accepted
        return None

    def gamma(self, mode: str, k_max: int, kind: str | None = None) -> int:
        """Draft length for the next edge round (``kind``: the content kind it drafts, when known)."""
        if kind is not None:
            self.edge.kind = kind
        return self.edge.choose(k_max) if mode == "edge" else k_max

    def observe_open(self, wall_s: float, server_s: float) -> None:
        """A session open's wall time and the server's compute in it (prefill): tracks the round trip."""
        rtt = max(wall_s - server_s, 0.0)
        self.rtt_open = ema(self.rtt_open, rtt, self.ema)

    def observe_round(self, mode: str, drafted: int, accepted: int, emitted: int, *, wall_s: float,
                      server_s: float, verify_s: float, draft_s: float, load: dict | None = None) -> None:
        """One round's reply as the client saw it; ``wall_s`` is the request's wall time (drafting excluded)."""
        if load:
            self.server_waiting = int(load.get("waiting", 0))
        if verify_s > 0:
            self.server_costs.observe(drafted, verify_s)
        if mode == "server" and drafted and server_s > verify_s:
            t = (server_s - verify_s) / drafted
            self.t_ds = ema(self.t_ds, t, self.ema)
        if mode == "edge":
            rtt = max(wall_s - server_s, 0.0)
            self.rtt = ema(self.rtt, rtt, self.ema)
            self._rtt_open_at_edge = self.rtt_open
            reached = min(drafted, accepted + 1)
            self.edge.observe(drafted, reached, accepted, max(wall_s, 1e-6), draft_s)

    def observe_text(self, tokens: Sequence[int], prompt_len: int, start: int, kind: str | None = None) -> None:
        """Replay every shadow drafter over ``tokens[start:]`` (just committed, after ``tokens[:start]``);
        ``kind``: the content kind the segment started in (its estimates are kept apart too)."""
        if len(tokens) - start < 2:
            return
        for mode, drafter in self.shadows.items():
            segment = None if mode == "edge" else len(tokens) - start
            r = replay_chain(drafter, tokens, prompt_len, start, self.gamma_max, segment=segment)
            self._per_round(mode, r.tokens / r.rounds, r.drafted / r.rounds, kind)
            if mode == "edge" and r.drafted:
                t = r.draft_s / r.drafted
                self.t_d_shadow = ema(self.t_d_shadow, t, self.ema)

    def _per_round(self, mode: str, mean_accepted: float, gamma: float, kind: str | None = None) -> None:
        old = self.per_round.get(mode, (None, None))
        self.per_round[mode] = (ema(old[0], mean_accepted, self.ema), ema(old[1], gamma, self.ema))
        if kind is not None:
            old = self.per_round_kind.get((mode, kind), (None, None))
            self.per_round_kind[(mode, kind)] = (ema(old[0], mean_accepted, self.ema), ema(old[1], gamma, self.ema))

    def observe_segment(self, mode: str, seconds_per_token: float, *, tokens: int = 0, rounds: int = 0,
                        drafted: int = 0, draft_s: float = 0.0, kind: str | None = None) -> None:
        """A finished segment's wall seconds per committed token in ``mode`` (and, when known, its token,
        round and draft counts, the local drafter's seconds in it and the content kind it started in)."""
        if mode == self.probing and self.current is not None and self.current != mode:
            incumbent = self.predicted(self.current)
            interval = self.probe_interval.get(mode, self.probe_every)
            worse = seconds_per_token > (1 + self.probe_margin) * incumbent
            self.probe_interval[mode] = min(2 * interval, self.max_probe_every) if worse else self.probe_every
        self.probing = None
        self.seconds_per_token[mode] = ema(self.seconds_per_token.get(mode), seconds_per_token, self.ema)
        rtt = self.network_s()
        if not (tokens and rounds) or rtt is None or mode not in self.modes:
            return
        if mode not in self.shadows and mode != "server-ar":
            self._per_round(mode, tokens / rounds, drafted / rounds, kind)
        predicted = self._segment_closed_form(mode, tokens, rounds, drafted, draft_s)
        if predicted is not None and predicted > 0:
            ratio = min(max(seconds_per_token * tokens / predicted, 0.5), 3.0)
            self.correction[mode] = ema(self.correction.get(mode), ratio, self.correction_ema)

    def _segment_closed_form(self, mode: str, tokens: int, rounds: int, drafted: int, draft_s: float
                             ) -> float | None:
        """The closed form's seconds for a finished segment, fed with the segment's own round, token and
        draft counts (and, for edge, its measured local drafting): what the correction compares the
        segment's wall time with, so it absorbs everything the closed form leaves out — HTTP and JSON per
        round, the server's bookkeeping around its passes, the fitted t_v's error — and nothing of how
        predictable the segment's text was."""
        rtt = self.network_s()
        if rtt is None:
            return None
        if mode == "server-ar":
            t_ar = self.server_costs.seconds(0)
            return None if t_ar is None else rtt + tokens * t_ar
        t_v = self.server_costs.seconds(drafted / rounds)  # linear in γ: Σ t_v(γ_i) = rounds · t_v(γ̄)
        if t_v is None:
            return None
        if mode == "edge":
            return draft_s + rounds * (rtt + t_v)
        if mode == "server" and self.t_ds is not None:
            return rtt + rounds * t_v + drafted * self.t_ds
        return None
