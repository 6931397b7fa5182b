"""Prometheus metrics (vLLM-style names under the ``agentspec:`` prefix), one registry per server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_POSITION_LABELS = 32


class Metrics:
    """Counters and histograms a verifier exports on ``/metrics``; labels ``model_name`` and ``mode``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lbl, one = self.registry, ["model_name", "mode"], ["model_name"]
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
        self.prefix_reused_tokens = Counter("agentspec:prefix_cache_hit_tokens", "Prompt tokens reused from cache",
                                            one, registry=r)
        self.requests_running = Gauge("agentspec:num_requests_running", "Rounds in the current pass", one, registry=r)
        self.requests_waiting = Gauge("agentspec:num_requests_waiting", "Rounds queued", one, registry=r)
        self.sessions = Gauge("agentspec:num_sessions", "Open sessions", one, registry=r)
        self.kv_usage = Gauge("agentspec:kv_cache_usage_perc", "KV-cache bytes / --kv-cache-memory", one, registry=r)
        self.round_latency = Histogram("agentspec:round_verify_seconds", "Forward+verify time of a round", lbl,
                                       registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.request_latency = Histogram("agentspec:e2e_request_latency_seconds", "Request latency",
                                         [*one, "endpoint"], registry=r,
                                         buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120))

    def round(self, drafted: int, accepted: int, emitted: int, verify_s: float, mode: str) -> None:
        m = self.model_name
        if drafted:
            self.num_drafts.labels(m, mode).inc()
            self.num_draft_tokens.labels(m, mode).inc(drafted)
            self.num_accepted.labels(m, mode).inc(accepted)
            for pos in range(min(accepted, MAX_POSITION_LABELS)):
                self.accepted_per_pos.labels(m, mode, str(pos)).inc()
        self.generation_tokens.labels(m, mode).inc(emitted)
        self.round_latency.labels(m, mode).observe(verify_s)

    def prompt_tokens(self, computed: int, reused: int) -> None:
        self.prompt_tokens_total.labels(self.model_name).inc(computed + reused)
        self.prefix_reused_tokens.labels(self.model_name).inc(reused)

    def request(self, endpoint: str, seconds: float) -> None:
        self.request_latency.labels(self.model_name, endpoint).observe(seconds)

    def render(self, running: int, waiting: int, sessions: int, kv_fraction: float) -> bytes:
        m = self.model_name
        self.requests_running.labels(m).set(running)
        self.requests_waiting.labels(m).set(waiting)
        self.sessions.labels(m).set(sessions)
        self.kv_usage.labels(m).set(kv_fraction)
        return generate_latest(self.registry)
