"""The mode policy's knobs (:class:`ModeConfig`), checked once, and the rules that read only them."""

from __future__ import annotations

import math
from dataclasses import dataclass

SHADOWABLE = ("edge", "server")  # the modes whose chain drafters can be replayed over committed text


@dataclass(frozen=True)
class ModeConfig:
    """The mode policy's knobs (see :class:`~agentspec.router.modes.ModePolicy`), checked once, here; ``gamma_max`` and
    ``segment_tokens`` are the client's (γ of the shadow replays, S of the closed forms); ``shadowed``:
    the modes whose E[A] comes only from shadow replays (:meth:`~agentspec.router.modes.ModePolicy.observe_replays`)."""

    has_drafter: bool = True
    has_api: bool = False
    has_verifier: bool = True  # an agentspec-verifier: edge, server and server-ar
    has_deployment: bool = False  # an OpenAI-compatible deployment of the target: the vllm mode
    hysteresis: float = 0.05
    probe_every: int = 8
    max_probe_every: int = 128
    probe_margin: float = 0.25
    probe_tokens: int = 8  # a probe segment's most tokens: a losing probe costs these, not a whole segment
    probe_rounds: int = 3  # and its most rounds (passes): a mode that commits a token a pass loses on these
    opening_rounds: int = 8  # a server segment's most rounds where it opens a message: a call or prose?
    trial_rounds: int = 12  # rounds of trials before a switch is made for good: as many as an estimate rests on
    busy_penalty: float = 1.25
    ema: float = 0.3
    correction_ema: float = 0.15  # slower: one segment's wall time scatters by 10-20 % on a busy CPU
    round_memory: int = 12  # rounds an (E[A], γ̄) estimate mostly rests on: a kind's text changes within a call
    gamma_max: int = 4
    segment_tokens: int = 16
    shadowed: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shadowed", frozenset(self.shadowed))
        checks = {"hysteresis must be in [0, 1)": 0.0 <= self.hysteresis < 1.0,
                  "probe_every must be >= 1": self.probe_every >= 1,
                  "max_probe_every must be >= 1": self.max_probe_every >= 1,
                  "probe_margin must be >= 0": self.probe_margin >= 0.0,
                  "probe_tokens must be >= 1": self.probe_tokens >= 1,
                  "probe_rounds must be >= 1": self.probe_rounds >= 1,
                  "opening_rounds must be >= 1": self.opening_rounds >= 1,
                  "trial_rounds must be >= 0": self.trial_rounds >= 0,
                  "busy_penalty must be >= 1": self.busy_penalty >= 1.0,
                  "ema must be in (0, 1]": 0.0 < self.ema <= 1.0,
                  "correction_ema must be in (0, 1]": 0.0 < self.correction_ema <= 1.0,
                  "round_memory must be >= 1": self.round_memory >= 1,
                  "gamma_max must be >= 0": self.gamma_max >= 0,
                  "segment_tokens must be >= 1": self.segment_tokens >= 1,
                  f"shadowed modes must be among {SHADOWABLE}": self.shadowed <= set(SHADOWABLE)}
        bad = [message for message, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"ModeConfig: {'; '.join(bad)} (got {self!r})")

    def backed_off(self, interval: int, lost_by: float) -> int:
        """The probe interval after a probe that ran ``lost_by`` times the incumbent's seconds per token: reset
        to ``probe_every`` unless it lost by more than ``probe_margin``; else ``interval`` doubled once per
        factor of ``1 + probe_margin`` in ``lost_by`` (at least once), up to ``max_probe_every``. A probe of
        a mode twice as dear costs as much as one that lost narrowly, for a far smaller chance of a win."""
        if not lost_by > 1 + self.probe_margin:
            return self.probe_every
        steps = 1 if self.probe_margin <= 0 else max(int(math.log(lost_by) / math.log1p(self.probe_margin)), 1)
        return min(interval << min(steps, 16), self.max_probe_every)
