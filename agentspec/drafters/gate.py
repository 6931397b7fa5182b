"""ModelGate: whether a tree's model branch earns its drafting time, judged from the rounds it drafted.

A :class:`~agentspec.drafters.tree.TreeDrafter` merges grammar-forced tokens, copy candidates and a model's
chain; the target accepts the tree's best path. A draft-length policy sees only the tree's total acceptance,
so a model drafter whose chain the copies already cover is credited with their tokens and keeps drafting at
full cost. The gate measures the model's *marginal* worth instead: after each round it replays the round's
candidates against the tokens the target committed (the next context says which), giving the tokens a round
commits with the model (``w1``) and without it (``w0``: the longest match among the other candidates, plus
the target's own token). With ``r`` the round's time without the model's drafting and ``m`` that drafting,
the model pays iff ``(r + m) / w1 < r / w0``, i.e. ``m·w0 < r·(w1 − w0)`` (averaged over rounds). While it
does not, the tree drafts without it and tries it again every ``probe_every`` rounds.

One gate serves many sessions (the verifier keeps one per API key): whether a model pays is a property of the
target, the model and the traffic, and an agent opens a new session for every step — far too few rounds to
judge the model anew each time. Each drafter keeps its own pending round (:class:`Drafted`) and hands it back.

Which tokens are drafted never changes what is committed (the target verifies every path), so the gate
is free to be wrong for a few rounds: it costs speed, never tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agentspec.drafters.base import common_prefix
from agentspec.router.estimators import ema


@dataclass
class Drafted:
    """What one greedy round drafted, kept by its drafter until the next context tells what it committed."""

    context_len: int
    last_token: int | None
    others: list[list[int]]  # forced span + each non-model candidate (the forced span alone included)
    model: list[list[int]]  # forced span + each model path (empty: the model did not draft this round)
    model_s: float
    started: float


class ModelGate:
    """Turn a tree's model branch off while it costs more time than the tokens it adds save."""

    def __init__(self, probe_every: int = 16, warmup: int = 4, weight: float = 0.25,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """``warmup``: rounds with the model before it can be turned off; ``weight``: the averages' EMA weight."""
        if probe_every < 1 or warmup < 1 or not 0.0 < weight <= 1.0:
            raise ValueError("probe_every and warmup must be >= 1 and weight in (0, 1]")
        self.probe_every, self.warmup, self.weight, self.clock = probe_every, warmup, weight, clock
        self.model_s: float | None = None  # the model's drafting per round that used it
        self.round_s: float | None = None  # a round's time without the model's drafting
        self.w0: float | None = None  # tokens a round commits without the model's paths
        self.w1: float | None = None  # ... with them
        self.samples = 0  # rounds with the model that were judged
        self.off_rounds = 0  # rounds drafted without the model since it last drafted
        self.paused = False  # the last judgeable round was taken for a pause

    @property
    def pays(self) -> bool:
        """Whether the model is worth its time on the rounds seen so far (True until ``warmup`` of them)."""
        if self.samples < self.warmup or None in (self.model_s, self.round_s, self.w0, self.w1):
            return True
        return self.model_s * self.w0 < self.round_s * (self.w1 - self.w0)

    def use_model(self, tokens: Sequence[int], last: Drafted | None = None) -> bool:
        """Judge ``last`` (the drafter's previous round) against ``tokens`` (its new context), then say whether
        this round drafts with the model: while it pays, and every ``probe_every``-th round while it does not."""
        if last is not None:
            self._settle(last, tokens)
        if self.pays or self.off_rounds + 1 >= self.probe_every:
            self.off_rounds = 0
            return True
        self.off_rounds += 1
        return False

    @staticmethod
    def drafted(tokens: Sequence[int], others: list[list[int]], model: list[list[int]], model_s: float,
                started: float) -> Drafted:
        """A greedy round's record for the drafter to keep: its context, its candidates (each with the forced
        span in front; ``model`` empty where the model did not draft), the model's seconds and the start."""
        return Drafted(len(tokens), tokens[-1] if tokens else None, others, model, model_s, started)

    def _settle(self, last: Drafted, tokens: Sequence[int]) -> None:
        if len(tokens) <= last.context_len:
            return
        if last.context_len and tokens[last.context_len - 1] != last.last_token:
            return  # another conversation
        committed = list(tokens[last.context_len :])
        longest = max((len(p) for p in last.others + last.model), default=0)
        if len(committed) > longest + 1:
            return  # more than a round can commit: a new turn (a tool result, a user message) followed
        elapsed = self.clock() - last.started
        if self.round_s is not None and elapsed - last.model_s > 4 * self.round_s and not self.paused:
            self.paused = True  # the caller paused between rounds (an agent step): not a round's time
            return
        # a second long gap in a row: the rounds themselves got slower (or the average began on a fast
        # outlier), and a filter that dropped them all would never sample again
        self.paused = False
        self.round_s = ema(self.round_s, max(elapsed - last.model_s, 1e-6), self.weight)
        if not last.model:
            return
        w0 = min(max((common_prefix(p, committed) for p in last.others), default=0) + 1, len(committed))
        w1 = min(max(w0 - 1, *(common_prefix(p, committed) for p in last.model)) + 1, len(committed))
        self.model_s = ema(self.model_s, last.model_s, self.weight)
        self.w0, self.w1 = ema(self.w0, w0, self.weight), ema(self.w1, w1, self.weight)
        self.samples += 1


class ModelGates:
    """One :class:`ModelGate` per key (an API key's owner tag), the least recently used dropped past ``most``:
    one tenant's traffic never decides whether another's rounds draft with the model."""

    def __init__(self, most: int = 1024, make: Callable[[], ModelGate] = ModelGate) -> None:
        if most < 1:
            raise ValueError("most must be >= 1")
        self.most, self.make = most, make
        self._gates: OrderedDict[str, ModelGate] = OrderedDict()

    def get(self, key: str) -> ModelGate:
        """``key``'s gate (a new one the first time)."""
        gate = self._gates.pop(key, None) or self.make()
        self._gates[key] = gate
        while len(self._gates) > self.most:
            self._gates.popitem(last=False)
        return gate
