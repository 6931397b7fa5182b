"""The draft-length policy: γ for the next round, from the cost curve and the acceptance estimates.

The caller asks :meth:`DraftLengthPolicy.choose` for γ (with the content ``kind`` it drafts), runs the
round, and feeds it back with :meth:`DraftLengthPolicy.observe` (the same ``kind``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agentspec.router.estimators import AcceptanceEstimator, CostCurve, ema


@dataclass
class DraftLengthPolicy:
    """Chooses γ each round to maximise expected committed tokens per second (design.md: "the best γ").

    ``rate(γ) = E[A](γ) / (γ·t_d + t_v(γ))``; γ = 0 (a plain step) is always a candidate, so a drafter that
    does not pay for itself is switched off, but every ``probe_every`` rounds at zero one round drafts
    ``min_probe`` tokens so the estimates can recover. Acceptance is also kept per content ``kind``
    (``"tool"`` JSON drafts are taken far more often than ``"text"`` ones): once a kind has
    ``min_kind_rounds`` rounds its own estimate replaces the pooled one.
    """

    costs: CostCurve = field(default_factory=CostCurve)
    acceptance: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    draft_seconds_per_token: float = 0.0
    probe_every: int = 16
    min_probe: int = 1
    min_kind_rounds: int = 4
    by_kind: dict[str, AcceptanceEstimator] = field(default_factory=dict)
    _zero_streak: int = 0
    last_rates: dict[int, float] = field(default_factory=dict)

    def current_acceptance(self, kind: str = "text") -> AcceptanceEstimator:
        """The estimator for ``kind`` when it has enough rounds, else the pooled one."""
        own = self.by_kind.get(kind)
        return own if own is not None and own.reached and own.reached[0] >= self.min_kind_rounds else self.acceptance

    @classmethod
    def from_calibration(cls, seconds_by_pass_len: Mapping[int, float], **kwargs: object) -> DraftLengthPolicy:
        """A policy seeded with a measured verify-cost curve keyed by tokens per pass (γ + 1)."""
        prior = {n - 1: s for n, s in seconds_by_pass_len.items() if n >= 1}
        return cls(costs=CostCurve(prior=prior), **kwargs)  # type: ignore[arg-type]

    def choose(self, gamma_max: int, kind: str = "text", drafted: int = 0, at_least: int = 0) -> int:
        """γ for the next round, in ``[0, gamma_max]``; ``kind``: the content kind the round drafts;
        ``drafted``: tokens of its draft already made (while the round before was in flight), which cost only
        verification. Charging that sunk drafting would turn a pipelined drafter off for good: at γ = 0
        nothing is drafted ahead, so its hidden cost is never seen. ``at_least``: the smallest γ to weigh
        (1 while the mode policy probes edge mode: a probe at γ = 0 would measure plain steps, not drafting)."""
        if gamma_max <= 0:
            return 0
        if self.costs.seconds(0) is None:
            return gamma_max  # nothing measured yet: draft fully, observe, then adapt
        self.last_rates = {}
        acceptance = self.current_acceptance(kind)
        for gamma in range(min(at_least, gamma_max), gamma_max + 1):
            t = max(gamma - drafted, 0) * self.draft_seconds_per_token + (self.costs.seconds(gamma) or 0.0)
            self.last_rates[gamma] = acceptance.expected_tokens(gamma) / t if t > 0 else 0.0
        best = max(self.last_rates, key=lambda g: (self.last_rates[g], -g))
        self._zero_streak = self._zero_streak + 1 if best == 0 else 0
        if best == 0 and self._zero_streak >= self.probe_every:
            self._zero_streak = 0
            return min(self.min_probe, gamma_max)
        return best

    def observe(self, drafted: int, reached: int, accepted: int, verify_s: float | None,
                draft_s: float | None = None, pass_tokens: int | None = None, kind: str = "text") -> None:
        """Feed back one round: ``verify_s`` only for decode-time passes (not prefill); ``draft_s`` the
        drafting on the round's critical path (0 for a draft made while the round before was in flight).

        Counts are of the tokens the policy chose (not grammar-forced ones); ``pass_tokens`` is the draft's
        full size when forced tokens rode along (default ``drafted``)."""
        if verify_s is not None:
            self.costs.observe(drafted if pass_tokens is None else pass_tokens, verify_s)
        if reached:
            self.acceptance.observe(reached, accepted)
            own = self.by_kind.setdefault(kind, AcceptanceEstimator(self.acceptance.prior_alpha,
                                                                     self.acceptance.prior_weight))
            own.observe(reached, accepted)
        if drafted and draft_s is not None:
            self.draft_seconds_per_token = ema(self.draft_seconds_per_token or None, draft_s / drafted, 0.2)
