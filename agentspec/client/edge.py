"""Edge drafting: the local drafter's proposal for each edge round, its preview, and pipelining.

Each edge round uses the draft made while the round before was in flight when its hypothesis came true,
else a fresh one (γ from the router). Nothing here does I/O: the client's steps run these calls as
:class:`~agentspec.client.ops.Call` requests (the caller's thread when sync, the drafting thread when async).
"""

from __future__ import annotations

import difflib
import logging
import math
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import Any, NamedTuple

from agentspec.client.events import SegmentStats
from agentspec.client.ops import Call, WhileDrafting
from agentspec.client.run import Run
from agentspec.drafters.base import (
    CATCHUP_MIN,
    DraftContext,
    catch_up,
    catchup_tokens,
    common_prefix,
    propose_round,
    take_catchup,
)
from agentspec.router import ModePolicy, ema
from agentspec.toolcalls import normalise_tools, render_chat
from agentspec.types import DraftProposal, SamplingParams

log = logging.getLogger(__name__)

# pipelined edge drafting pays off once a round's drafting costs more than handing its request to another
# thread and back (a sub-millisecond n-gram drafter's rounds ran slower pipelined than not)
PIPELINE_MIN_DRAFT_S = 0.002
CATCHUP_CHUNK = 128  # the most tokens per catch-up prefill (longer ones barely run faster per token)
RESYNC_MIN = 8  # tokens two renderings of a prompt must share in a row to be taken as aligned (resync)


class EdgeRound(NamedTuple):
    """An edge round's draft: the request body, the drafting on its critical path (seconds, and the tokens
    drafted there: the rest were drafted while the round before was in flight), its preview, the proposal."""

    body: dict[str, Any]
    draft_s: float
    fresh: int
    preview: str
    prop: DraftProposal


