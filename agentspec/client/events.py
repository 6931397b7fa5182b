"""What a request yields and reports: the events of :meth:`SpecClient.stream` and the statistics.

Stream order: :class:`TextEvent`, :class:`ToolCallEvent` and optional :class:`PreviewEvent` (unverified
draft text), last :class:`FinalEvent` with :class:`ClientStats` (one :class:`SegmentStats` per segment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextEvent:
    text: str


@dataclass
class PreviewEvent:
    """Draft text not yet verified: show it greyed out; it may be replaced by the next TextEvent."""

    text: str


@dataclass
class ToolCallEvent:
    index: int
    id: str
    name: str
    arguments: str


@dataclass
class SegmentStats:
    mode: str
    tokens: int
    rounds: int
    drafted: int
    accepted: int
    wall_s: float
    server_s: float  # server-reported compute (verify + draft)
    draft_s: float  # local drafting on the critical path (a pipelined round's draft was ready: 0)
    predicted_ms_per_token: dict[str, float] = field(default_factory=dict)
    kind: str = "text"  # content kind at the segment's start: "tool" (inside a tool call's JSON) or "text"
    pipelined: int = 0  # edge rounds whose draft was made while the round before was in flight
    draft_ahead_s: float = 0.0  # local drafting overlapped with requests in flight: drafts ahead, catch-ups
    probe: bool = False  # the router ran this mode to re-measure it (a short segment: ModeConfig.probe_tokens, probe_rounds)
    catchup_s: float = 0.0  # the local model drafter's prefill of tokens it had not seen (edge; not in draft_s)
    # edge, where its first round had no draft made ahead (entering edge, a request's start): that round's
    # drafting on its critical path, the price of entering edge as a catch-up is (None: it had one)
    entry_s: float | None = None

    def add_round(self, tokens: int, drafted: int, accepted: int, server_s: float, draft_s: float) -> None:
        """Count one round: the tokens it committed, its draft and what the target took of it, the server's
        compute and the local drafting on its critical path."""
        self.rounds += 1
        self.tokens += tokens
        self.drafted += drafted
        self.accepted += accepted
        self.server_s += server_s
        self.draft_s += draft_s


@dataclass
class ClientStats:
    segments: list[SegmentStats] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.segments)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.segments)

    @property
    def mean_accepted_length(self) -> float:
        rounds = sum(s.rounds for s in self.segments)
        return sum(s.tokens for s in self.segments) / rounds if rounds else 0.0

    @property
    def network_s(self) -> float:
        """Wall time not spent computing (server compute, local drafting and catch-up excluded): RTT and overheads."""
        return sum(max(s.wall_s - s.server_s - s.draft_s - s.catchup_s, 0.0) for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {"modes": [s.mode for s in self.segments], "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted_length": self.mean_accepted_length, "network_s": self.network_s,
                "server_s": sum(s.server_s for s in self.segments), "draft_s": sum(s.draft_s for s in self.segments),
                "catchup_s": sum(s.catchup_s for s in self.segments),
                "pipelined_rounds": sum(s.pipelined for s in self.segments),
                "draft_ahead_s": sum(s.draft_ahead_s for s in self.segments), "fallbacks": list(self.fallbacks),
                "segments": [vars(s) for s in self.segments]}


@dataclass
class FinalEvent:
    text: str
    tokens: list[int]  # generated token ids committed by verifiers (API-mode text has none)
    tool_calls: list[ToolCallEvent]
    finish_reason: str
    usage: dict[str, int]  # verifier tokens plus the API fallback's reported usage, when it answered too
    stats: ClientStats
    model: str | None = None  # the model that answered: the API model once it took over, else the verifier's
    logprobs: list[dict[str, Any]] | None = None  # OpenAI ``logprobs.content`` entries, when asked for
