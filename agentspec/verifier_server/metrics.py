"""Prometheus metrics (vLLM-style names under the ``agentspec:`` prefix), one registry per server.

A tracked request's life, as the metrics see it:

1. :class:`RequestStatsMiddleware` starts a :class:`RequestRecord` when the HTTP request arrives (the clock of
   ``e2e_request_latency_seconds`` and ``time_to_first_token_seconds`` starts here) and puts it in
   :data:`CURRENT`, which every task the request spawns inherits.
2. The route calls :meth:`Metrics.admit` once the request is authenticated and valid: from now on it counts in
   ``num_requests_waiting``.
3. When the model thread starts its prefill, or the scheduler hands the batched pass of its first round to the
   model thread, it moves to ``num_requests_running`` (:meth:`RequestRecord.started`, called by the scheduler and the engine wrapper).
4. Each round's reply adds its tokens (:meth:`RequestRecord.output`): TTFT at the first, inter-token latency
   after that.
5. When the response is over (its last byte about to be sent, or the client gone) the middleware observes the
   end-to-end latency, the finish reason (``request_success``) and, for a generation request, its prompt and
   generation token counts.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

MAX_POSITION_LABELS = 32
# endpoints whose requests generate an answer (TTFT, inter-token latency, token histograms); an edge-mode
# round is one step of a generation the client drives, so it reports only its latency and, if last, its finish
GENERATION_ENDPOINTS = frozenset({"generate", "chat_completions", "completions"})
LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
ITL_BUCKETS = (.001, .0025, .005, .01, .025, .05, .075, .1, .15, .2, .3, .4, .5, .75, 1, 2.5)

CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("agentspec_request", default=None)


def current_request() -> RequestRecord | None:
    """The record of the request the calling task serves, if any."""
    return CURRENT.get()


class Metrics:
    """Counters and histograms a verifier exports on ``/metrics``; labels ``model_name`` and ``mode``.

    Besides the Prometheus objects it keeps plain running totals (``totals``) for the periodic stats log."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lbl, one = self.registry, ["model_name", "mode"], ["model_name"]
        # the standard process_* and python_* series, on this server's own registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.num_drafts = Counter("agentspec:spec_decode_num_drafts", "Rounds that carried a draft", lbl, registry=r)
        self.num_draft_tokens = Counter("agentspec:spec_decode_num_draft_tokens", "Draft tokens verified", lbl,
                                        registry=r)
        self.num_accepted = Counter("agentspec:spec_decode_num_accepted_tokens", "Draft tokens accepted", lbl,
                                    registry=r)
        self.accepted_per_pos = Counter("agentspec:spec_decode_num_accepted_tokens_per_pos",
                                        "Rounds whose draft was accepted at this position", [*lbl, "position"],
                                        registry=r)
        self.generation_tokens = Counter("agentspec:generation_tokens", "Tokens committed", lbl, registry=r)
        self.prompt_tokens_total = Counter("agentspec:prompt_tokens", "Prompt tokens prefilled", one, registry=r)
        self.prefix_reused_tokens = Counter("agentspec:prefix_cache_hit_tokens", "Prompt tokens reused from cache "
                                            "(same as prefix_cache_hits; kept for existing dashboards)", one,
                                            registry=r)
        self.prefix_queries = Counter("agentspec:prefix_cache_queries", "Prefix-cache queries, in prompt tokens",
                                      one, registry=r)
        self.prefix_hits = Counter("agentspec:prefix_cache_hits", "Prefix-cache hits, in prompt tokens", one,
                                   registry=r)
        self.requests_running = Gauge("agentspec:num_requests_running", "Requests the model has started on and "
                                      "not finished (prefill or rounds under way)", one, registry=r)
        self.requests_waiting = Gauge("agentspec:num_requests_waiting", "Requests admitted, waiting for their "
                                      "first model pass", one, registry=r)
        self.sessions = Gauge("agentspec:num_sessions", "Open sessions", one, registry=r)
        self.kv_usage = Gauge("agentspec:kv_cache_usage_perc", "KV-cache bytes / --kv-cache-memory", one, registry=r)
        self.round_latency = Histogram("agentspec:round_verify_seconds", "Forward+verify time of a round", lbl,
                                       registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.request_latency = Histogram("agentspec:e2e_request_latency_seconds", "Request latency, arrival to "
                                         "the response's last byte (or the client leaving)", [*one, "endpoint"],
                                         registry=r, buckets=LATENCY_BUCKETS)
        self.ttft = Histogram("agentspec:time_to_first_token_seconds", "Arrival to the first generated token",
                              [*one, "endpoint"], registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("agentspec:inter_token_latency_seconds", "Time per generated token after the first "
                             "(a round's gap over its tokens, observed once per token)", [*one, "endpoint"],
                             registry=r, buckets=ITL_BUCKETS)
        self.request_success = Counter("agentspec:request_success", "Finished requests by finish reason "
                                       "(stop, length, tool_calls; abort: client left; error)",
                                       [*one, "endpoint", "finished_reason"], registry=r)
        self.request_prompt = Histogram("agentspec:request_prompt_tokens", "Prompt tokens of a generation request",
                                        [*one, "endpoint"], registry=r, buckets=TOKEN_BUCKETS)
        self.request_generation = Histogram("agentspec:request_generation_tokens", "Tokens a generation request "
                                            "generated", [*one, "endpoint"], registry=r, buckets=TOKEN_BUCKETS)
        self.running = 0  # requests, see num_requests_running; changed on the event loop thread only
        self.waiting = 0
        # running totals for the stats log (the model thread adds, the log's task reads: ints, no lock needed)
        self.totals = {"prompt": 0, "prompt_reused": 0, "generation": 0, "drafts": 0, "draft_tokens": 0,
                       "accepted": 0, "requests": 0}

    def round(self, drafted: int, accepted: int, emitted: int, verify_s: float, mode: str) -> None:
        """One committed round (called on the model thread)."""
        m, t = self.model_name, self.totals
        if drafted:
            self.num_drafts.labels(m, mode).inc()
            self.num_draft_tokens.labels(m, mode).inc(drafted)
            self.num_accepted.labels(m, mode).inc(accepted)
            for pos in range(min(accepted, MAX_POSITION_LABELS)):
                self.accepted_per_pos.labels(m, mode, str(pos)).inc()
            t["drafts"], t["draft_tokens"], t["accepted"] = t["drafts"] + 1, t["draft_tokens"] + drafted, \
                t["accepted"] + accepted
        self.generation_tokens.labels(m, mode).inc(emitted)
        t["generation"] += emitted
        self.round_latency.labels(m, mode).observe(verify_s)

    def prompt_tokens(self, computed: int, reused: int) -> None:
        """A session's prompt: ``computed`` tokens prefilled, ``reused`` taken from the prefix cache."""
        m = self.model_name
        self.prompt_tokens_total.labels(m).inc(computed + reused)
        self.prefix_reused_tokens.labels(m).inc(reused)
        self.prefix_queries.labels(m).inc(computed + reused)
        self.prefix_hits.labels(m).inc(reused)
        self.totals["prompt"] += computed
        self.totals["prompt_reused"] += reused
        rec = CURRENT.get()
        if rec is not None:  # the request that opened the session (chat completions, open_session)
            rec.prompt_tokens += computed + reused

    def admit(self, endpoint: str) -> RequestRecord | None:
        """The current request is valid and tracked under ``endpoint``: it waits for the model from now."""
        rec = CURRENT.get()
        if rec is None or rec.endpoint is not None:
            return rec
        rec.endpoint, rec.metrics, rec.state = endpoint, self, "waiting"
        self.waiting += 1
        return rec

    def request(self, endpoint: str, seconds: float) -> None:
        """Observe one request's end-to-end latency."""
        self.request_latency.labels(self.model_name, endpoint).observe(seconds)

    def render(self, sessions: int, kv_fraction: float) -> bytes:
        """The exposition text, with the gauges set to the current state."""
        m = self.model_name
        self.requests_running.labels(m).set(self.running)
        self.requests_waiting.labels(m).set(self.waiting)
        self.sessions.labels(m).set(sessions)
        self.kv_usage.labels(m).set(kv_fraction)
        return generate_latest(self.registry)


class RequestRecord:
    """What the metrics know of one HTTP request (see the module docstring for its life)."""

    def __init__(self) -> None:
        self.arrival = time.perf_counter()
        self.endpoint: str | None = None  # set by Metrics.admit; None: not tracked
        self.metrics: Metrics | None = None
        self.state = "new"  # new -> waiting -> running -> done
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.finish_reason: str | None = None
        self.disconnected = False
        self.failed = False  # a streamed response ended with an error line (its status was already 200)
        self.status = 0

    def started(self) -> None:
        """The model thread has begun on this request (its prefill or first round); event loop thread."""
        if self.state == "waiting" and self.metrics is not None:
            self.metrics.waiting -= 1
            self.metrics.running += 1
            self.state = "running"

    def output(self, num_tokens: int, finish_reason: str | None) -> None:
        """A round's reply for this request: ``num_tokens`` new tokens, and its finish reason if it ended."""
        m, now = self.metrics, time.perf_counter()
        self.finish_reason = finish_reason or self.finish_reason
        if m is None or not num_tokens:
            return
        self.generation_tokens += num_tokens
        if self.endpoint not in GENERATION_ENDPOINTS:
            return
        if self.first_token is None:
            self.first_token = now
            m.ttft.labels(m.model_name, self.endpoint).observe(now - self.arrival)
        else:
            per_token = (now - self.last_token) / num_tokens
            itl = m.itl.labels(m.model_name, self.endpoint)
            for _ in range(num_tokens):
                itl.observe(per_token)
        self.last_token = now

    def finish(self) -> None:
        """The response is over: observe latency, finish reason and token counts once."""
        m = self.metrics
        if m is None or self.state == "done":
            return
        if self.state == "waiting":
            m.waiting -= 1
        elif self.state == "running":
            m.running -= 1
        self.state = "done"
        m.request(self.endpoint, time.perf_counter() - self.arrival)
        m.totals["requests"] += 1
        generation = self.endpoint in GENERATION_ENDPOINTS
        if self.status >= 400 or self.failed:
            reason = "error"
        elif self.finish_reason is not None:
            reason = self.finish_reason
        elif self.disconnected:
            reason = "abort"
        else:  # a generation ended by a stop string the engine never saw (a route that did not report it)
            reason = "stop" if generation else None
        if reason is not None:
            m.request_success.labels(m.model_name, self.endpoint, reason).inc()
        if generation and self.status < 400:
            m.request_prompt.labels(m.model_name, self.endpoint).observe(self.prompt_tokens)
            m.request_generation.labels(m.model_name, self.endpoint).observe(self.generation_tokens)


class RequestStatsMiddleware:
    """ASGI middleware: one :class:`RequestRecord` per HTTP request, finished when the app has returned, i.e.
    after the last byte of a (streamed) response or once the client has gone away."""

    def __init__(self, app: Any, on_request: Any = None) -> None:
        """``on_request``: called with no arguments on every HTTP request (starts the stats log lazily)."""
        self.app, self.on_request = app, on_request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.on_request is not None:
            self.on_request()
        rec = RequestRecord()
        token = CURRENT.set(rec)

        async def watch_receive() -> dict:
            message = await receive()
            if message["type"] == "http.disconnect":
                rec.disconnected = True
            return message

        async def watch_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                rec.finish()  # before the last byte leaves: a client that has the whole answer sees it counted
            await send(message)

        try:
            await self.app(scope, watch_receive, watch_send)
        except BaseException:  # the client went away (or the server is stopping) mid-response
            rec.disconnected = True
            raise
        finally:
            CURRENT.reset(token)
            rec.finish()


def mark_failed() -> None:
    """The current request's (streamed) response ends with an error: count it as ``error``."""
    rec = CURRENT.get()
    if rec is not None:
        rec.failed = True


def sse_finish_reason(chunk: bytes) -> str | None:
    """The ``finish_reason`` of a streamed ``chat.completion.chunk`` event, if it carries one (the last does)."""
    if not chunk.startswith(b"data: {") or b'"finish_reason": "' not in chunk:  # cheap test first: most don't
        return None
    try:
        choices = json.loads(chunk[6:]).get("choices") or [{}]
    except ValueError:
        return None
    return choices[0].get("finish_reason")


def track_model_jobs(engine: Any) -> None:
    """Mark a request running when the model thread starts its prefill (an ``open_session``), by wrapping
    ``engine.run_on_model``; batched rounds are marked by the scheduler when their pass starts."""
    inner = engine.run_on_model

    async def run_on_model(fn: Any, *args: Any, **kw: Any) -> Any:
        rec = CURRENT.get()
        if rec is None or rec.state != "waiting" or fn == engine.execute:
            return await inner(fn, *args, **kw)
        loop = asyncio.get_running_loop()

        def job(*a: Any) -> Any:
            loop.call_soon_threadsafe(rec.started)  # the counters belong to the event loop thread
            return fn(*a)

        return await inner(job, *args, **kw)

    engine.run_on_model = run_on_model
