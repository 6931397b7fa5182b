"""The draft-length policy: γ for the next round, from the cost curve and the acceptance estimates.

The caller asks :meth:`DraftLengthPolicy.choose` for γ (with the content ``kind`` it drafts), runs the
round, and feeds it back with :meth:`DraftLengthPolicy.observe` (the same ``kind``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agentspec.router.estimators import AcceptanceEstimator, CostCurve, LinearCost, ema


@dataclass
class DraftLengthPolicy:
    """Chooses γ each round to maximise expected committed tokens per second (design.md: "the best γ").

    ``rate(γ) = E[A](γ) / (γ·t_d + t_v(γ))``; γ = 0 (a plain step) is always a candidate, so a drafter that
    does not pay for itself is switched off, but every ``probe_every`` rounds at zero one round drafts
    ``min_probe`` tokens so the estimates can recover. Acceptance is also kept per content ``kind``
    (``"tool"`` JSON drafts are taken far more often than ``"text"`` ones): once a kind has
    ``min_kind_rounds`` rounds its own estimate replaces the pooled one.

    Where the round after this one is drafted while this one is in flight (``pipelined``), a fresh round's
    γ is weighed over the rounds that follow, not its own rate alone (:meth:`_pipelined_rate`): its
    drafting is on the critical path, and only when all of it is taken (and the guess of the target's
    next token is right) does the next round find its draft ready. A short fresh draft pays less and gets
    there more often.
    """

    # a calibrated curve (one EMA per γ), or a line fitted over every pass (:class:`LinearCost`): where γ
    # moves from round to round (an edge client's), one EMA per γ goes stale at the γs the policy stops
    # choosing, and a stale high cost there keeps it from ever choosing them again
    costs: CostCurve | LinearCost = field(default_factory=CostCurve)
    acceptance: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    draft_seconds_per_token: float = 0.0  # critical-path drafting per drafted token, rounds drafted ahead too
    fresh_seconds_per_token: float = 0.0  # per token drafted on the critical path: what one more costs
    probe_every: int = 16
    min_probe: int = 1
    min_kind_rounds: int = 4
    by_kind: dict[str, AcceptanceEstimator] = field(default_factory=dict)
    # per kind, the main path's own survival (a tree's sibling leaf taken ends it): the draft ahead's odds
    spine_by_kind: dict[str, AcceptanceEstimator] = field(default_factory=dict)
    # ``costs`` keyed by a pass's nodes (sibling leaves and forced tokens too), γ mapped to nodes by the
    # rounds' mean nodes per draft token: a tree's pass cost follows its nodes, and its nodes spread wider
    # than γ does, which keeps the fitted slope off the few γs the last rounds used (a LinearCost only)
    costs_by_nodes: bool = False
    nodes_per_draft: float | None = None
    _zero_streak: int = 0
    last_rates: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.costs_by_nodes and not isinstance(self.costs, LinearCost):
            raise ValueError("costs_by_nodes needs a LinearCost (a fitted line takes fractional node counts)")

    def current_acceptance(self, kind: str = "text") -> AcceptanceEstimator:
        """The estimator for ``kind`` when it has enough rounds, else the pooled one."""
        return self._own(self.by_kind, kind) or self.acceptance

    def spine_survival(self, kind: str = "text") -> AcceptanceEstimator:
        """Per-position survival of the draft's main path and the guess after it, for ``kind`` (once it has
        ``min_kind_rounds`` rounds; else :meth:`current_acceptance`, the same for chains)."""
        return self._own(self.spine_by_kind, kind) or self.current_acceptance(kind)

    def _own(self, table: dict[str, AcceptanceEstimator], kind: str) -> AcceptanceEstimator | None:
        """``kind``'s estimator in ``table`` once it has ``min_kind_rounds`` rounds."""
        own = table.get(kind)
        return own if own is not None and own.reached and own.reached[0] >= self.min_kind_rounds else None

    @classmethod
    def from_calibration(cls, seconds_by_pass_len: Mapping[int, float], **kwargs: object) -> DraftLengthPolicy:
        """A policy seeded with a measured verify-cost curve keyed by tokens per pass (γ + 1)."""
        prior = {n - 1: s for n, s in seconds_by_pass_len.items() if n >= 1}
        return cls(costs=CostCurve(prior=prior), **kwargs)  # type: ignore[arg-type]

    def choose(self, gamma_max: int, kind: str = "text", drafted: int = 0, at_least: int = 0,
               pipelined: bool = False) -> int:
        """γ for the next round, in ``[0, gamma_max]``; ``kind``: the content kind the round drafts;
        ``drafted``: tokens of its draft already made (while the round before was in flight), which cost only
        verification. Charging that sunk drafting would turn a pipelined drafter off for good: at γ = 0
        nothing is drafted ahead, so its hidden cost is never seen. ``at_least``: the smallest γ to weigh
        (1 while the mode policy probes edge mode: a probe at γ = 0 would measure plain steps, not drafting).
        ``pipelined``: the round after this one will be drafted while this one is in flight."""
        if gamma_max <= 0:
            return 0
        if self._t_v(0) is None:
            return gamma_max  # nothing measured yet: draft fully, observe, then adapt
        self.last_rates = self._rates(gamma_max, kind, drafted, at_least, pipelined)
        best = max(self.last_rates, key=lambda g: (self.last_rates[g], -g))
        self._zero_streak = self._zero_streak + 1 if best == 0 else 0
        if best == 0 and self._zero_streak >= self.probe_every:
            self._zero_streak = 0
            return min(self.min_probe, gamma_max)
        return best

    def pipeline_shape(self, gamma_max: int, kind: str = "text", pipelined: bool = True
                       ) -> tuple[int, int | None] | None:
        """What a pipelined edge run drafts now (:meth:`choose`'s picks, none of its state moved): a fresh
        round's γ, and the tokens a round's flight drafts ahead for the next one (None: not ``pipelined``);
        None before a pass and the drafting are measured."""
        t_d = self.fresh_seconds_per_token or self.draft_seconds_per_token
        if gamma_max <= 0 or self._t_v(0) is None or t_d <= 0:
            return None
        rates = self._rates(gamma_max, kind, 0, 0, pipelined)
        return max(rates, key=lambda g: (rates[g], -g)), self._ahead(gamma_max, t_d) if pipelined else None

    def _rates(self, gamma_max: int, kind: str, drafted: int, at_least: int, pipelined: bool) -> dict[int, float]:
        """Expected tokens per second by γ (:meth:`choose`'s arguments), pipelined or not."""
        rates: dict[int, float] = {}
        acceptance, survival = self.current_acceptance(kind), self.spine_survival(kind)
        t_d = self.fresh_seconds_per_token or self.draft_seconds_per_token
        ahead = self._ahead(gamma_max, t_d) if pipelined and not drafted else None
        for gamma in range(min(at_least, gamma_max), gamma_max + 1):
            if ahead is not None:
                rates[gamma] = self._pipelined_rate(acceptance, gamma, ahead, t_d, survival)
                continue
            t = max(gamma - drafted, 0) * t_d + (self._t_v(gamma) or 0.0)
            rates[gamma] = acceptance.expected_tokens(gamma) / t if t > 0 else 0.0
        return rates

    def _ahead(self, gamma_max: int, t_d: float) -> int | None:
        """Draft tokens a round's flight leaves ready for the next one: drafting ahead makes the guess of the
        target's next token first, then the draft after it, until the reply is in (None: not measured)."""
        wall = self._t_v(gamma_max)
        if wall is None or t_d <= 0:
            return None
        return min(gamma_max, max(int(wall / t_d) - 1, 0))

    def _t_v(self, gamma: int) -> float | None:
        """Seconds of a pass whose draft has ``gamma`` free tokens (None before any pass)."""
        if self.costs_by_nodes and self.nodes_per_draft is not None:
            return self.costs.seconds(gamma * self.nodes_per_draft)  # type: ignore[arg-type]
        return self.costs.seconds(gamma)

    def _pipelined_rate(self, acceptance: AcceptanceEstimator, gamma: int, ahead: int, t_d: float,
                        survival: AcceptanceEstimator | None = None) -> float:
        """Tokens per second of rounds alternating, as a two-state Markov chain, between fresh rounds of
        ``gamma`` (drafted on the critical path) and rounds whose ``ahead`` tokens were drafted in flight. A
        round leads to a ready one when all its main path and the guess after it are the target's tokens
        (``Π c_i`` of ``survival`` over its draft and one more position); else the next round drafts afresh."""
        cond = (survival or acceptance).conditional(max(gamma, ahead) + 1)

        def carried(n: int) -> float:
            p = 1.0
            for c in cond[: n + 1]:
                p *= c
            return p

        fresh_s = gamma * t_d + (self._t_v(gamma) or 0.0)
        ready_s = self._t_v(ahead) or 0.0
        to_ready, stay_ready = carried(gamma), carried(ahead)
        share = 1.0 if to_ready + (1 - stay_ready) <= 0 else (1 - stay_ready) / (1 - stay_ready + to_ready)
        tokens = share * acceptance.expected_tokens(gamma) + (1 - share) * acceptance.expected_tokens(ahead)
        seconds = share * fresh_s + (1 - share) * ready_s
        return tokens / seconds if seconds > 0 else 0.0

    def observe(self, drafted: int, reached: int, accepted: int, verify_s: float | None,
                draft_s: float | None = None, pass_tokens: int | None = None, kind: str = "text",
                fresh: int | None = None, spine: tuple[int, int] | None = None) -> None:
        """Feed back one round: ``verify_s`` only for decode-time passes (not prefill); ``draft_s`` the
        drafting on the round's critical path (0 for a draft made while the round before was in flight);
        ``fresh`` the tokens drafted there (default: all ``drafted`` when ``draft_s`` is not 0, else none);
        ``spine``: (reached, accepted) of its main path and the guess drafted after it, where they differ
        from the path the target took (a tree; :meth:`~agentspec.types.DraftProposal.spine_acceptance`).

        Counts are of the tokens the policy chose (not grammar-forced ones); ``pass_tokens`` is the draft's
        full size when forced tokens rode along (default ``drafted``)."""
        nodes = drafted if pass_tokens is None else pass_tokens
        if verify_s is not None:
            self.costs.observe(nodes, verify_s)
        if self.costs_by_nodes and drafted:
            self.nodes_per_draft = ema(self.nodes_per_draft, nodes / drafted, 0.2)
        if reached:
            self.acceptance.observe(reached, accepted)
            self._kind_estimator(self.by_kind, kind).observe(reached, accepted)
        if spine is not None and spine[0]:
            self._kind_estimator(self.spine_by_kind, kind).observe(*spine)
        if drafted and draft_s is not None:
            self.draft_seconds_per_token = ema(self.draft_seconds_per_token or None, draft_s / drafted, 0.2)
            fresh = (drafted if draft_s > 0 else 0) if fresh is None else min(fresh, drafted)
            if fresh > 0:
                self.fresh_seconds_per_token = ema(self.fresh_seconds_per_token or None, draft_s / fresh, 0.2)

    def _kind_estimator(self, table: dict[str, AcceptanceEstimator], kind: str) -> AcceptanceEstimator:
        """``kind``'s estimator in ``table``, made with the pooled one's prior the first time."""
        return table.setdefault(kind, AcceptanceEstimator(self.acceptance.prior_alpha, self.acceptance.prior_weight))
