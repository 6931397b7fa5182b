"""SpecClient: one chat call as one loop of segments, each in the mode the router picks.

Per segment (:meth:`SpecClient._steps`, one generator for sync and async) the router picks the mode and
then learns its costs. A failing verifier hands the committed tokens to the next one, then to the fallback
model: nothing is lost or repeated. The steps only *ask* for I/O (:mod:`agentspec.client.ops`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from contextlib import aclosing
from dataclasses import replace
from functools import partial
from typing import Any

from agentspec.client.api import api_segment, check_api_kwargs
from agentspec.client.deployment import Deployment, deployment_segment, segment_refusal, whole_answer
from agentspec.client.edge import EdgeDrafting
from agentspec.client.events import FinalEvent, PreviewEvent, SegmentStats, TextEvent, ToolCallEvent
from agentspec.client.health import VerifierHealth
from agentspec.client.ops import Call, Pools, Steps, WhileDrafting, adrive, drive
from agentspec.client.run import Run
from agentspec.client.shadow import shadow_drafters, shadow_segment
from agentspec.drafters import make_drafter
from agentspec.drafters.base import DraftContext, Drafter, remember_output
from agentspec.drafters.copy import SuffixIndex
from agentspec.drafters.grammar import warm_grammar_tokenizer
from agentspec.protocol import SERVER_DRAFTERS, RoundReply, SessionInfo, Tokenize
from agentspec.router import ModeConfig, ModePolicy
from agentspec.transport import HTTPTransport, ResendPrefix, Timed, VerifierError, VerifierUnavailable
from agentspec.types import DraftProposal, SamplingParams

MODES = ("auto", "edge", "server", "server-ar", "vllm", "api")
Event = TextEvent | PreviewEvent | ToolCallEvent | FinalEvent


class SpecClient:
    """Chat completions against agentspec-verifier(s), with local drafting, routing and fallback.

    ``base_urls``: verifiers serving the same target (the next takes over when one fails). ``drafter``: a
    local drafter sharing the target's tokenizer (enables edge mode). ``fallback_model``: a litellm model
    id for when no verifier is reachable (or for ``mode="api"``), called with ``api_kwargs`` (litellm
    arguments such as ``api_base``, ``api_key``, ``drop_params``; applied last). ``timeout``: httpx's
    limit per HTTP request to a verifier (connecting, and each wait for bytes, a streamed segment's next
    line included; each of ``retries`` attempts has its own) and litellm's ``timeout`` for the API call;
    not a deadline for the whole call. ``log_path``: opt-in chat JSONL log for ``agentspec train``.
    ``server_drafter``: the verifier's server-mode drafter. ``pipeline``: in edge mode, draft the next
    round while this one is in flight, stopping once its reply is in (``True``: always; ``None``: while
    drafting takes ``PIPELINE_MIN_DRAFT_S`` or more: :meth:`~agentspec.client.edge.EdgeDrafting.pipelines`);
    in ``auto``, also let a local model drafter prefill the tokens committed in server-side modes while
    their segments stream (``False``: neither), so switching to edge does not wait for that prefill.
    ``policy``: a router to share; its config gets this client's γ, segment length, shadowed modes and which
    of verifier and deployment it has.
    ``deployment``: an OpenAI-compatible server of the same target (vLLM, scaled out) where the ``vllm`` mode
    runs, by token ids (:mod:`agentspec.client.deployment`); ``mode="auto"`` weighs it by its measured seconds
    per token against the verifiers' modes. With no ``base_urls`` every request runs there.
    """

    def __init__(self, base_urls: str | Sequence[str] | None = None, *, api_key: str | None = None,
                 drafter: Drafter | None = None, tokenizer: Any = None, num_draft_tokens: int = 4,
                 mode: str = "auto", fallback_model: str | None = None, timeout: float = 60.0, retries: int = 2,
                 segment_tokens: int = 16, preview: bool = False, policy: ModePolicy | None = None,
                 api_kwargs: dict[str, Any] | None = None, log_path: str | os.PathLike | None = None,
                 server_drafter: str = "default", pipeline: bool | None = None,
                 deployment: Deployment | None = None) -> None:
        _check_mode(mode, drafter, fallback_model, deployment)
        check_api_kwargs(api_kwargs or {})
        if server_drafter not in SERVER_DRAFTERS:
            raise ValueError(f"server_drafter must be one of {SERVER_DRAFTERS}, got {server_drafter!r}")
        if num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if segment_tokens < 1:
            raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls or [])
        if not urls and fallback_model is None and deployment is None:
            raise ValueError("give at least one verifier base URL, a deployment or a fallback_model")
        api_key = api_key if api_key is not None else os.environ.get("AGENTSPEC_API_KEY")
        self.transports = [HTTPTransport(u, api_key=api_key, timeout=timeout, retries=retries) for u in urls]
        self.deployment = deployment  # the vllm mode's server (an OpenAI-compatible one, same target)
        self._deployment = deployment.transport(timeout, retries) if deployment is not None else None
        self.health = VerifierHealth(len(self.transports))  # failed verifiers back off, then come back
        self.drafter, self.tokenizer, self.num_draft_tokens = drafter, tokenizer, num_draft_tokens
        self.mode, self.fallback_model, self.segment_tokens = mode, fallback_model, segment_tokens
        self.server_drafter, self.timeout = server_drafter, timeout
        self.api_kwargs = dict(api_kwargs or {})  # litellm arguments: api_base, api_key, drop_params, ...
        self.log_path = log_path  # opt-in: one JSON line per finished request, for `agentspec train --data`
        # tool-calling requests draft with grammar + copy + the given drafter, merged into one tree
        self.tool_drafter: Drafter | None = None
        index = None  # past answers, as the verifier keeps them per key for its copy drafts
        if drafter is not None and tokenizer is not None and not getattr(drafter, "merges_sources", False):
            index = SuffixIndex()
            self.tool_drafter = make_drafter("default", tokenizer=tokenizer, model=drafter, index=index)
            warm_grammar_tokenizer(tokenizer)  # its grammar's index takes about a second: built meanwhile
        self._shadows, self._copy_chain = shadow_drafters(drafter, server_drafter, index)
        if policy is None:  # a shared policy gets this client's settings in its config
            policy = ModePolicy(ModeConfig(has_drafter=drafter is not None, has_api=fallback_model is not None,
                                           has_verifier=bool(urls), has_deployment=deployment is not None))
        policy.config = replace(policy.config, gamma_max=num_draft_tokens, segment_tokens=segment_tokens,
                                shadowed=policy.config.shadowed | set(self._shadows), has_verifier=bool(urls),
                                has_deployment=deployment is not None)
        self.policy = policy
        self._edge = EdgeDrafting(num_draft_tokens, pipeline, tokenizer, preview, policy.observe_catchup)
        self._pools = Pools()  # sync pipelining's POST thread, async drafting's thread

    def stream(self, messages: list[dict], tools: list[dict] | None = None, *, max_tokens: int = 256,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), mode: str | None = None,
               tool_choice: str | dict[str, Any] | None = None, response_format: dict[str, Any] | None = None,
               model: str | None = None, parallel_tool_calls: bool = True) -> Iterator[Event]:
        """Yield verified events for one chat turn; the last event is a :class:`FinalEvent`.

        A required or named ``tool_choice`` and a JSON ``response_format`` are enforced by the verifier's
        grammar (``parallel_tool_calls=False``: one call)."""
        run = self._new_run(messages, tools, max_tokens, sampling, stop, mode, tool_choice, response_format, model)
        run.parallel_tool_calls = parallel_tool_calls
        yield from drive(self._steps(run), self._pools, partial(self._close_session, run))
        yield self._logged(run, run.final())

    def generate(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> FinalEvent:
        """Run :meth:`stream` to the end and return its final event."""
        *_, final = self.stream(messages, tools, **kwargs)
        assert isinstance(final, FinalEvent)
        return final

    async def astream(self, messages: list[dict], tools: list[dict] | None = None, *, max_tokens: int = 256,
                      sampling: SamplingParams | None = None, stop: Sequence[str] = (), mode: str | None = None,
                      tool_choice: str | dict[str, Any] | None = None, response_format: dict[str, Any] | None = None,
                      model: str | None = None, parallel_tool_calls: bool = True) -> AsyncIterator[Event]:
        """The async twin of :meth:`stream` (native httpx.AsyncClient; never blocks the event loop on I/O)."""
        run = self._new_run(messages, tools, max_tokens, sampling, stop, mode, tool_choice, response_format, model)
        run.parallel_tool_calls = parallel_tool_calls
        async with aclosing(adrive(self._steps(run), self._pools, partial(self._close_session, run))) as events:
            async for ev in events:
                yield ev
        yield self._logged(run, run.final())

    async def agenerate(self, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> FinalEvent:
        """Run :meth:`astream` to the end and return its final event."""
        final = None
        async for ev in self.astream(messages, tools, **kwargs):
            final = ev
        assert isinstance(final, FinalEvent)
        return final

    def count_tokens(self, text: str | None = None, messages: list[dict] | None = None,
                     tools: list[dict] | None = None) -> int:
        """Tokens the target sees for ``text``, or for chat ``messages`` (+ ``tools``) rendered with its chat
        template, counted by the first verifier's tokenizer (``POST /tokenize``)."""
        if not self.transports:
            raise ValueError("counting tokens needs a verifier (the target's tokenizer lives there)")
        body = Tokenize(prompt=text, messages=messages, tools=tools).to_wire()
        return int(self.transports[0].post("/tokenize", body).body["count"])

    def close(self) -> None:
        for t in [*self.transports, *([self._deployment] if self._deployment is not None else [])]:
            t.close()
        for pool in self._pools.values():
            pool.shutdown(wait=False)

    def _steps(self, run: Run) -> Steps:
        """Segments in the modes picked for them until the request is finished; then the parser's rest."""
        while run.finish is None and run.generated < run.max_tokens:
            mode = run.mode if run.mode != "auto" else self.policy.choose(
                kind=run.kind, exclude=run.excluded, catchup_tokens=self._edge.behind(run), cold=run.ahead is None)
            try:
                if mode == "api":
                    yield from api_segment(run, self.fallback_model, self.timeout, self.api_kwargs)
                elif mode == "vllm":
                    yield from self._deployment_segment(run)
                elif mode == "edge":
                    yield from self._edge_segment(run)
                else:
                    yield from self._server_segment(run, mode)
            except (VerifierUnavailable, ResendPrefix) as e:
                if mode == "vllm":
                    self._deployment_failed(run, e)
                else:
                    self._failover(run, e)
        yield from run.close_events()

    def _deployment_segment(self, run: Run) -> Steps:
        assert self.deployment is not None and self._deployment is not None
        if run.whole:
            yield from whole_answer(run, self.deployment, self.timeout)
            return
        seg, t0 = self._segment(run, "vllm"), time.perf_counter()
        try:
            yield from deployment_segment(run, self.deployment, self._deployment, seg,
                                          min(self._segment_budget(run, "vllm")[0], run.max_tokens - run.generated))
        finally:
            self._segment_done(run, seg, t0)

    def _deployment_failed(self, run: Run, error: VerifierError) -> None:
        """The deployment failed mid-request: the rest goes to a verifier, else the API model."""
        run.stats.fallbacks.append(f"{type(error).__name__} on deployment {self.deployment}: {error}")
        if self.transports:
            run.mode = "server"
        elif self.fallback_model is not None:
            run.mode = "api"
        else:
            raise VerifierUnavailable(f"the deployment failed and there is no verifier or fallback_model: {error}",
                                      status=error.status, code=error.code) from error

    def _session(self, run: Run, mode: str) -> Generator[Any, Any, HTTPTransport]:
        """The verifier of ``run``, with a session open on it (opened now when there is none) for a ``mode``
        segment."""
        t = self.transports[run.verifier]
        if run.sid is None:
            # the server prefills the prompt meanwhile: a drafter that catches up prefills the one it expects
            opening = Call(t.post, t.apost, ("/v1/spec/sessions", run.open_request()))
            prefix = self._edge.expected_prompt(run) if self._edge.catches_up(run, opening=True) else []
            reply = yield from self._edge.in_flight(run, opening, prefix, wait_s=self.policy.network_s(),
                                                    opening=True, edge_next=mode == "edge")
            self.health.ok(run.verifier)
            info = SessionInfo.model_validate(reply.body)
            run.opened(info)
            self._edge.last_prompt = run.prompt
            self.policy.observe_open(reply.wall_s, max(info.server_ms, info.prefill_ms) / 1e3)  # older: prefill
        return t

    def _edge_segment(self, run: Run) -> Steps:
        t = yield from self._session(run, "edge")
        seg, t0, edge = self._segment(run, "edge"), time.perf_counter(), self._edge
        limit, rounds = self._segment_budget(run, "edge")
        try:
            while run.finish is None and seg.tokens < limit and (rounds is None or seg.rounds < rounds):
                body, draft_s, fresh, preview, prop = yield Call(edge.round, None, (run, seg, self.policy))
                if preview:
                    yield PreviewEvent(preview)
                post = Call(t.post, t.apost, (f"/v1/spec/sessions/{run.sid}/rounds", body))
                if edge.pipelines(run, prop):
                    # this round's flight from the edge cost line over pass sizes: a plain step's is shorter
                    # than the mean round's, and a deadline past it had the draft ahead overrun the reply
                    flight = self.policy.edge.costs.seconds(len(prop))
                    r, ahead_s = yield WhileDrafting(post, Call(edge.draft_ahead, None, (run, seg, prop, flight)),
                                                      until_reply=True)
                    draft_s += max(ahead_s - r.wall_s, 0.0)  # the reply waited for the draft ahead
                    edge.landed(r.wall_s)
                else:
                    r = yield post
                yield from self._commit(run, seg, r, draft_s, fresh, prop)
        finally:  # a segment cut short by a failing verifier still reports the tokens it committed
            self._segment_done(run, seg, t0)

    def _server_segment(self, run: Run, mode: str) -> Steps:
        t = yield from self._session(run, mode)
        seg, t0 = self._segment(run, mode), time.perf_counter()
        limit, rounds = self._segment_budget(run, mode)
        n = min(limit, run.max_tokens - run.generated)
        body = run.generate_request(mode, n, self.server_drafter, rounds)
        try:
            lines = yield Call(t.stream_lines, t.astream_lines, (f"/v1/spec/sessions/{run.sid}/generate", body))
            wait_s = self.policy.network_s()  # the first line comes a round trip after the request
            while run.finish is None:  # while the server decodes on, the local drafter catches up
                r = yield from self._edge.in_flight(run, Call(next, anext, (lines, None)), run.tokens, seg,
                                                    wait_s, n - seg.tokens)
                if r is None:
                    break
                yield from self._commit(run, seg, r, 0.0)
                wait_s = None
        finally:
            self._segment_done(run, seg, t0)

    def _segment_budget(self, run: Run, mode: str) -> tuple[int, int | None]:
        """A ``mode`` segment's most tokens and rounds (None: any): the client's tokens; in auto, the router's
        (:meth:`ModePolicy.segment_limit`, :meth:`~ModePolicy.segment_rounds`: a probe's, an opening's are few)."""
        return ((self.policy.segment_limit(), self.policy.segment_rounds(mode, not run.generated))
                if run.mode == "auto" else (self.segment_tokens, None))

    def _segment(self, run: Run, mode: str) -> SegmentStats:
        return SegmentStats(mode, 0, 0, 0, 0, 0.0, 0.0, 0.0, dict(self.policy.last_predictions), run.kind,
                            probe=run.mode == "auto" and self.policy.probing == mode)

    def _commit(self, run: Run, seg: SegmentStats, timed: Timed, draft_s: float, fresh: int = 0,
                prop: DraftProposal | None = None) -> list[Any]:
        """Count a round's reply (to ``prop``, an edge round's draft), tell the router, commit; its events."""
        reply = RoundReply.model_validate(timed.body)
        taken = run.taken(prop, reply) if prop is not None else None
        server_s = (reply.timings.verify_ms + reply.timings.draft_ms) / 1e3
        seg.add_round(len(reply.tokens), reply.drafted, reply.accepted, server_s, draft_s)
        events = run.apply(reply)
        self.policy.observe_round(seg.mode, reply.drafted, reply.accepted, len(reply.tokens), wall_s=timed.wall_s,
                                  server_s=server_s, verify_s=reply.timings.verify_ms / 1e3, draft_s=draft_s,
                                  waiting=reply.load.waiting, kind=run.round_kind, fresh=fresh, taken=taken,
                                  segment_kind=seg.kind, entry=seg.entry_s is not None and seg.rounds == 1)
        return events

    def _segment_done(self, run: Run, seg: SegmentStats, t0: float) -> None:
        seg.wall_s = time.perf_counter() - t0
        if not seg.tokens and not seg.rounds:
            return  # failed before committing anything: nothing to report or learn from
        run.stats.segments.append(seg)
        if seg.tokens:
            self.policy.observe_segment(seg.mode, seg.wall_s / seg.tokens, tokens=seg.tokens, rounds=seg.rounds,
                                        drafted=seg.drafted, draft_s=seg.draft_s, kind=seg.kind,
                                        catchup_s=seg.catchup_s, entry_s=seg.entry_s or 0.0,
                                        ended=run.finish is not None or run.generated >= run.max_tokens)
            if run.mode == "auto":  # judge the shadowed modes, and edge's model, on the text just committed
                shadow_segment(run, seg, self.policy, self._shadows, self._copy_chain, self._edge.pipelining())

    def _failover(self, run: Run, error: VerifierError) -> None:
        """Continue elsewhere with the committed tokens: another verifier, then the fallback API model."""
        run.stats.fallbacks.append(f"{type(error).__name__} on verifier {run.verifier}: {error}")
        run.sid = None
        if isinstance(error, ResendPrefix) and len(run.stats.fallbacks) <= 3:
            return  # same verifier, new session with the full prefix
        self.health.failed(run.verifier)  # later requests skip it until its backoff ends
        nxt = self.health.after(run.verifier)
        if nxt is not None and len(run.stats.fallbacks) <= 2 * len(self.transports):
            run.verifier = nxt
            return
        if self.fallback_model is not None:
            run.mode = "api"
            return
        raise VerifierUnavailable(f"no verifier left and no fallback_model: {error}", status=error.status,
                                  code=error.code) from error

    def _close_session(self, run: Run) -> Call | None:
        """The call that closes ``run``'s session, if it has one (the server frees its KV now)."""
        if run.sid is None or not self.transports:
            return None
        t, path, run.sid = self.transports[run.verifier], f"/v1/spec/sessions/{run.sid}", None
        return Call(t.delete, t.adelete, (path,))

    def _new_run(self, messages: list[dict], tools: list[dict] | None, max_tokens: int,
                 sampling: SamplingParams | None, stop: Sequence[str], mode: str | None,
                 tool_choice: Any = None, response_format: dict[str, Any] | None = None,
                 model: str | None = None) -> Run:
        if not messages:
            raise ValueError("messages must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        mode = mode or self.mode
        _check_mode(mode, self.drafter, self.fallback_model, self.deployment)
        if isinstance(stop, str):
            stop = [stop]
        # the tool drafter (grammar + copy + model tree) when the request asks for structure
        structured = bool(tools) or isinstance(response_format, dict)
        drafter = self.tool_drafter if structured and self.tool_drafter else self.drafter
        run = Run(list(messages), tools, max_tokens, sampling or SamplingParams(), stop, mode, drafter, tool_choice,
                  response_format, model)
        if self.deployment is not None:
            self._fit_deployment(run, mode)
        if not self.transports:
            run.mode = "api" if mode == "api" or self.deployment is None else "vllm"
            return run
        first = self.health.first()
        if first is None and self.fallback_model is not None:
            run.mode = "api"  # every verifier is backing off: do not pay a failed connect per request
        run.verifier = first if first is not None else self.health.soonest()
        return run

    def _fit_deployment(self, run: Run, mode: str) -> None:
        """How the deployment takes ``run`` (a ``mode`` that may reach it): in segments, as one chat
        completion (an answer segments cannot carry), or not at all when the router has agentspec's modes."""
        assert self.deployment is not None
        if mode not in ("auto", "vllm"):
            return
        wrong_model = run.model is not None and run.model != self.deployment.model
        refusal = segment_refusal(run)
        if self.transports and mode == "auto":
            if wrong_model or refusal is not None:
                run.excluded = frozenset({"vllm"})  # agentspec's modes carry it, segment by segment
        elif wrong_model:
            raise ValueError(f"the vllm mode cannot serve model {run.model!r}: the deployment serves "
                             f"{self.deployment.model!r}")
        else:
            run.whole = refusal

    def _logged(self, run: Run, final: FinalEvent) -> FinalEvent:
        """Log the request and its answer to ``log_path`` (when set); remember the answer for copy drafting."""
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


def _check_mode(mode: str, drafter: Drafter | None, fallback_model: str | None,
                deployment: Deployment | None = None) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "vllm" and deployment is None:
        raise ValueError("mode='vllm' needs deployment=Deployment(base_url, model): the OpenAI-compatible "
                         "server (vLLM) that serves the same target")
    if mode == "edge" and drafter is None:
        raise ValueError("edge mode needs a local drafter")
    if mode == "api" and fallback_model is None:
        raise ValueError("mode='api' needs fallback_model: set fallback_model to a litellm model id "
                         "(e.g. 'openai/gpt-4o'), with its api_base/api_key in api_kwargs")
