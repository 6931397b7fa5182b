"""The mode policy: which mode (edge, server, server-ar) runs a request's next segment.

:class:`~agentspec.router.config.ModeConfig` holds the knobs; :class:`ModePolicy` holds only what it has
measured and predicts each mode's cost with :mod:`agentspec.router.costs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import agentspec.router.costs as costs
from agentspec.router.config import ModeConfig
from agentspec.router.estimators import ChainReplay, LinearCost, ema
from agentspec.router.gamma import DraftLengthPolicy
from agentspec.types import Taken


@dataclass
class ModePolicy:
    """Picks the mode of the next segment of a request (design.md's modes) from the closed forms.

    Inputs, all measured online: ``t_v(γ)`` (a :class:`LinearCost` over every reported pass) and ``t_ds`` from
    the server's timings; ``t_d`` per node (γ̄ counts a tree's nodes) from edge rounds' critical-path drafting
    per kind, and from its rounds replayed over text other modes committed (a cold first round's is the price
    of entering edge); RTT from edge rounds (wall − server compute) and session opens; ``E[A]`` and ``γ̄`` per
    mode and content kind (``"tool"``/``"text"``) from **shadow replays** (:meth:`observe_replays`: every
    mode judged on the *same* text), or from the mode's own rounds and its drafters replayed over text other
    modes committed (:meth:`observe_shadow`). Each round counts under its kind (``"tool"`` where it drafted
    or committed inside JSON), as ratios of sums decayed over ``config.round_memory`` rounds. A correction
    per mode and kind (EMA of measured / closed-form seconds per segment) absorbs what the closed forms leave out.

    Until a mode's inputs exist its measured seconds per token stands in; a mode never run is tried first.
    Modes judged without running them (shadowed, or server-ar) are never probed; the others every
    ``probe_every`` segments since they last ran in the segment's kind, backing off (up to
    ``max_probe_every``; :meth:`ModeConfig.backed_off`) per kind while probes there lose by more than
    ``probe_margin`` to what the incumbent measured there; a probe runs at most ``probe_tokens`` tokens in
    ``probe_rounds`` rounds. A switch needs the challenger ``hysteresis`` cheaper, and runs as trials first
    where its estimate in the kind is older than the incumbent's or rests on one probe, until they add up to
    ``trial_rounds`` rounds (:meth:`_on_older_text`); trials that measured it no cheaper make it wait for its
    next probe (:meth:`_lost_trials`). A saturated server makes server-side drafting cost ``busy_penalty``
    more. ``api`` is never chosen automatically: another model.
    """

    config: ModeConfig = field(default_factory=ModeConfig)
    seconds_per_token: dict[str, float] = field(default_factory=dict)
    last_used: dict[tuple[str, str], int] = field(default_factory=dict)  # (mode, kind) -> the segment it last ran
    last_predictions: dict[str, float] = field(default_factory=dict)
    edge: DraftLengthPolicy = field(
        default_factory=lambda: DraftLengthPolicy(costs=LinearCost(), probe_every=8, costs_by_nodes=True))
    current: str | None = None
    segments: int = 0
    server_waiting: int = 0
    probe_interval: dict[tuple[str, str], int] = field(default_factory=dict)  # (mode, kind); backs off on losses
    probing: str | None = None  # the mode of the segment in flight, when it is a probe
    scheduled: bool = False  # the segment in flight is a probe that was due (not a trial of a switch)
    trial_left: int | None = None  # the rounds a trial in flight may run (None: a probe's tokens)
    # (mode, kind) -> rounds of the trials since its last probe there (None: its last run was a whole segment)
    trial_streak: dict[tuple[str, str], int | None] = field(default_factory=dict)
    # (mode, kind) -> (seconds, tokens) of its trials there since its last probe or whole segment there
    trial_cost: dict[tuple[str, str], tuple[float, int]] = field(default_factory=dict)
    last_probe: int = 0
    tenure: int | None = None  # segments the current mode has run since a switch (None: it was never switched)
    server_costs: LinearCost = field(default_factory=LinearCost)  # server-reported t_v(γ), fitted
    # mode -> (E[A], γ̄): from round_sums for the modes whose rounds are reported, else an EMA per segment/replay
    per_round: dict[str, tuple[float, float]] = field(default_factory=dict)
    per_round_kind: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)  # (mode, kind) -> ...
    correction: dict[str, float] = field(default_factory=dict)  # mode -> measured / predicted, EMA
    correction_kind: dict[tuple[str, str], float] = field(default_factory=dict)  # (mode, kind) -> the same
    measured_kind: dict[tuple[str, str], float] = field(default_factory=dict)  # (mode, kind) -> s/token, EMA
    last_measured: dict[tuple[str, str], float] = field(default_factory=dict)  # ... its latest segment's
    # (mode, kind or None for all kinds) -> decayed sums of (tokens, drafted, rounds) of its reported rounds
    round_sums: dict[tuple[str, str | None], tuple[float, float, float]] = field(default_factory=dict)
    rtt: float | None = None  # wall − server compute − local drafting, per edge round (EMA)
    rtt_open: float | None = None  # the same per session open (EMA)
    _rtt_open_at_edge: float | None = None
    t_ds: float | None = None  # server-side draft seconds per token (EMA)
    t_d_shadow: float | None = None  # local draft seconds per token seen in the edge shadow (EMA)
    # kind -> decayed sums of (seconds, nodes) an edge round drafted on its critical path: t_d per node of γ̄
    edge_drafting: dict[str, tuple[float, float]] = field(default_factory=dict)
    entry_drafting: dict[str, float] = field(default_factory=dict)  # kind -> a cold first edge round's (EMA)
    t_catchup: float | None = None  # the local model drafter's prefill seconds per token it catches up on (EMA)
    # segment start kind -> round kind -> decayed tokens its segments committed in rounds of that kind
    kind_mix: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def modes(self) -> list[str]:
        c = self.config
        own = (["edge"] if c.has_drafter else []) + ["server", "server-ar"] if c.has_verifier else []
        return own + (["vllm"] if c.has_deployment else [])

    def _needs_probes(self, mode: str, kind: str) -> bool:
        """Whether ``mode``'s estimate only stays fresh by running it (no closed form from shared inputs)."""
        return not (mode == "server-ar" or mode in self.config.shadowed) or self.closed_form(mode, kind=kind) is None

    def choose(self, kind: str = "text", exclude: frozenset[str] = frozenset(), catchup_tokens: int = 0,
               cold: bool = False) -> str:
        """The mode for the next segment; ``kind``: what the segment starts in (``"tool"`` or ``"text"``);
        ``exclude``: modes this request cannot run in (never all of them); ``catchup_tokens``: the tokens the
        local model drafter would prefill before its first edge draft (committed while another mode ran);
        ``cold``: no edge draft is made ahead, so an edge segment's first round drafts on its critical path."""
        c = self.config
        self.segments += 1
        modes = [m for m in self.modes if m not in exclude]
        if not modes:
            raise ValueError(f"every mode of {self.modes} is excluded for this request")
        untried = [m for m in modes if m not in self.seconds_per_token]
        predicted = {m: self.predicted(m, kind) for m in modes}
        if "edge" in predicted:  # the catch-up and a cold first round are paid once on entering edge: spread
            entry = self.entry_drafting.get(kind, self.entry_drafting.get("text", 0.0)) if cold else 0.0
            predicted["edge"] += (catchup_tokens * (self.t_catchup or 0.0) + entry) / c.segment_tokens
        self.last_predictions = {m: s * 1e3 for m, s in predicted.items()}
        due = [m for m in modes if m != self.current and self._needs_probes(m, kind)
               and self.segments - self.last_used.get((m, kind), 0) >= self._probe_after(m, kind, catchup_tokens)]
        if self.segments - self.last_probe < c.probe_every:
            due = []  # at most one probe every probe_every segments, whatever the number of modes
        self.probing, self.scheduled, self.trial_left = None, False, None
        if untried:
            pick = untried[0]
        elif due and self.current is not None:
            pick = self.probing = min(due, key=lambda m: self.last_used.get((m, kind), -1))
            self.last_probe, self.scheduled = self.segments, True
        else:
            pick = min(modes, key=predicted.__getitem__)
            if self.current in predicted and (predicted[pick] > (1 - c.hysteresis) * predicted[self.current]
                                              or self._lost_trials(pick, kind)):
                pick = self.current
            if self._on_older_text(pick, kind):  # a trial: the incumbent stays current until its rounds agree
                # once trials measured it cheaper, the rest of trial_rounds run as one segment (short ones pay a
                # request and a cold first round each; one that loses still reverts); the first, probe_tokens
                self.probing, streak = pick, self.trial_streak.get((pick, kind)) or 0
                tried = self.trial_cost.get((pick, kind), (0.0, 0))[1]
                self.trial_left = max(c.trial_rounds - streak, 0) if tried else None
            else:
                switched = self.current not in (None, pick)
                self.tenure = 0 if switched else None if self.tenure is None else self.tenure + 1
                self.current = pick
        self.last_used[(pick, kind)] = self.segments
        return pick

    def segment_limit(self) -> int:
        """The most tokens of the segment :meth:`choose` just picked: a probe's ``probe_tokens`` (a first trial's;
        later ones, ``segment_tokens`` in their rounds left), and so a switch's first segment's, doubling per
        segment it stays current up to ``segment_tokens``: a switch won on a copyable stretch is judged again."""
        c = self.config
        if self.probing is not None:
            return c.segment_tokens if self.trial_left else min(c.probe_tokens, c.segment_tokens)
        if self.tenure is None:
            return c.segment_tokens
        return min(c.probe_tokens << min(self.tenure, 16), c.segment_tokens)

    def segment_rounds(self, mode: str | None = None, opening: bool = False) -> int | None:
        """The most rounds of the ``mode`` segment :meth:`choose` just picked: a due probe's ``probe_rounds`` (its
        cost is its passes); a trial's rounds left of ``trial_rounds``; a server segment's ``opening_rounds``
        where it opens a message (``opening``: a call copies at 4 tokens a round, prose may run at one; once
        its rounds tell which, the mode is chosen again); else None, its tokens alone limit it."""
        caps = (self.trial_left, self.config.opening_rounds if opening and mode == "server" else None)
        return self.config.probe_rounds if self.scheduled else min((r for r in caps if r), default=None)

    def _on_older_text(self, pick: str, kind: str) -> bool:
        """Whether switching to ``pick`` would rest on too little or too old text: ``pick`` is judged by its
        own runs and either last ran in ``kind`` before the incumbent did, or its newest runs there were a
        probe and trials of fewer than ``config.trial_rounds`` rounds (maybe all a copyable stretch: an id, a
        call's opening). Such a switch runs as trials first, whose rounds decide."""
        current, streak = self.current, self.trial_streak.get((pick, kind))
        if current is None or pick == current or not self._needs_probes(pick, kind):
            return False
        return ((streak is not None and streak < self.config.trial_rounds)
                or self.last_used.get((pick, kind), -1) < self.last_used.get((current, kind), -1))

    def _lost_trials(self, pick: str, kind: str) -> bool:
        """Whether ``pick``'s trials in ``kind`` since its last probe there measured it no cheaper (by
        ``config.hysteresis``) than the dearest of the incumbent's EMA there, its latest segment there (the
        text beside the trials: a message's novel opening is dear in every mode) and its prediction (the text
        moved on to what it drafts worse): it then waits for its next probe, whatever its closed form says.
        The trials alone count: the probe before them often fell on a copyable stretch."""
        seconds, tokens = self.trial_cost.get((pick, kind), (0.0, 0))
        if self.current is None or pick == self.current or not tokens:
            return False
        here = (self.current, kind)
        incumbent = max(self.measured_kind.get(here, 0.0), self.last_measured.get(here, 0.0), self.predicted(*here))
        return seconds / tokens > (1 - self.config.hysteresis) * incumbent

    def _probe_after(self, mode: str, kind: str, catchup_tokens: int) -> int:
        """Segments since ``mode`` last ran before it is probed again; an edge probe waits one more interval
        for its drafter to catch up (a probe that starts with a prefill pays for it on top of its rounds)."""
        interval = self.probe_interval.get((mode, kind), self.config.probe_every)
        return 2 * interval if mode == "edge" and catchup_tokens else interval

    def predicted(self, mode: str, kind: str = "text") -> float:
        """Expected seconds per token of ``mode`` for a segment that starts in ``kind``: for the modes whose
        rounds depend on the text (edge, server), each round kind's estimate (:meth:`_predicted_in`) weighed by
        its share of the tokens such segments committed (:attr:`kind_mix`): a call's opening segment starts in
        text, its fence, and goes on in its JSON (priced as prose alone, edge came out at twice its measure)."""
        mix = self.kind_mix.get(kind)
        # a shadowed mode's figures are replays over whole segments, already of the kinds they went on in
        if not mix or mode not in ("edge", "server") or mode in self.config.shadowed:
            return self._predicted_in(mode, kind)
        total = sum(mix.values())
        return sum(tokens / total * self._predicted_in(mode, k) for k, tokens in mix.items())

    def _predicted_in(self, mode: str, kind: str) -> float:
        """Seconds per token of ``mode``'s rounds of ``kind``: the corrected closed form, else the measured EMA."""
        cost = self.closed_form(mode, kind=kind)
        correction = self.correction_kind.get((mode, kind), self.correction.get(mode, 1.0))
        cost = self.seconds_per_token.get(mode, 0.0) if cost is None else cost * correction
        if mode == "server" and self.server_waiting > 0:
            cost *= self.config.busy_penalty
        return cost

    def network_s(self) -> float | None:
        """The current round trip estimate: the edge rounds', moved by how session opens have moved since."""
        if self.rtt is None:
            return self.rtt_open
        if self.rtt_open is None or self._rtt_open_at_edge is None:
            return self.rtt
        return max(self.rtt + self.rtt_open - self._rtt_open_at_edge, 0.0)

    def closed_form(self, mode: str, per_round: tuple[float, float] | None = None, kind: str = "text") -> float | None:
        """design.md's seconds per token of ``mode`` (uncorrected), or None while an input is missing;
        ``per_round``: (E[A], γ̄) to use instead of the mode's current estimate for ``kind``."""
        rtt, segment_tokens = self.network_s(), self.config.segment_tokens
        if rtt is None:
            return None
        if mode == "server-ar":
            t_ar = self.server_costs.seconds(0)
            return None if t_ar is None else costs.streamed_cost(costs.plain_cost(t_ar), rtt, segment_tokens)
        mean_accepted, gamma = per_round or self.per_round_kind.get((mode, kind)) or self.per_round.get(mode) or (0, 0)
        t_v = self.server_costs.seconds(gamma)
        if t_v is None or mean_accepted <= 0:
            return None
        if mode == "edge":
            seconds, nodes = self.edge_drafting.get(kind, (0.0, 0.0))
            t_d = seconds / nodes if nodes else self.edge.draft_seconds_per_token or self.t_d_shadow or 0.0
            return costs.edge_round_s(gamma, t_d, t_v, rtt) / mean_accepted
        if mode == "server" and self.t_ds is not None:
            return costs.streamed_cost(costs.colocated_round_s(gamma, self.t_ds, t_v) / mean_accepted, rtt,
                                       segment_tokens)
        return None

    def gamma(self, mode: str, gamma_max: int, kind: str = "text", drafted: int = 0, pipelined: bool = False) -> int:
        """Draft length for the next edge round (``kind``: the content kind it drafts; ``drafted``: tokens of its
        draft made ahead; ``pipelined``: its successor is drafted while it is in flight; see
        :meth:`DraftLengthPolicy.choose`); at least 1 in an edge probe: at γ = 0 it would time plain steps."""
        at_least = 1 if self.probing == "edge" else 0
        return gamma_max if mode != "edge" else self.edge.choose(gamma_max, kind, drafted, at_least, pipelined)

    def observe_catchup(self, tokens: int, seconds: float) -> None:
        """A catch-up prefill of the local model drafter: ``tokens`` fed at once in ``seconds``."""
        if tokens > 0:
            self.t_catchup = ema(self.t_catchup, seconds / tokens, self.config.ema)

    def observe_open(self, wall_s: float, server_s: float) -> None:
        """A session open's wall time and the server's compute in it (prefill): tracks the round trip."""
        self.rtt_open = ema(self.rtt_open, max(wall_s - server_s, 0.0), self.config.ema)

    def observe_round(self, mode: str, drafted: int, accepted: int, emitted: int, *, wall_s: float,
                      server_s: float, verify_s: float, draft_s: float, waiting: int | None = None,
                      kind: str = "text", fresh: int | None = None, taken: Taken | None = None,
                      segment_kind: str | None = None, entry: bool = False) -> None:
        """One round's reply as the client saw it; ``wall_s`` is the request's wall time (drafting excluded),
        ``waiting`` the server's queue when it reported its load, ``kind`` what the round drafted (its
        ``emitted`` tokens count toward :attr:`kind_mix` of ``segment_kind``, the kind its segment started
        in), ``fresh`` the tokens drafted on its critical path (in ``draft_s``; the rest were drafted ahead),
        ``taken`` what the target took of an edge round's draft (:meth:`~agentspec.client.run.Run.taken`;
        default: a chain), ``entry`` whether it is an edge segment's cold first round (no draft made ahead:
        :meth:`choose` charges its drafting to entering edge, and edge's drafting per node leaves it out)."""
        if waiting is not None:
            self.server_waiting = int(waiting)
        if segment_kind is not None and emitted:
            keep = 1.0 - 1.0 / self.config.round_memory
            mix = {k: keep * tokens for k, tokens in self.kind_mix.get(segment_kind, {}).items()}
            self.kind_mix[segment_kind] = {**mix, kind: mix.get(kind, 0.0) + emitted}
        if verify_s > 0:
            self.server_costs.observe(drafted, verify_s)
        if mode == "server" and drafted and server_s > verify_s:
            self.t_ds = ema(self.t_ds, (server_s - verify_s) / drafted, self.config.ema)
        if mode in ("edge", "server") and mode not in self.config.shadowed:
            self._observe_round_counts(mode, kind, emitted, drafted)
        if mode == "edge":
            self.rtt = ema(self.rtt, max(wall_s - server_s, 0.0), self.config.ema)
            self._rtt_open_at_edge = self.rtt_open
            keep, (seconds, nodes) = 1.0 - 1.0 / self.config.round_memory, self.edge_drafting.get(kind, (0.0, 0.0))
            if entry:  # its price is entering edge, as a catch-up's: a probe's few rounds are mostly such
                self.entry_drafting[kind] = ema(self.entry_drafting.get(kind), draft_s, self.config.ema)
            else:  # per node, as γ̄ counts
                self.edge_drafting[kind] = (keep * seconds + draft_s, keep * nodes + drafted)
            (gamma, reached, took), spine = taken or ((drafted, min(drafted, accepted + 1), accepted), None)
            self.edge.observe(gamma, reached, took, max(wall_s, 1e-6), draft_s, pass_tokens=drafted, kind=kind,
                             fresh=fresh, spine=spine)

    def _observe_round_counts(self, mode: str, kind: str, tokens: int, drafted: int) -> None:
        """(E[A], γ̄) of ``mode``, in all and in ``kind``: decayed sums of tokens, drafts and rounds (a ratio
        of sums, not a mean of per-round ratios: rounds of 1 and of 8 tokens average to 4.5 tokens a round)."""
        keep = 1.0 - 1.0 / self.config.round_memory
        for key, table, at in (((mode, None), self.per_round, mode), ((mode, kind), self.per_round_kind, (mode, kind))):
            n, d, r = self.round_sums.get(key, (0.0, 0.0, 0.0))
            n, d, r = keep * n + tokens, keep * d + drafted, keep * r + 1.0
            self.round_sums[key] = (n, d, r)
            table[at] = (n / r, d / r)

    def observe_replays(self, replays: Mapping[str, ChainReplay], kind: str | None = None) -> None:
        """Shadow replays over a segment's committed tokens (mode → replayed rounds), for modes in
        ``config.shadowed``; ``kind``: the content kind the segment started in (kept apart too)."""
        unknown = set(replays) - self.config.shadowed
        if unknown:
            raise ValueError(f"replays for {sorted(unknown)}, which ModeConfig.shadowed does not list")
        for mode, r in replays.items():
            self._per_round(mode, r.tokens / r.rounds, r.drafted / r.rounds, kind)
            if mode == "edge" and r.drafted:
                self.t_d_shadow = ema(self.t_d_shadow, r.draft_s / r.drafted, self.config.ema)

    def observe_shadow(self, mode: str, replay: ChainReplay, kind: str = "text",
                       drafting: ChainReplay | None = None) -> None:
        """``mode``'s rounds replayed over text another mode committed: edge's from the local model drafter's
        greedy choices its catch-up computed (:func:`~agentspec.drafters.replay.replay_known_next`), server's
        from a chain of its copy drafts. They count with the mode's own rounds of ``kind`` (E[A], γ̄), so its
        estimate follows the text in hand while it does not run, not its last probe or a warm-up's prose (a
        chain: a lower bound where a tree's branches or grammar add). ``drafting``: edge's pipelined rounds
        over that text (``fresh``: tokens drafted on their critical path, at the drafter's seconds per fresh
        token), counted with its rounds' critical-path drafting per node for the same reason."""
        if mode not in ("edge", "server") or mode in self.config.shadowed or not (drafting is None or mode == "edge"):
            raise ValueError(f"a shadow counts with a probed mode's rounds (edge, server; drafting: edge), not {mode!r}")
        for _ in range(replay.rounds):
            self._observe_round_counts(mode, kind, replay.tokens / replay.rounds, replay.drafted / replay.rounds)
        per_token, nodes = self.edge.fresh_seconds_per_token, self.edge.nodes_per_draft or 1.0
        if drafting is None or not (drafting.rounds and per_token):
            return
        keep, (seconds, drafted) = 1.0 - 1.0 / self.config.round_memory, self.edge_drafting.get(kind, (0.0, 0.0))
        for _ in range(drafting.rounds):
            seconds = keep * seconds + drafting.fresh * per_token / drafting.rounds
            drafted = keep * drafted + drafting.drafted * nodes / drafting.rounds
        self.edge_drafting[kind] = (seconds, drafted)

    def _per_round(self, mode: str, mean_accepted: float, gamma: float, kind: str | None = None) -> None:
        keys = [(self.per_round, mode)] + ([(self.per_round_kind, (mode, kind))] if kind is not None else [])
        for table, key in keys:
            old = table.get(key, (None, None))
            table[key] = (ema(old[0], mean_accepted, self.config.ema), ema(old[1], gamma, self.config.ema))

    def observe_segment(self, mode: str, seconds_per_token: float, *, tokens: int = 0, rounds: int = 0,
                        drafted: int = 0, draft_s: float = 0.0, kind: str | None = None,
                        catchup_s: float = 0.0, entry_s: float = 0.0, ended: bool = False) -> None:
        """A finished segment's wall seconds per committed token in ``mode`` (and, when known, its token,
        round and draft counts, the local drafter's seconds in it and the content kind it started in).

        ``catchup_s``: the local model drafter's catch-up prefill in the segment (in its wall time, not in
        ``draft_s``). It is the price of entering the mode, which :meth:`choose` charges from the tokens to
        catch up on; the mode's own estimates and a probe's verdict leave it out. ``entry_s``: the drafting of
        an edge segment's cold first round, charged to entering edge too (:meth:`choose`), so left out of the
        same (not of the correction: the closed form of the segment counts it in ``draft_s``). A server-side
        mode's segment shorter than ``segment_tokens`` is judged with a whole segment's share of its RTT.
        ``ended``: its message ended in it, and before ``probe_tokens`` tokens: no verdict (a cut round's)."""
        c = self.config
        k, rtt = kind or "text", self.network_s()
        wall_s = max(seconds_per_token * tokens - catchup_s, 0.0)  # the correction's: draft_s has the entry
        if tokens:
            seconds_per_token = max(wall_s - entry_s, 0.0) / tokens
        if mode != "edge" and 0 < tokens < c.segment_tokens and rtt:
            # a streamed segment pays one round trip however few tokens it commits: a probe's, a trial's or
            # an answer's last few are judged as a whole segment pays it, or a short probe loses on the RTT
            seconds_per_token = max(seconds_per_token - rtt * (1 / tokens - 1 / c.segment_tokens), 0.0)
        if ended and tokens < c.probe_tokens:  # its rounds committed what was left of the message, not a mode's
            self.seconds_per_token.setdefault(mode, seconds_per_token)  # tried, though not judged
            if mode == self.probing:  # nor switched to: what follows is a trial still
                self.trial_streak[(mode, k)] = self.trial_streak.get((mode, k)) or 0
        else:
            self._verdict(mode, k, seconds_per_token, tokens, rounds)
        self.probing = None
        if not (tokens and rounds) or rtt is None or mode not in self.modes:
            return
        if mode not in c.shadowed and mode != "server-ar" and (mode, None) not in self.round_sums:
            self._per_round(mode, tokens / rounds, drafted / rounds, kind)  # no round of it was reported
        # the closed form on the segment's own counts: the correction absorbs nothing of the text's predictability
        predicted = costs.segment_s(mode, tokens, rounds, drafted, draft_s, rtt, self.server_costs.seconds, self.t_ds)
        if predicted is not None and predicted > 0:
            ratio = min(max(wall_s / predicted, 0.5), 3.0)
            self.correction[mode] = ema(self.correction.get(mode), ratio, c.correction_ema)
            self.correction_kind[(mode, k)] = ema(self.correction_kind.get((mode, k)), ratio, c.correction_ema)

    def _verdict(self, mode: str, k: str, seconds_per_token: float, tokens: int, rounds: int) -> None:
        """A segment's verdict (:meth:`observe_segment`): a probe's back-off, a trial's count, the EMAs."""
        c = self.config
        if mode == self.probing and self.current is not None and self.current != mode:
            # against what the incumbent measured here: its prediction may rest on another kind's text
            incumbent = self.measured_kind.get((self.current, k)) or self.predicted(self.current, k)
            interval = self.probe_interval.get((mode, k), c.probe_every)
            self.probe_interval[(mode, k)] = c.backed_off(interval, seconds_per_token / incumbent)
        if mode != self.probing:
            self.trial_streak[(mode, k)] = None
            self.trial_cost.pop((mode, k), None)
        elif self.scheduled:  # a probe alone never switches: a trial follows
            self.trial_streak[(mode, k)], self.trial_cost[(mode, k)] = 0, (0.0, 0)
        else:
            self.trial_streak[(mode, k)] = (self.trial_streak.get((mode, k)) or 0) + (rounds or tokens)
            spent, counted = self.trial_cost.get((mode, k), (0.0, 0))
            self.trial_cost[(mode, k)] = (spent + seconds_per_token * tokens, counted + tokens)
        self.seconds_per_token[mode] = ema(self.seconds_per_token.get(mode), seconds_per_token, c.ema)
        self.measured_kind[(mode, k)] = ema(self.measured_kind.get((mode, k)), seconds_per_token, c.ema)
        self.last_measured[(mode, k)] = seconds_per_token
