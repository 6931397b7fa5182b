"""SpecClient: one chat call, routed per segment between edge, server, server-ar and API modes.

``stream()`` is the primitive; it yields typed events — :class:`TextEvent` (verified text),
:class:`ToolCallEvent` (a complete, verified tool call), optional :class:`PreviewEvent` (unverified draft
text), and a final :class:`FinalEvent` with usage, stop reason and statistics. ``generate()`` aggregates
it; ``astream``/``agenerate`` are native async twins sharing the same state machine (:class:`_Run`), so
the only difference between sync and async is the I/O.

A request runs in *segments* of ``segment_tokens`` tokens; before each one the router
(:class:`agentspec.router.ModePolicy`) picks the mode from measured costs. If the verifier fails
mid-request, the committed tokens are re-sent to the next configured verifier (or the same one in
server-ar mode), then to the fallback API model; nothing committed is lost or repeated.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agentspec.drafters.base import DraftContext, Drafter, propose_round, remember_output
from agentspec.drafters.copy import CopyDrafter, SuffixIndex
from agentspec.drafters.grammar import GrammarDrafter
from agentspec.drafters.ngram import NgramDrafter
from agentspec.drafters.tree import TreeDrafter
from agentspec.protocol import SERVER_DRAFTERS
from agentspec.router import ModePolicy, ema
from agentspec.toolcalls import ToolCallParser
from agentspec.transport import HTTPTransport, ResendPrefix, VerifierError, VerifierUnavailable
from agentspec.types import DraftProposal, SamplingParams

MODES = ("auto", "edge", "server", "server-ar", "api")
# pipelined edge drafting pays off once a round's drafting costs more than handing its request to another
# thread and back: with a 0.1-0.3 ms n-gram drafter it hid nothing, and in the router benchmark's --quick
# run (in-process verifier, 2 cores) edge rounds came out 25-29 % above the closed form against 4-14 % off
PIPELINE_MIN_DRAFT_S = 0.002


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
    draft_ahead_s: float = 0.0  # local drafting overlapped with round trips (kept or discarded)


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
        """Wall time not spent computing (server compute and local drafting excluded): RTT and overheads."""
        return sum(max(s.wall_s - s.server_s - s.draft_s, 0.0) for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {"modes": [s.mode for s in self.segments], "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted_length": self.mean_accepted_length, "network_s": self.network_s,
                "server_s": sum(s.server_s for s in self.segments), "draft_s": sum(s.draft_s for s in self.segments),
                "pipelined_rounds": sum(s.pipelined for s in self.segments),
                "draft_ahead_s": sum(s.draft_ahead_s for s in self.segments), "fallbacks": list(self.fallbacks),
                "segments": [vars(s) for s in self.segments]}


@dataclass
class FinalEvent:
    text: str
    tokens: list[int]  # generated token ids committed by verifiers (API-mode text has none)
    tool_calls: list[ToolCallEvent]
    finish_reason: str
    usage: dict[str, int]
    stats: ClientStats


class _Run:
    """The state of one request, independent of sync/async I/O."""

    def __init__(self, client: SpecClient, messages: list[dict], tools: list[dict] | None, max_tokens: int,
                 sampling: SamplingParams, stop: Sequence[str], mode: str, tool_choice: Any = None,
                 response_format: dict[str, Any] | None = None, model: str | None = None) -> None:
        self.client, self.messages, self.tools, self.model = client, messages, tools, model
        self.tool_choice, self.response_format = tool_choice, response_format
        self.max_tokens, self.sampling, self.stop, self.mode = max_tokens, sampling, list(stop), mode
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # prompt + generated, as committed
        self.sid: str | None = None
        self.text, self.held = "", ""
        self.parser = ToolCallParser(tools_enabled=bool(tools))
        self.calls: list[ToolCallEvent] = []
        self.finish: str | None = None
        self.stats = ClientStats()
        self.verifier = 0  # index into client.transports
        # pipelined edge drafting: (the tokens it assumed committed, the draft after them)
        self.ahead: tuple[tuple[int, ...], DraftProposal] | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def kind(self) -> str:
        """Content kind of what comes next: ``"tool"`` inside a tool call's (or a JSON answer's) JSON,
        else ``"text"`` — the router keeps acceptance estimates for each apart."""
        structured = isinstance(self.response_format, dict) and self.response_format.get("type") != "text"
        return "tool" if structured or self.parser.in_structure else "text"

    def open_body(self) -> dict[str, Any]:
        left = self.max_tokens - self.generated
        structure = {"tool_choice": self.tool_choice, "response_format": self.response_format, "model": self.model}
        if self.sid is None and not self.prompt:
            return {"messages": self.messages, "tools": self.tools, "max_new_tokens": left, **structure}
        # resend the committed prefix (tools again: they shape the server's grammar drafts)
        return {"prompt_ids": self.tokens, "tools": self.tools, "max_new_tokens": left, **structure}

    def opened(self, info: dict[str, Any]) -> None:
        if not self.prompt:
            self.prompt = list(info["prompt_ids"])
            self.tokens = list(self.prompt)
        self.sid = info["session_id"]

    def sampling_body(self) -> dict[str, Any]:
        s = self.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "seed": s.seed}

    def apply(self, reply: dict[str, Any]) -> list[Any]:
        """Commit a round's tokens; return the events they make final."""
        self.tokens.extend(reply["tokens"])
        events = self.feed_text(reply.get("text", ""))
        if reply.get("session_finished") or (reply.get("finished") and reply.get("finish_reason") == "stop"):
            self.finish = reply.get("finish_reason") or "stop"
        return events

    def feed_text(self, text: str) -> list[Any]:
        text = self.held + text
        self.held = ""
        if self.stop:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, self.finish = text[:cut], "stop"
            else:
                keep = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
                if keep:
                    text, self.held = text[:-keep], text[-keep:]
        return self._parse(self.parser.feed(text))

    def close_events(self) -> list[Any]:
        events = self._parse(self.parser.feed(self.held) + self.parser.finish())
        self.held = ""
        return events

    def _parse(self, parsed: list[Any]) -> list[Any]:
        out: list[Any] = []
        for ev in parsed:
            if ev.call is not None:
                call = ToolCallEvent(len(self.calls), ev.call.id, ev.call.name, ev.call.arguments)
                self.calls.append(call)
                out.append(call)
            elif ev.text:
                self.text += ev.text
                out.append(TextEvent(ev.text))
        return out

    def final(self) -> FinalEvent:
        finish = self.finish or "length"
        if self.calls and finish == "stop":
            finish = "tool_calls"
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": self.generated,
                 "total_tokens": len(self.tokens)}
        return FinalEvent(self.text, self.tokens[len(self.prompt) :], list(self.calls), finish, usage, self.stats)

    @property
    def drafter(self) -> Drafter | None:
        """The local drafter of this request: the tool drafter (grammar + copy + model tree) when it asks
        for structure, else the client's drafter."""
        structured = bool(self.tools) or isinstance(self.response_format, dict)
        return self.client.tool_drafter if structured and self.client.tool_drafter else self.client.drafter

    def propose(self, k: int, tokens: list[int] | None = None) -> tuple[DraftProposal, float]:
        """The local drafter's proposal of ``k`` tokens after ``tokens`` (default: the committed ones), and
        the seconds it took."""
        t0 = time.perf_counter()
        ctx = DraftContext(self.tokens if tokens is None else tokens, len(self.prompt), self.sampling,
                           self.client._generator(self.sampling), tools=self.tools, tool_choice=self.tool_choice,
                           response_format=self.response_format)
        return propose_round(self.drafter, ctx, k), time.perf_counter() - t0

    def draft_body(self, prop: DraftProposal) -> tuple[dict[str, Any], str]:
        """A proposal as the wire's ``draft`` object, and its preview text."""
        body: dict[str, Any] = {"tokens": list(prop.tokens), "source": prop.source[:64]}
        if prop.is_tree:
            body["parents"] = list(prop.parents)
        if prop.draft_probs is not None:
            body["q"] = [{"ids": list(d.ids), "probs": list(d.probs)} for d in prop.draft_probs]
        preview = ""
        if self.client.preview and self.client.tokenizer is not None and prop.tokens and not prop.is_tree:
            preview = self.client.tokenizer.decode(list(prop.tokens), skip_special_tokens=True)
        return body, preview


