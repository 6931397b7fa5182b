"""/metrics and the stats log of a real verifier on loopback: whole-request latency for streams, requests (not
rounds) running and waiting, TTFT / inter-token latency, finish reasons, token histograms, prefix-cache
counters, the process collectors, the periodic stats line and the loading line.

Ordering is made deterministic by holding the model thread with gate jobs (the engine's one-worker executor
runs jobs in order), never by sleeping."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentspec.drafters import ModelDrafter
from tests.helpers import make_prompt
from tests.integration.server import LoopbackServer, config, edge_generate

pytestmark = pytest.mark.integration
CHAT = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(target):
    with LoopbackServer(target, config(log_stats_interval_s=0)) as srv:  # no background stats task
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    text = client.get("/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= lbl)


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll until ``check()`` (an eventual state, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@contextmanager
def gated_generate(server, client: httpx.Client, max_new: int = 12, hang_up: bool = False
                   ) -> Iterator[dict[str, Any]]:
    """A streamed server-ar ``generate`` whose first round has been answered and whose second round is held
    behind a gate job on the model thread until ``state["release"]()``; ``state["lines"]`` is a queue of the
    replies (``None`` at the end). ``hang_up``: the client closes the connection after the first line."""
    prompt = make_prompt(3)
    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt, "stop_token_ids": []}).json()["session_id"]
    first_gate, second_gate = threading.Event(), threading.Event()
    lines: queue.Queue = queue.Queue()
    model_thread = server.engine.executor
    model_thread.submit(first_gate.wait, 60)  # the first round queues behind this

    def stream() -> None:
        body = {"base_len": len(prompt), "mode": "server-ar", "max_new_tokens": max_new}
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                c.stream("POST", f"/v1/spec/sessions/{sid}/generate", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.put(json.loads(line))
                    if hang_up:
                        break  # leaves the stream unread: httpx closes the connection
        lines.put(None)

    pool = cf.ThreadPoolExecutor(1)
    fut = pool.submit(stream)
    try:
        # running == 1 means the scheduler has handed the first round's pass to the model thread (in the same
        # event-loop step), so a gate submitted now lands between the first and the second round
        wait_until(lambda: value(scrape(client), "agentspec:num_requests_running") == 1, "the first round")
        model_thread.submit(second_gate.wait, 60)
        first_gate.set()
        yield {"lines": lines, "release": second_gate.set}
    finally:
        first_gate.set()
        second_gate.set()
        fut.result(timeout=60)
        pool.shutdown()


def test_streamed_e2e_is_observed_when_the_stream_ends(server, client):
    before = scrape(client)
    with gated_generate(server, client, max_new=12) as g:
        replies = [g["lines"].get(timeout=60)]
        assert replies[0]["tokens"] and not replies[0]["finished"]
        during = scrape(client)
        # the old code observed e2e when the first round came back, i.e. by now
        assert delta(during, before, "agentspec:e2e_request_latency_seconds_count", endpoint="generate") == 0
        assert value(during, "agentspec:num_requests_running") == 1
        g["release"]()
        while (line := g["lines"].get(timeout=60)) is not None:
            replies.append(line)
    # the reader has seen the whole response: its observation is already in (made before the last byte)
    after = scrape(client)
    tokens = sum(len(r["tokens"]) for r in replies)
    assert replies[-1]["finished"] and tokens == 12
    assert delta(after, before, "agentspec:e2e_request_latency_seconds_count", endpoint="generate") == 1
    assert delta(after, before, "agentspec:request_success_total", endpoint="generate",
                 finished_reason="length") == 1
    assert delta(after, before, "agentspec:time_to_first_token_seconds_count", endpoint="generate") == 1
    itl = delta(after, before, "agentspec:inter_token_latency_seconds_count", endpoint="generate")
    assert itl == tokens - len(replies[0]["tokens"])
    e2e_s = delta(after, before, "agentspec:e2e_request_latency_seconds_sum", endpoint="generate")
    ttft_s = delta(after, before, "agentspec:time_to_first_token_seconds_sum", endpoint="generate")
    itl_s = delta(after, before, "agentspec:inter_token_latency_seconds_sum", endpoint="generate")
    # nested windows: arrival <= first token <= last token <= end of the response; the second round waited
    # behind the gate until after `during`, so the stream outlasted its first round
    assert ttft_s > 0 and e2e_s >= ttft_s + itl_s - 1e-6
    assert delta(after, before, "agentspec:request_generation_tokens_sum", endpoint="generate") == tokens
    assert value(after, "agentspec:num_requests_running") == value(after, "agentspec:num_requests_waiting") == 0


def test_client_gone_mid_stream_is_an_abort(server, client):
    before = scrape(client)
    with gated_generate(server, client, hang_up=True) as g:
        assert g["lines"].get(timeout=60)["tokens"]
        # observed when the server notices the client left (its next round is still held at the gate)
        wait_until(lambda: delta(scrape(client), before, "agentspec:request_success_total", endpoint="generate",
                                 finished_reason="abort") == 1, "the abort")
        during = scrape(client)
        assert delta(during, before, "agentspec:e2e_request_latency_seconds_count", endpoint="generate") == 1
        assert value(during, "agentspec:num_requests_running") == 0
        g["release"]()


def test_waiting_counts_requests_before_their_first_pass(server, client):
    gate = threading.Event()
    server.engine.executor.submit(gate.wait, 60)  # the chat request's prefill queues behind this
    body = {"messages": CHAT, "max_tokens": 4}
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(lambda: httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60))
        try:
            # the old gauges counted queued rounds: a request waiting for its prefill was not there at all
            wait_until(lambda: value(scrape(client), "agentspec:num_requests_waiting") == 1, "a waiting request")
            assert value(scrape(client), "agentspec:num_requests_running") == 0
        finally:
            gate.set()
        assert fut.result(timeout=60).status_code == 200
    after = scrape(client)
    assert value(after, "agentspec:num_requests_waiting") == 0
    assert value(after, "agentspec:num_requests_running") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_chat_completion_metrics(client, stream):
    body = {"messages": CHAT, "max_tokens": 8, "stream": stream, "stream_options": {"include_usage": True}}
    answers = []
    for _ in range(2):  # the second reuses the first's prefix from the cache
        before = scrape(client)
        if stream:
            with client.stream("POST", "/v1/chat/completions", json=body) as r:
                events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
            usage = events[-1]["usage"]
            finish = next(e["choices"][0]["finish_reason"] for e in events
                          if e["choices"] and e["choices"][0]["finish_reason"])
        else:
            out = client.post("/v1/chat/completions", json=body).json()
            usage, finish = out["usage"], out["choices"][0]["finish_reason"]
        after = scrape(client)
        answers.append(usage)
        ep = {"endpoint": "chat_completions"}
        assert delta(after, before, "agentspec:e2e_request_latency_seconds_count", **ep) == 1
        assert delta(after, before, "agentspec:request_success_total", finished_reason=finish, **ep) == 1
        assert delta(after, before, "agentspec:request_prompt_tokens_count", **ep) == 1
        assert delta(after, before, "agentspec:request_prompt_tokens_sum", **ep) == usage["prompt_tokens"]
        assert delta(after, before, "agentspec:request_generation_tokens_sum", **ep) == usage["completion_tokens"]
        assert delta(after, before, "agentspec:prefix_cache_queries_total") == usage["prompt_tokens"]
        assert delta(after, before, "agentspec:prefix_cache_hits_total") == \
            usage["prompt_tokens_details"]["cached_tokens"]
        n = usage["completion_tokens"]
        assert delta(after, before, "agentspec:time_to_first_token_seconds_count", **ep) == (1 if n else 0)
        # server-ar (no drafter): one token per round, so every token after the first has its own gap
        assert delta(after, before, "agentspec:inter_token_latency_seconds_count", **ep) == max(n - 1, 0)
        assert delta(after, before, "agentspec:e2e_request_latency_seconds_sum", **ep) >= \
            delta(after, before, "agentspec:time_to_first_token_seconds_sum", **ep) + \
            delta(after, before, "agentspec:inter_token_latency_seconds_sum", **ep) - 1e-6
        assert value(after, "agentspec:num_requests_running") == value(after, "agentspec:num_requests_waiting") == 0
    assert answers[1]["prompt_tokens_details"]["cached_tokens"] > 0


def test_edge_rounds_count_per_request(client, target):
    before = scrape(client)
    out = edge_generate(client, make_prompt(4), ModelDrafter(target), k=3, max_new=10)
    after = scrape(client)
    assert delta(after, before, "agentspec:e2e_request_latency_seconds_count", endpoint="round") == len(out.rounds)
    assert delta(after, before, "agentspec:e2e_request_latency_seconds_count", endpoint="open_session") == 1
    # only the round that ends the generation has a finish reason
    assert delta(after, before, "agentspec:request_success_total", endpoint="round") == 1
    assert delta(after, before, "agentspec:request_success_total", endpoint="round",
                 finished_reason=out.finish_reason) == 1
    assert delta(after, before, "agentspec:spec_decode_num_drafts_total") == len(out.rounds)


def test_errors_count_as_error(client):
    before = scrape(client)
    r = client.post("/v1/spec/sessions", json={"prompt_ids": [1] * 100_000})  # past --max-model-len
    assert r.status_code == 400
    after = scrape(client)
    assert delta(after, before, "agentspec:request_success_total", endpoint="open_session",
                 finished_reason="error") == 1
    assert value(after, "agentspec:num_requests_waiting") == 0


def test_process_and_python_collectors(client):
    text = client.get("/metrics").text
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "python_info",
                 "python_gc_objects_collected_total"):
        assert f"\n{name}" in text, name


def test_stats_line(server, client, target):
    stats = server.server.config.app.state.stats_logger
    stats.tick()  # start a fresh interval
    assert stats.tick() is None  # nothing happened: no line
    edge_generate(client, make_prompt(5), ModelDrafter(target), k=3, max_new=8)
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}).raise_for_status()
    line = stats.tick()
    assert line is not None
    for part in ("Avg prompt throughput:", "Avg generation throughput:", "Running: 0 reqs", "Waiting: 0 reqs",
                 "KV cache usage:", "Prefix cache hit rate:", "mean accepted length", "draft acceptance rate"):
        assert part in line, (part, line)
    assert stats.tick() is None  # idle again: no flood of zero lines


def test_stats_are_logged_periodically(target, caplog):
    caplog.set_level(logging.INFO, logger="agentspec.verifier")
    with LoopbackServer(target, config(log_stats_interval_s=0.05)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        c.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4}).raise_for_status()
        wait_until(lambda: any("Avg generation throughput" in r.getMessage() for r in caplog.records),
                   "a stats line")


def test_loading_line(target, tmp_path, caplog):
    from agentspec.verifier_server.cli import build_engine, parse_args

    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    caplog.set_level(logging.INFO, logger="agentspec.verifier")
    engine = build_engine(parse_args([str(tmp_path), "--device", "cpu", "--dtype", "float32"]))
    try:
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading model")]
        assert len(lines) == 2, lines
        assert "dtype float32" in lines[0] and "device cpu" in lines[0]
        assert " took " in lines[1] and "float32" in lines[1] and "cpu" in lines[1]
    finally:
        engine.shutdown()