class EdgeDrafting:
    """A client's edge drafting: γ's ceiling, pipelining (None: while drafting takes at least
    :data:`PIPELINE_MIN_DRAFT_S`), previews, and the generator sampled drafts draw from."""

    def __init__(self, num_draft_tokens: int, pipeline: bool | None, tokenizer: Any, preview: bool,
                 observe_catchup: Callable[[int, float], None] | None = None) -> None:
        """``observe_catchup(tokens, seconds)``: told each catch-up chunk prefilled while a request is in
        flight (the router's catch-up rate, :meth:`~agentspec.router.ModePolicy.observe_catchup`)."""
        self.num_draft_tokens, self.pipeline = num_draft_tokens, pipeline
        self.tokenizer, self.preview, self.observe_catchup = tokenizer, preview, observe_catchup
        self.round_draft_s: float | None = None  # EMA of one proposal's drafting seconds (fresh or ahead)
        self.flight_s: float | None = None  # EMA of an edge round's wall time, when drafted ahead of
        # a server round's seconds and tokens in the last server segment: how long a catch-up chunk may take
        self.round_s: float | None = None
        self.round_tokens: float | None = None
        self.chunk_s: dict[int, float] = {}  # catch-up chunk seconds (EMA) by tokens prefilled
        self.last_prompt: list[int] = []  # the last session's prompt: the next one's likely prefix
        self._torch_generator: Any = None

    def round(self, run: Run, seg: SegmentStats, policy: ModePolicy) -> EdgeRound:
        """Draft for the next edge round; the draft made ahead is used only when the committed tokens are the
        ones it assumed. A model drafter's catch-up prefill is not drafting: it goes to ``seg.catchup_s`` and
        the router."""
        left = run.max_tokens - run.generated - 1  # no draft at all with one token left (γ = -1)
        ahead, run.ahead = run.ahead, None
        cold = not seg.rounds and ahead is None
        if ahead is not None and ahead[0] != tuple(run.tokens):
            ahead = None  # its hypothesis failed
        made = 0 if ahead is None else len(ahead[1].spine()) - ahead[1].num_forced  # free drafts γ may use
        gamma = -1
        if left > 0:
            gamma = min(policy.gamma("edge", self.gamma_max(run), kind=run.kind, drafted=made,
                                     pipelined=self.pipelining()), left)
        fresh = 0
        if ahead is not None and gamma >= 0:
            prop, draft_s = ahead[1].cut(0, gamma + ahead[1].num_forced), 0.0
            seg.pipelined += 1
            if gamma > made:  # the draft ahead stopped at the reply: its drafter goes on from where it was
                more, draft_s, _ = self._propose(run, gamma - made, run.tokens + prop.spine_tokens())
                fresh = len(more.spine()) - more.num_forced
                if len(more):
                    prop = _join(prop, more)
        else:
            prop, draft_s, (caught, caught_s) = self._propose(run, gamma)
            fresh = len(prop.spine()) - prop.num_forced  # sibling leaves cost no drafting pass
            if caught:  # a prefill: the router charges it to switching to edge, not to the tokens drafted
                seg.catchup_s += caught_s
                policy.observe_catchup(caught, caught_s)
        prop = prop.within(run.flat_draft_tokens)  # forced spans and tree leaves ride on top of γ
        if cold:
            seg.entry_s = draft_s
        if log.isEnabledFor(logging.DEBUG):
            log.debug("edge round (%s, %s): γ %d (%d drafted ahead), %d nodes (%d forced), %.1f ms drafting; "
                      "tokens/s by γ %s", run.mode, run.kind, gamma, made, len(prop), prop.num_forced, 1e3 * draft_s,
                      {g: round(r, 2) for g, r in policy.edge.last_rates.items()})
        preview = ""
        if self.preview and self.tokenizer is not None and prop.tokens and not prop.is_tree:
            preview = self.tokenizer.decode(list(prop.tokens), skip_special_tokens=True)
        return EdgeRound(run.round_request(prop), draft_s, fresh, preview, prop)

    def gamma_max(self, run: Run) -> int:
        """γ's ceiling: the client's, within the verifier's ``flat_draft_tokens`` (more would be cut unsent)."""
        return min(self.num_draft_tokens, run.flat_draft_tokens)

    def pipelining(self) -> bool:
        """Whether this client drafts rounds ahead while one is in flight (:meth:`pipelines` asks more of each
        round: a chain proposal, room for another round): by default (``pipeline=None``) only where a round's
        drafting is long enough to be worth hiding."""
        if self.pipeline is not None:
            return self.pipeline
        return (self.round_draft_s or 0.0) >= PIPELINE_MIN_DRAFT_S

    def pipelines(self, run: Run, prop: DraftProposal) -> bool:
        """Whether to draft the round after this one while it is in flight. Chains only: a tree has no one
        hypothesis to draft after. The tool drafter (grammar + copy + model) drafts ahead losslessly too: its
        grammar follows whatever tokens it is given and re-follows the committed ones when a hypothesis
        fails, copies are looked up afresh, a model drafter crops its cache. Only while :meth:`pipelining`.
        A round the policy drafts nothing for (γ = 0) drafts ahead too: the drafter would only wait for its
        reply, and a guess that comes true gives the next round a draft that cost nothing. Without it, a
        drafter the policy judged not to pay (say on an answer's first, hard tokens) would sit out every round
        until the next probe. A drafter still behind (no proposal has caught it up: a new call's messages)
        catches up first, in chunks that stop when the reply is in (:meth:`draft_ahead`)."""
        # the next round's γ must be able to use a draft after the guess: a token left after both
        return (self.pipelining() and (run.sampling.greedy or not prop.is_tree)
                and run.max_tokens - run.generated - len(prop.spine()) - 3 >= 0)

    def catches_up(self, run: Run, opening: bool = False) -> bool:
        """Whether a request of ``run`` in flight should let the local drafter catch up meanwhile: in auto
        (while edge may be chosen) during server-side segments, and in edge mode too while the session opens
        (the server prefills the same tokens, so the client would only wait); for drafters with a cache to
        fill, unless pipelining is off."""
        return (run.mode in (("auto", "edge") if opening else ("auto",)) and self.pipeline is not False
                and "edge" not in run.excluded and getattr(run.drafter, "catch_up", None) is not None)

    def expected_prompt(self, run: Run) -> list[int]:
        """The prompt ``run``'s session will most likely get, for the drafter to prefill while it opens: the
        messages rendered with the client's tokenizer, resynchronised on the last session's prompt (the server
        renders with the target's template: where the two differ, the tokens the server rendered last time are
        taken, :func:`resync`), else the last prompt."""
        if run.prompt:
            return run.tokens
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None) and run.messages:
            try:
                return resync(render_chat(self.tokenizer, run.messages, run.tools), self.last_prompt)
            except Exception as e:  # noqa: BLE001 (a hint only: the server renders and checks the messages)
                log.debug("could not render the prompt ahead of the session: %s", e)
        return self.last_prompt

    def behind(self, run: Run) -> int:
        """Tokens the local drafter would prefill before its first edge draft of ``run``. Before the session
        is open the prompt is not known here: a model drafter is then taken to be at least CATCHUP_MIN
        behind, as a new call's messages (a tool's result, the user's turn) are new to it."""
        if run.prompt:
            return catchup_tokens(run.drafter, run.tokens)
        return CATCHUP_MIN if getattr(run.drafter, "catch_up", None) is not None else 0

    def in_flight(self, run: Run, request: Call, tokens: list[int], seg: SegmentStats | None = None,
                  wait_s: float | None = None, left_tokens: int | None = None,
                  opening: bool = False, edge_next: bool = False) -> Generator[Any, Any, Any]:
        """Steps that make ``request`` (a session open, a server segment's next line) and return its reply,
        letting the local drafter catch up over ``tokens`` meanwhile when :meth:`catches_up` says so. Its
        chunks may take a server round, plus ``wait_s`` (what else the reply waits for: the round trip of a
        new request), and end a round before the segment's ``left_tokens`` are expected in: the end of a
        segment is the one line the client waits for (the next request follows it). What it spends goes to
        ``seg.draft_ahead_s``; ``opening``: ``request`` opens the session (see :meth:`catches_up`) for an edge
        segment when ``edge_next``."""
        if not tokens or not self.catches_up(run, opening) or not catchup_tokens(run.drafter, tokens):
            return (yield request)
        if seg is not None and seg.rounds:
            self.round_s, self.round_tokens = seg.server_s / seg.rounds, seg.tokens / seg.rounds
        chunk_s = None if self.round_s is None else self.round_s + (wait_s or 0.0)
        if chunk_s is not None and left_tokens is not None and self.round_tokens:
            chunk_s = min(chunk_s, (wait_s or 0.0) + (left_tokens / self.round_tokens - 1) * self.round_s)
        if opening and edge_next:  # its first draft catches up first anyway: no chunk is too long
            chunk_s = math.inf
        # in auto, greedy: the drafter's choices over the answer too, for the router's edge shadow
        next_from = len(run.prompt) - 1 if run.mode == "auto" and run.prompt and run.sampling.greedy else None
        reply, spent = yield WhileDrafting(request, Call(partial(self.catch_up, next_from=next_from), None,
                                                         (run.drafter, tokens, chunk_s)), until_reply=True)
        if seg is not None:
            seg.draft_ahead_s += spent
        return reply

    def catch_up(self, drafter: Any, tokens: list[int], chunk_s: float | None, arrived: Callable[[], bool],
                 next_from: int | None = None) -> float:
        """While a request is in flight: prefill ``drafter`` over ``tokens`` in chunks until ``arrived()``, so
        an edge segment (a probe, or the router's switch) does not pay for it on its critical path. The request
        goes on without the client; only what follows its reply waits, for the chunk under way: each is sized
        to take at most about ``chunk_s`` (a server round's time, so a segment's last line waits a fraction
        of one). What is left is caught up during the next requests. ``next_from``: see
        :func:`~agentspec.drafters.base.catch_up`."""
        t0 = time.perf_counter()
        upto = len(tokens) - catchup_tokens(drafter, tokens)  # where the drafter's cache ends
        while len(tokens) - 1 - upto >= CATCHUP_MIN and not arrived():
            left = len(tokens) - 1 - upto
            n = self._chunk_tokens(chunk_s)
            if n == 0:
                break
            n = left if left < n + CATCHUP_MIN else n  # no tail too short to prefill on its own
            c0 = time.perf_counter()
            catch_up(drafter, tokens[: upto + n + 1], next_from)  # prefills all but the last token it is given
            took = time.perf_counter() - c0
            if n & (n - 1) == 0:  # the sizes chosen below (a tail's odd size is not one)
                self.chunk_s[n] = ema(self.chunk_s.get(n), took, 0.3)
            if self.observe_catchup is not None:  # the router's rate, also where no catch-up is on a path
                self.observe_catchup(n, took)
            upto += n
        log.debug("catch-up in flight: %d tokens left, chunks of at most %s s", len(tokens) - 1 - upto, chunk_s)
        return time.perf_counter() - t0

    def _chunk_tokens(self, chunk_s: float | None) -> int:
        """The longest catch-up chunk (CATCHUP_MIN doubled up to CATCHUP_CHUNK) measured or bounded to take at
        most ``chunk_s`` (0: none does, or no time at all; the shortest while either is unknown). A size is
        bounded by the least EMA measured at it or at any longer size (a pass over fewer tokens takes no
        longer: one slow first chunk, a cold start, must not rule catch-ups out for good); an unmeasured size
        with no longer one measured, by twice the size below it (a prefill pass has a fixed cost, so twice
        the tokens take less than twice the time)."""
        if chunk_s is not None and chunk_s <= 0:
            return 0
        if chunk_s is None or not self.chunk_s:
            return CATCHUP_MIN
        sizes = [CATCHUP_MIN << i for i in range((CATCHUP_CHUNK // CATCHUP_MIN).bit_length())]
        bound: dict[int, float] = {}
        least = math.inf
        for n in reversed(sizes):
            least = min(least, self.chunk_s.get(n, math.inf))
            bound[n] = least
        if bound[CATCHUP_MIN] == math.inf:
            return CATCHUP_MIN
        if bound[CATCHUP_MIN] > chunk_s:
            return 0
        n = CATCHUP_MIN
        while 2 * n <= CATCHUP_CHUNK and min(bound[2 * n], 2 * bound[n]) <= chunk_s:
            n *= 2
            if bound[n] == math.inf:
                return n  # try it: its time is measured from now on
        return n

    def draft_ahead(self, run: Run, seg: SegmentStats, prop: DraftProposal, flight_s: float | None,
                    arrived: Callable[[], bool]) -> float:
        """While a round is in flight: draft the round after it into ``run.ahead``, assuming the target
        accepts all of ``prop`` and then emits the drafter's guess; any other outcome discards it, so only
        drafts of the committed tokens are verified. A model drafter stops once ``arrived()`` (the reply is
        in), or before a step that would end after the reply is expected: ``flight_s``, this round's expected
        wall time (default: the mean of the rounds drafted ahead of, :meth:`landed`). Drafting on past it
        would delay the next round for tokens it may not even keep, and charge that delay to the drafter's
        cost per token. Returns the drafting seconds."""
        flight_s = self.flight_s if flight_s is None else flight_s
        left = run.max_tokens - run.generated - len(prop.spine()) - 2  # what the next round may draft
        hypothesis = run.tokens + prop.spine_tokens()
        caught_up = 0.0
        if catchup_tokens(run.drafter, hypothesis):  # a first pass would be a prefill that cannot stop
            caught_up = self.catch_up(run.drafter, hypothesis, flight_s, arrived)
            seg.draft_ahead_s += caught_up
            if catchup_tokens(run.drafter, hypothesis) or arrived():
                return caught_up  # the next round drafts afresh, from where the catch-up got to
        nxt, seconds, (_, caught_s) = self._propose(run, 1 + min(self.gamma_max(run), left), hypothesis,
                                                    self._before_reply(arrived, flight_s))
        if len(nxt.spine()) > 1 and (run.sampling.greedy or not nxt.is_tree):  # the guess, a draft after it
            run.ahead = ((*hypothesis, nxt.tokens[0]), nxt.cut(1, len(nxt)))
        seg.draft_ahead_s += seconds + caught_s  # a catch-up here overlapped the round trip too
        return caught_up + seconds + caught_s

    def landed(self, wall_s: float) -> None:
        """A round drafted ahead of came back after ``wall_s``: how long the next one is likely in flight."""
        self.flight_s = ema(self.flight_s, wall_s, 0.3)

    def _before_reply(self, arrived: Callable[[], bool], flight_s: float | None) -> Callable[[], bool]:
        """A draft ahead's stop: the reply is in, or the next drafting step would end after the reply is
        expected (``flight_s`` from now). A step under way when the reply comes delays the next round by what
        is left of it, half a step on average, for one more token that is drafted last, so kept least often."""
        if flight_s is None:
            return arrived
        deadline = time.perf_counter() + flight_s
        last = [time.perf_counter()]

        def stop() -> bool:  # asked between steps: the time since it was last asked is a step's
            now = time.perf_counter()
            step, last[0] = now - last[0], now
            return arrived() or now + step > deadline

        return stop

    def _propose(self, run: Run, gamma: int, tokens: list[int] | None = None, stop: Callable[[], bool] | None = None
                 ) -> tuple[DraftProposal, float, tuple[int, float]]:
        """The drafter's proposal of ``gamma`` tokens after ``tokens`` (default: committed ones; ``stop``: see
        :class:`DraftContext`), its drafting seconds and, apart, the catch-up prefill it made first (tokens,
        seconds)."""
        # the answer's grammar is compiled once per run (and the tokenizer's index once per process, about a
        # second for a 150k vocabulary): set-up, not drafting, kept out of the drafting seconds the router and
        # the γ policy price edge rounds by (one first round at 1.5 s had the policy turn drafting off)
        ctx = DraftContext(run.tokens if tokens is None else tokens, len(run.prompt), run.sampling,
                           self._generator(run.sampling), tools=run.tools, tool_choice=run.tool_choice,
                           response_format=run.response_format, constraint=self._constraint(run), stop=stop)
        prepare = getattr(run.drafter, "prepare", None)
        if prepare is not None:  # a tool drafter's grammar: likewise compiled once, not per draft
            prepare(ctx)
        t0 = time.perf_counter()
        try:
            prop = propose_round(run.drafter, ctx, gamma)
        except ValueError as e:  # ConstraintError (a ValueError): agentspec.constraint loads torch, lazily
            if ctx.constraint is None:
                raise
            if tokens is not None:  # a hypothesis the grammar forbids: nothing worth drafting after it
                caught = take_catchup(run.drafter)
                return DraftProposal(), time.perf_counter() - t0 - caught[1], caught
            log.warning("edge drafts no longer follow the answer's grammar: %s", e)  # the verifier's differs;
            run.constraint = False  # it still masks every round
            ctx.constraint = None
            prop = propose_round(run.drafter, ctx, gamma)
        caught = take_catchup(run.drafter)
        seconds = max(time.perf_counter() - t0 - caught[1], 0.0)
        if len(prop):
            self.round_draft_s = ema(self.round_draft_s, seconds, 0.2)
        return prop, seconds, caught

    def _constraint(self, run: Run) -> Any:
        """The client's copy of the grammar a constrained answer is verified under (built once per run):
        drafts it forbids are pruned, sampled drafts come from the masked law. None: no tokenizer here,
        or the verifier does not constrain this answer."""
        if run.constraint is None:
            run.constraint = False
            if run.constrained and self.tokenizer is not None:
                from agentspec.constraint import Constraint, ConstraintError

                try:
                    run.constraint = Constraint(self.tokenizer, normalise_tools(run.tools), run.tool_choice,
                                                run.response_format, run.stop_token_ids, run.parallel_tool_calls)
                except ConstraintError as e:
                    log.warning("edge drafts ignore the answer's grammar: %s", e)
        return run.constraint or None

    def _generator(self, sampling: SamplingParams) -> Any:
        if not sampling.greedy and self._torch_generator is None:
            import torch

            self._torch_generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        return None if sampling.greedy else self._torch_generator


def resync(render: list[int], last: list[int], min_match: int = RESYNC_MIN) -> list[int]:
    """``render`` (a prompt rendered with the client's chat template) with its part that matches ``last`` (the
    server's prompt of an earlier session, rendered with the target's) taken from ``last``: templates that
    differ by a few characters (Qwen2.5-Coder 0.5B's and 1.5B's) part early, and the drafter would prefill
    the rest twice. After the common prefix the two are aligned (:class:`difflib.SequenceMatcher`); the last
    block of at least ``min_match`` tokens they share ends the part taken from ``last``, the rest is ``render``'s."""
    start = common_prefix(render, last)
    if start == len(last) or start == len(render):
        return render
    blocks = difflib.SequenceMatcher(None, render[start:], last[start:], autojunk=False).get_matching_blocks()
    shared = [b for b in blocks if b.size >= min_match]
    if not shared:
        return render
    a, b, size = shared[-1]
    return last[: start + b + size] + render[start + a + size :]


def _join(head: DraftProposal, tail: DraftProposal) -> DraftProposal:
    """``tail``, drafted after ``head``'s main path, hung below its last node (a forced lead that fills
    ``head`` goes on into ``tail``'s)."""
    probs = None
    if head.draft_probs is not None or tail.draft_probs is not None:
        probs = (*(head.draft_probs or (None,) * len(head)), *(tail.draft_probs or (None,) * len(tail)))
    forced = head.num_forced + (tail.num_forced if head.num_forced == len(head) else 0)
    if not head.is_tree and not tail.is_tree:
        return DraftProposal(head.tokens + tail.tokens, None, probs, head.source, forced)
    spine = head.spine()
    below = spine[-1] if spine else -1
    parents = (*head.parent_list(), *(below if p < 0 else p + len(head) for p in tail.parent_list()))
    return DraftProposal(head.tokens + tail.tokens, parents, probs, head.source, forced)