class SpecClient:
    """Chat completions against agentspec-verifier(s), with local drafting, routing and fallback.

    ``base_urls``: one or more verifiers serving the same target (the next one takes over when one fails).
    ``drafter``: a local drafter sharing the target's tokenizer (enables edge mode). ``fallback_model``:
    a litellm model id used when no verifier is reachable (its continuation comes from another model;
    recorded in the statistics). ``log_path``: opt-in request log (chat JSONL with the answers) that
    ``agentspec train --data LOG`` distils a drafter on — a deployment retrains on its own traffic.
    ``server_drafter``: what the verifier drafts with in server mode — ``"default"`` (grammar + copy + its
    ``--draft-model``), ``"model"`` (that model alone) or ``"ngram"`` (prompt lookup).
    ``pipeline``: in edge mode, draft the next round while the current one is in flight, assuming the
    target accepts the whole draft and then emits the drafter's own next token; the next round sends that
    draft when it did, and drafts afresh otherwise (chain drafters; the tool drafter's grammar follows the
    committed tokens, so structured requests draft each round after its reply). ``None`` (default):
    pipeline while a round's drafting takes at least ``PIPELINE_MIN_DRAFT_S`` (a model drafter; an n-gram
    lookup takes ~0.1 ms, less than handing the request to another thread costs). The async methods run
    all drafting on one client-owned thread (never on the event loop), the sync ones on the caller's.
    """

    def __init__(self, base_urls: str | Sequence[str] | None = None, *, api_key: str | None = None,
                 drafter: Drafter | None = None, tokenizer: Any = None, num_draft_tokens: int = 4,
                 mode: str = "auto", fallback_model: str | None = None, timeout: float = 60.0, retries: int = 2,
                 segment_tokens: int = 16, preview: bool = False, policy: ModePolicy | None = None,
                 api_kwargs: dict[str, Any] | None = None, log_path: str | os.PathLike | None = None,
                 server_drafter: str = "default", pipeline: bool | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if server_drafter not in SERVER_DRAFTERS:
            raise ValueError(f"server_drafter must be one of {SERVER_DRAFTERS}, got {server_drafter!r}")
        self.server_drafter = server_drafter
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls or [])
        if not urls and fallback_model is None:
            raise ValueError("give at least one verifier base URL or a fallback_model")
        if mode == "edge" and drafter is None:
            raise ValueError("edge mode needs a local drafter")
        api_key = api_key if api_key is not None else os.environ.get("AGENTSPEC_API_KEY")
        self.transports = [HTTPTransport(u, api_key=api_key, timeout=timeout, retries=retries) for u in urls]
        self.drafter, self.tokenizer, self.num_draft_tokens = drafter, tokenizer, num_draft_tokens
        # tool-calling requests draft with grammar + copy + the given drafter, merged into one tree
        self.tool_drafter: Drafter | None = None
        if drafter is not None and tokenizer is not None and not isinstance(drafter, TreeDrafter):
            self.tool_drafter = TreeDrafter(GrammarDrafter(tokenizer), CopyDrafter(SuffixIndex(), max_candidates=3),
                                            model=drafter)
        self.mode, self.fallback_model, self.segment_tokens, self.preview = mode, fallback_model, segment_tokens, preview
        self.timeout = timeout
        self.api_kwargs = dict(api_kwargs or {})  # extra litellm arguments (api_base, mock_response in tests, ...)
        self.policy = policy or ModePolicy(has_drafter=drafter is not None, has_api=fallback_model is not None)
        self._attach_shadows()
        self._torch_generator = None
        self.log_path = log_path  # opt-in: one JSON line per finished request, for `agentspec train --data`
        self.pipeline = pipeline
        self._round_draft_s: float | None = None  # EMA of one proposal's drafting seconds (fresh or ahead)
        self._io_pool: ThreadPoolExecutor | None = None  # sync pipelining: the round's POST while drafting ahead
        self._draft_pool: ThreadPoolExecutor | None = None  # async: every draft, off the event loop, one thread

    # -- public API --------------------------------------------------------------------------------

    def stream(self, messages: list[dict], tools: list[dict] | None = None, *, max_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), mode: str | None = None,
               tool_choice: str | dict[str, Any] | None = None, response_format: dict[str, Any] | None = None,
               model: str | None = None) -> Iterator[TextEvent | PreviewEvent | ToolCallEvent | FinalEvent]:
        """Yield verified events for one chat turn; the last event is a :class:`FinalEvent`."""
        run = self._new_run(messages, tools, max_tokens, sampling, stop, mode, tool_choice, response_format, model)
        try:
            while run.finish is None and run.generated < run.max_tokens:
                seg_mode = self._pick_mode(run)
                try:
                    if seg_mode == "api":
                        yield from self._api_segment(run)
                    elif seg_mode == "edge":
                        yield from self._edge_segment(run)
                    else:
                        yield from self._server_segment(run, seg_mode)
                except (VerifierUnavailable, ResendPrefix) as e:
                    self._failover(run, e)
            yield from run.close_events()
        finally:  # also when the consumer stops early: the server frees the session's KV now
            self._close_session(run)
        yield self._logged(run, run.final())

    def generate(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> FinalEvent:
        """Run :meth:`stream` to the end and return its final event."""
        final = None
        for ev in self.stream(messages, tools, **kwargs):
            final = ev
        assert isinstance(final, FinalEvent)
        return final

    async def astream(self, messages: list[dict], tools: list[dict] | None = None, *, max_tokens: int = 256,
                      sampling: SamplingParams | None = None, stop: Sequence[str] = (), mode: str | None = None,
               tool_choice: str | dict[str, Any] | None = None, response_format: dict[str, Any] | None = None,
                      model: str | None = None) -> AsyncIterator[TextEvent | PreviewEvent | ToolCallEvent | FinalEvent]:
        """The async twin of :meth:`stream` (native httpx.AsyncClient; never blocks the event loop on I/O)."""
        run = self._new_run(messages, tools, max_tokens, sampling, stop, mode, tool_choice, response_format, model)
        try:
            while run.finish is None and run.generated < run.max_tokens:
                seg_mode = self._pick_mode(run)
                try:
                    if seg_mode == "api":
                        async for ev in self._aapi_segment(run):
                            yield ev
                    elif seg_mode == "edge":
                        async for ev in self._aedge_segment(run):
                            yield ev
                    else:
                        async for ev in self._aserver_segment(run, seg_mode):
                            yield ev
                except (VerifierUnavailable, ResendPrefix) as e:
                    self._failover(run, e)
            for ev in run.close_events():
                yield ev
        finally:
            await self._aclose_session(run)
        yield self._logged(run, run.final())

    async def agenerate(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> FinalEvent:
        final = None
        async for ev in self.astream(messages, tools, **kwargs):
            final = ev
        assert isinstance(final, FinalEvent)
        return final

    def close(self) -> None:
        for t in self.transports:
            t.close()
        for pool in (self._io_pool, self._draft_pool):
            if pool is not None:
                pool.shutdown(wait=False)

    # -- segments (sync) ---------------------------------------------------------------------------

    def _ensure_session(self, run: _Run) -> HTTPTransport:
        t = self.transports[run.verifier]
        if run.sid is None:
            self._opened(run, t.post("/v1/spec/sessions", run.open_body()))
        return t

    def _edge_segment(self, run: _Run) -> Iterator[Any]:
        t = self._ensure_session(run)
        seg = SegmentStats("edge", 0, 0, 0, 0, 0.0, 0.0, 0.0, dict(self.policy.last_predictions), run.kind)
        t0 = time.perf_counter()
        try:
            while run.finish is None and seg.tokens < self.segment_tokens:
                body, draft_s, preview, prop = self._edge_round(run, seg)
                if preview:
                    yield PreviewEvent(preview)
                url = f"/v1/spec/sessions/{run.sid}/rounds"
                if self._pipelines(run, prop):
                    if self._io_pool is None:
                        self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentspec-io")
                    pending = self._io_pool.submit(t.post, url, body)
                    ahead_s = self._draft_ahead(run, seg, prop)
                    r = pending.result()
                    draft_s += max(ahead_s - r.wall_s, 0.0)  # the reply waited for the draft ahead
                else:
                    r = t.post(url, body)
                yield from self._commit(run, seg, r.body, r.wall_s, draft_s)
        finally:  # a segment cut short by a failing verifier still reports the tokens it committed
            self._segment_done(run, seg, t0)

    def _server_segment(self, run: _Run, mode: str) -> Iterator[Any]:
        t = self._ensure_session(run)
        seg = SegmentStats(mode, 0, 0, 0, 0, 0.0, 0.0, 0.0, dict(self.policy.last_predictions), run.kind)
        t0 = time.perf_counter()
        body = self._generate_body(run, mode)
        try:
            for r in t.stream_lines(f"/v1/spec/sessions/{run.sid}/generate", body):
                yield from self._commit(run, seg, r.body, r.wall_s, 0.0)
                if run.finish is not None:
                    break
        finally:
            self._segment_done(run, seg, t0)

    def _api_segment(self, run: _Run) -> Iterator[Any]:
        t0 = time.perf_counter()
        resp = _litellm().completion(**self._api_request(run))
        yield from self._api_commit(run, resp, t0)

    # -- segments (async) --------------------------------------------------------------------------

    async def _aensure_session(self, run: _Run) -> HTTPTransport:
        t = self.transports[run.verifier]
        if run.sid is None:
            self._opened(run, await t.apost("/v1/spec/sessions", run.open_body()))
        return t

    async def _aedge_segment(self, run: _Run) -> AsyncIterator[Any]:
        t = await self._aensure_session(run)
        seg = SegmentStats("edge", 0, 0, 0, 0, 0.0, 0.0, 0.0, dict(self.policy.last_predictions), run.kind)
        t0 = time.perf_counter()
        try:
            while run.finish is None and seg.tokens < self.segment_tokens:
                body, draft_s, preview, prop = await self._adraft(self._edge_round, run, seg)
                if preview:
                    yield PreviewEvent(preview)
                url = f"/v1/spec/sessions/{run.sid}/rounds"
                if self._pipelines(run, prop):
                    pending = asyncio.ensure_future(t.apost(url, body))
                    try:
                        ahead_s = await self._adraft(self._draft_ahead, run, seg, prop)
                    except BaseException:
                        pending.cancel()
                        raise
                    r = await pending
                    draft_s += max(ahead_s - r.wall_s, 0.0)
                else:
                    r = await t.apost(url, body)
                for ev in self._commit(run, seg, r.body, r.wall_s, draft_s):
                    yield ev
        finally:
            self._segment_done(run, seg, t0)

    async def _aserver_segment(self, run: _Run, mode: str) -> AsyncIterator[Any]:
        t = await self._aensure_session(run)
        seg = SegmentStats(mode, 0, 0, 0, 0, 0.0, 0.0, 0.0, dict(self.policy.last_predictions), run.kind)
        t0 = time.perf_counter()
        body = self._generate_body(run, mode)
        try:
            async for r in t.astream_lines(f"/v1/spec/sessions/{run.sid}/generate", body):
                for ev in self._commit(run, seg, r.body, r.wall_s, 0.0):
                    yield ev
                if run.finish is not None:
                    break
        finally:
            self._segment_done(run, seg, t0)

    async def _aapi_segment(self, run: _Run) -> AsyncIterator[Any]:
        t0 = time.perf_counter()
        resp = await _litellm().acompletion(**self._api_request(run))
        for ev in self._api_commit(run, resp, t0):
            yield ev

    # -- shared ------------------------------------------------------------------------------------

    def _logged(self, run: _Run, final: FinalEvent) -> FinalEvent:
        """Append the request and its answer to ``log_path`` (when set) as chat JSONL; remember the answer
        for cross-conversation copy drafting."""
        if run.prompt and self.tool_drafter is not None:
            remember_output(self.tool_drafter, DraftContext(run.tokens, len(run.prompt)))
        if self.log_path is not None:
            answer: dict[str, Any] = {"role": "assistant", "content": final.text}
            if final.tool_calls:
                answer["tool_calls"] = [{"id": c.id, "type": "function",
                                         "function": {"name": c.name, "arguments": c.arguments}}
                                        for c in final.tool_calls]
            line = {"messages": [*run.messages, answer], "tools": run.tools or [],
                    "finish_reason": final.finish_reason, "time": time.time()}
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, ensure_ascii=False, default=str) + "\n")
        return final

    def _new_run(self, messages: list[dict], tools: list[dict] | None, max_tokens: int,
                 sampling: SamplingParams | None, stop: Sequence[str], mode: str | None,
                 tool_choice: Any = None, response_format: dict[str, Any] | None = None,
                 model: str | None = None) -> _Run:
        if not messages:
            raise ValueError("messages must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "edge" and self.drafter is None:
            raise ValueError("edge mode needs a local drafter")
        if isinstance(stop, str):
            stop = [stop]
        run = _Run(self, list(messages), tools, max_tokens, sampling or SamplingParams(), stop, mode, tool_choice,
                   response_format, model)
        if not self.transports:
            run.mode = "api"
        return run

    def _pick_mode(self, run: _Run) -> str:
        if run.mode != "auto":
            return run.mode
        return self.policy.choose(kind=run.kind)

    def _commit(self, run: _Run, seg: SegmentStats, reply: dict[str, Any], wall_s: float, draft_s: float
                ) -> list[Any]:
        seg.rounds += 1
        seg.tokens += len(reply["tokens"])
        seg.drafted += reply.get("drafted", 0)
        seg.accepted += reply.get("accepted", 0)
        timings = reply.get("timings", {})
        server_s = (timings.get("verify_ms", 0.0) + timings.get("draft_ms", 0.0)) / 1e3
        seg.server_s += server_s
        seg.draft_s += draft_s
        self.policy.observe_round(seg.mode, reply.get("drafted", 0), reply.get("accepted", 0), len(reply["tokens"]),
                                  wall_s=wall_s, server_s=server_s, verify_s=timings.get("verify_ms", 0.0) / 1e3,
                                  draft_s=draft_s, load=reply.get("load"))
        return run.apply(reply)

    def _edge_round(self, run: _Run, seg: SegmentStats) -> tuple[dict[str, Any], float, str, DraftProposal]:
        """Draft locally for the next edge round: (request body, drafting seconds on the critical path,
        preview text, the proposal). The draft made while the last round was in flight is used when the
        committed tokens are the ones it assumed; otherwise it is discarded."""
        left = run.max_tokens - run.generated - 1  # no draft at all with one token left (k = -1)
        k = min(self.policy.gamma("edge", self.num_draft_tokens, kind=run.kind), left) if left > 0 else -1
        ahead, run.ahead = run.ahead, None
        if ahead is not None and k >= 0 and ahead[0] == tuple(run.tokens):
            prop, draft_s = _head(ahead[1], k), 0.0
            seg.pipelined += 1
        else:
            prop, draft_s = run.propose(k)
            self._drafted(prop, draft_s)
        draft, preview = run.draft_body(prop)
        body = {"base_len": len(run.tokens), "draft": draft, "sampling": run.sampling_body()}
        return body, draft_s, preview, prop

    def _drafted(self, prop: DraftProposal, seconds: float) -> None:
        if len(prop):
            self._round_draft_s = ema(self._round_draft_s, seconds, 0.2)

    def _pipelines(self, run: _Run, prop: DraftProposal) -> bool:
        """Whether to draft the round after this one while it is in flight."""
        if self.pipeline is None:
            worth = self._round_draft_s is not None and self._round_draft_s >= PIPELINE_MIN_DRAFT_S
        else:
            worth = self.pipeline
        return (worth and len(prop) > 0 and not prop.is_tree and not isinstance(run.drafter, TreeDrafter)
                and run.max_tokens - run.generated - len(prop) - 2 >= 0)  # γ = 0: the policy turned drafting off

    def _draft_ahead(self, run: _Run, seg: SegmentStats, prop: DraftProposal) -> float:
        """While a round is in flight: the draft of the round after it, on the hypothesis that the target
        accepts all of ``prop`` and then emits the token the drafter would put next (its guess), kept in
        ``run.ahead``. Any other outcome discards it, so what is verified is always a draft of the committed
        tokens (for sampled drafts too: whether it is used depends on the target's choice, not on the
        draft). Returns the drafting seconds."""
        left = run.max_tokens - run.generated - len(prop) - 2  # what the next round may draft
        hypothesis = run.tokens + list(prop.tokens)
        nxt, seconds = run.propose(1 + min(self.num_draft_tokens, left), hypothesis)
        self._drafted(nxt, seconds)
        if len(nxt) and not nxt.is_tree:
            run.ahead = ((*hypothesis, nxt.tokens[0]), _tail(nxt))
        seg.draft_ahead_s += seconds
        return seconds

    async def _adraft(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the client's drafting thread: the event loop never waits on a drafter."""
        if self._draft_pool is None:
            self._draft_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agentspec-draft")
        return await asyncio.get_running_loop().run_in_executor(self._draft_pool, fn, *args)

    def _generate_body(self, run: _Run, mode: str) -> dict[str, Any]:
        body = {"base_len": len(run.tokens), "mode": mode, "sampling": run.sampling_body(),
                "max_new_tokens": min(self.segment_tokens, run.max_tokens - run.generated)}
        if mode == "server" and self.server_drafter != "default":
            body["drafter"] = self.server_drafter
        return body

    def _opened(self, run: _Run, reply: Any) -> None:
        run.opened(reply.body)
        self.policy.observe_open(reply.wall_s, reply.body.get("prefill_ms", 0.0) / 1e3)

    def _attach_shadows(self) -> None:
        """Give the router the chain drafters it can replay over committed text for free (n-gram lookups
        as configured here and on the server), so it judges those modes on the same text as the one it runs."""
        p = self.policy
        p.gamma_max, p.segment_tokens = self.num_draft_tokens, self.segment_tokens
        d = self.drafter
        if "edge" not in p.shadows and self.tool_drafter is None and type(d) is NgramDrafter and d.max_candidates == 1:
            p.shadows["edge"] = NgramDrafter(d.max_ngram, d.min_ngram)
        if "server" not in p.shadows and self.server_drafter == "ngram":
            p.shadows["server"] = NgramDrafter()  # what the verifier builds for Generate.drafter "ngram"

    def _segment_done(self, run: _Run, seg: SegmentStats, t0: float) -> None:
        seg.wall_s = time.perf_counter() - t0
        if not seg.tokens and not seg.rounds:
            return  # failed before committing anything: nothing to report or learn from
        run.stats.segments.append(seg)
        if seg.tokens:
            self.policy.observe_segment(seg.mode, seg.wall_s / seg.tokens, tokens=seg.tokens, rounds=seg.rounds,
                                        drafted=seg.drafted, draft_s=seg.draft_s, kind=seg.kind)
            if run.mode == "auto":
                self.policy.observe_text(run.tokens, len(run.prompt), len(run.tokens) - seg.tokens, kind=seg.kind)

    def _failover(self, run: _Run, error: VerifierError) -> None:
        """Continue elsewhere with the committed tokens: another verifier, then the fallback API model."""
        run.stats.fallbacks.append(f"{type(error).__name__} on verifier {run.verifier}: {error}")
        run.sid = None
        if isinstance(error, ResendPrefix) and len(run.stats.fallbacks) <= 3:
            return  # same verifier, new session with the full prefix
        if run.verifier + 1 < len(self.transports):
            run.verifier += 1
            return
        if self.fallback_model is not None:
            run.mode = "api"
            return
        raise VerifierUnavailable(f"no verifier left and no fallback_model: {error}", status=error.status,
                                  code=error.code) from error

    def _api_request(self, run: _Run) -> dict[str, Any]:
        messages = list(run.messages)
        if run.text:  # continue the partial answer (the API model only sees committed text)
            messages.append({"role": "assistant", "content": run.text})
        req: dict[str, Any] = {"model": self.fallback_model, "messages": messages, "timeout": self.timeout,
                               "max_tokens": max(run.max_tokens - run.generated, 1), **self.api_kwargs}
        if run.tools:
            req["tools"] = run.tools
        if not run.sampling.greedy:
            req["temperature"] = run.sampling.temperature
        if run.stop:
            req["stop"] = run.stop
        return req

    def _api_commit(self, run: _Run, resp: Any, t0: float) -> list[Any]:
        choice = resp.choices[0]
        text = choice.message.content or ""
        events = run.feed_text(text)
        for tc in getattr(choice.message, "tool_calls", None) or ():
            call = ToolCallEvent(len(run.calls), tc.id, tc.function.name, tc.function.arguments)
            run.calls.append(call)
            events.append(call)
        usage = getattr(resp, "usage", None)
        n = getattr(usage, "completion_tokens", 0) or 0
        run.stats.segments.append(SegmentStats("api", n, 1, 0, 0, time.perf_counter() - t0, 0.0, 0.0))
        run.finish = {"length": "length"}.get(choice.finish_reason or "stop", "stop")
        return events

    def _close_session(self, run: _Run) -> None:
        if run.sid is not None and self.transports:
            self.transports[run.verifier].delete(f"/v1/spec/sessions/{run.sid}")
            run.sid = None

    async def _aclose_session(self, run: _Run) -> None:
        if run.sid is not None and self.transports:
            await self.transports[run.verifier].adelete(f"/v1/spec/sessions/{run.sid}")
            run.sid = None

    def _generator(self, sampling: SamplingParams) -> Any:
        if sampling.greedy:
            return None
        import torch

        if self._torch_generator is None:
            self._torch_generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
        return self._torch_generator


def _litellm() -> Any:
    """litellm, imported lazily with offline-safe settings (no cost-map or tokenizer downloads)."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.disable_hf_tokenizer_download = True
    return litellm


def _head(prop: DraftProposal, k: int) -> DraftProposal:
    """A chain proposal cut to ``k`` free tokens (its grammar-forced lead stays)."""
    n = min(len(prop), max(k, 0) + prop.num_forced)
    probs = None if prop.draft_probs is None else prop.draft_probs[:n]
    return DraftProposal(prop.tokens[:n], None, probs, prop.source, min(prop.num_forced, n))


def _tail(prop: DraftProposal) -> DraftProposal:
    """A chain proposal without its first token (the guess a pipelined draft is conditioned on)."""
    probs = None if prop.draft_probs is None else prop.draft_probs[1:]
    return DraftProposal(prop.tokens[1:], None, probs, prop.source, max(prop.num_forced - 1, 0))
