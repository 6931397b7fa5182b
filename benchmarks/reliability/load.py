"""Load-side checks, each on an ``agentspec-verifier`` subprocess pinned to ``SERVER_CPU``:

* head-of-line: a short request from key B sent while key A's long prompt is being prefilled; its wait
  against one prefill chunk's time (``--prefill-chunk-tokens``);
* slow and greedy clients: a stalled body gets a 408 within ``--body-timeout``; connections beyond
  ``--max-connections`` get a 503 and the server goes on serving;
* soak: N client threads mixing streamed chat, non-streamed chat and session rounds; errors, p50/p95
  latency and the server's RSS every 10 s, and RSS growth after warm-up.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.reliability.common import (
    VerifierProcess,
    chat,
    client,
    finish_rounds,
    log,
    make_prompt,
    open_session,
    percentile,
    save_model,
    tiny_model,
)


def hol(root: Path, repeats: int, prompt_tokens: int, chunk: int) -> dict[str, Any]:
    """``repeats`` long prefills (``prompt_tokens``) by key A; 0.3 s into each, key B sends a 2-token chat
    request (tokenize, prefill, two rounds: several model steps), and on odd repeats instead one round on a
    session it opened before (one model step). Chunk times: a first chunk (the server's ``prefill_ms`` of a
    ``chunk``-token prompt) and the long prefill's mean per chunk (later chunks attend to more positions)."""
    target = tiny_model(3, layers=8, hidden=512, max_len=prompt_tokens + 64)
    model_dir = save_model(target, root)
    srv = VerifierProcess(model_dir, args=("--prefill-chunk-tokens", str(chunk), "--max-model-len",
                                           str(prompt_tokens + 32)), env={"AGENTSPEC_API_KEY": "hol-a,hol-b"})
    srv.start()
    waits, round_waits, long_s, chunk_ms = [], [], [], []
    try:
        with client(srv.url, "hol-a", 300) as a, client(srv.url, "hol-b", 300) as b:
            for i in range(5):  # one chunk's prefill time, as the server reports it (first run: warm-up)
                r = a.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(200 + i, chunk), "max_new_tokens": 2})
                if i:
                    chunk_ms.append(r.json()["prefill_ms"])
                a.delete(f"/v1/spec/sessions/{r.json()['session_id']}")
            chat(b, [{"role": "user", "content": "hi"}], 2, stream=False)  # warm-up
            for i in range(repeats):
                done: dict[str, float] = {}

                def long_prefill(seed: int = i, done: dict = done) -> None:
                    t = time.monotonic()
                    r = a.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(300 + seed, prompt_tokens),
                                                          "max_new_tokens": 2})
                    done["long_s"] = time.monotonic() - t
                    a.delete(f"/v1/spec/sessions/{r.json()['session_id']}")
                th = threading.Thread(target=long_prefill)
                th.start()
                if i % 2:
                    prompt = make_prompt(400 + i, 16)
                    sid = open_session(b, prompt, 4)
                time.sleep(0.3)
                t = time.monotonic()
                if i % 2:
                    b.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt)}).raise_for_status()
                    round_waits.append(time.monotonic() - t)
                else:
                    chat(b, [{"role": "user", "content": "hi"}], 2, stream=False)
                    waits.append(time.monotonic() - t)
                th.join()
                long_s.append(done["long_s"])
    finally:
        srv.stop()
    chunk_s = sorted(chunk_ms)[len(chunk_ms) // 2] / 1e3
    p95, p95_round = percentile(waits, 0.95), percentile(round_waits, 0.95)
    mean_chunk_s = sum(long_s) / len(long_s) / -(-prompt_tokens // chunk)
    out = {"p95_wait_s": round(p95, 3), "waits_s": [round(w, 3) for w in waits],
           "round_p95_wait_s": _r(p95_round), "round_waits_s": [round(w, 3) for w in round_waits],
           "chunk_tokens": chunk, "one_chunk_s": round(chunk_s, 3), "limit_s": round(2 * chunk_s, 3),
           "mean_chunk_s_in_long_prefill": round(mean_chunk_s, 3), "prompt_tokens": prompt_tokens,
           "long_prefill_s": [round(x, 2) for x in long_s], "model": "llama 8 layers, hidden 512, float32",
           "pinned": srv.pinned}
    log(f"head-of-line: p95 wait {p95:.3f} s (one round: {p95_round}); one {chunk}-token chunk {chunk_s:.3f} s "
        f"(mean in the long prefill {mean_chunk_s:.3f} s); "
        f"{prompt_tokens}-token prefill {sum(long_s) / len(long_s):.2f} s")
    return out


def _raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(data)
    return s


def _read_status(s: socket.socket) -> int | None:
    try:
        head = s.recv(4096)
    except OSError:
        return None
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def slow_clients(root: Path, target, body_timeout_s: float = 2.0, max_connections: int = 16) -> dict[str, Any]:
    model_dir = save_model(target, root)
    srv = VerifierProcess(model_dir, args=("--body-timeout", str(body_timeout_s), "--max-connections",
                                           str(max_connections)))
    srv.start()
    out: dict[str, Any] = {"body_timeout_s": body_timeout_s, "max_connections": max_connections,
                           "pinned": srv.pinned}
    try:
        t = time.monotonic()
        s = _raw(srv.port, b"POST /v1/spec/sessions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                           b"content-length: 100\r\n\r\n{\"prompt_ids\"")
        out["stalled_body_status"] = _read_status(s)
        out["stalled_body_answer_s"] = round(time.monotonic() - t, 2)
        s.close()
        out["stalled_body_ok"] = out["stalled_body_status"] == 408 and \
            out["stalled_body_answer_s"] <= body_timeout_s + 1.5
        t = time.monotonic()
        s = _raw(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        s.settimeout(body_timeout_s + 10)
        out["slow_headers_status"] = _read_status(s)
        out["slow_headers_closed_after_s"] = round(time.monotonic() - t, 2)
        s.close()
        # greedy clients: connections opened and left idle (a request arriving on one beyond the cap would
        # itself get the 503 and free its slot)
        held = [_raw(srv.port, b"") for _ in range(3 * max_connections)]
        time.sleep(1.0)
        try:
            r = httpx.get(srv.url + "/health", timeout=5)
            out["beyond_cap_status"] = r.status_code
        except httpx.HTTPError as e:
            out["beyond_cap_status"] = repr(e)[:80]
        for s in held:
            s.close()
        time.sleep(0.3)
        with client(srv.url) as c:
            t = time.monotonic()
            out["after_release_text"] = chat(c, [{"role": "user", "content": "x"}], 4, stream=False)
            out["after_release_s"] = round(time.monotonic() - t, 3)
        out["beyond_cap_ok"] = out["beyond_cap_status"] == 503
        out["server_alive"] = srv.proc.poll() is None
    finally:
        srv.stop()
    log(f"slow clients: stalled body -> {out['stalled_body_status']} after {out['stalled_body_answer_s']} s; "
        f"beyond --max-connections -> {out['beyond_cap_status']}; served after: {out.get('server_alive')}")
    return out


def fd_exhaustion(root: Path, target, fd_limit: int = 256, idle: int = 300) -> dict[str, Any]:
    """A verifier whose open-file limit is ``fd_limit`` (soft and hard) and ``idle`` connections opened and
    left silent: a new client must still be answered at once (a 503 while the flood lasts), the server's
    log must not fill with failed accepts, and it must serve normally once the flood ends."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process holds the idle connections
    srv = VerifierProcess(save_model(target, root), fd_limit=fd_limit)
    srv.start()
    out: dict[str, Any] = {"fd_limit": fd_limit, "idle_connections": idle, "pinned": srv.pinned}
    try:
        held = [_raw(srv.port, b"") for _ in range(idle)]
        time.sleep(1.0)
        t = time.monotonic()
        try:
            out["new_client_status"] = httpx.get(srv.url + "/health", timeout=10).status_code
        except httpx.HTTPError as e:
            out["new_client_status"] = repr(e)[:80]
        out["new_client_answer_s"] = round(time.monotonic() - t, 3)
        for s in held:
            s.close()
        time.sleep(0.5)
        with client(srv.url) as c:
            out["after_flood_text"] = chat(c, [{"role": "user", "content": "x"}], 4, stream=False)
        log_text = Path(srv.log.name).read_text()
        out["too_many_open_files_log_lines"] = log_text.count("Too many open files")
        out["cap_lowered_warning"] = "serving at most" in log_text
        out["server_alive"] = srv.proc.poll() is None
    finally:
        srv.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    out["ok"] = (isinstance(out["new_client_status"], int) and out["new_client_answer_s"] < 2.0
                 and out["too_many_open_files_log_lines"] == 0 and out["server_alive"])
    log(f"fd exhaustion: limit {fd_limit}, {idle} idle connections: a new client got "
        f"{out['new_client_status']} in {out['new_client_answer_s']} s; 'Too many open files' logged "
        f"{out['too_many_open_files_log_lines']} times; served after: {out['server_alive']}")
    return out


def soak(root: Path, target, clients: int, duration_s: float, sample_s: float = 10.0) -> dict[str, Any]:
    model_dir = save_model(target, root)
    srv = VerifierProcess(model_dir)
    srv.start()
    stop = threading.Event()
    lat: dict[str, list[float]] = {"chat_stream": [], "chat": [], "session": []}
    errors: list[str] = []
    samples: list[dict[str, Any]] = []

    def worker(n: int) -> None:
        rng = random.Random(n)
        with client(srv.url, timeout=60) as c:
            while not stop.is_set():
                kind = rng.choice(list(lat))
                t = time.monotonic()
                try:
                    if kind == "session":
                        prompt = make_prompt(rng.randrange(1000), 30)
                        sid = open_session(c, prompt, 24)
                        finish_rounds(c, sid, len(prompt))
                        c.delete(f"/v1/spec/sessions/{sid}")
                    else:
                        msg = [{"role": "user", "content": f"soak {rng.randrange(1000)}"}]
                        chat(c, msg, 24, stream=kind == "chat_stream")
                    lat[kind].append(time.monotonic() - t)
                except Exception as e:
                    errors.append(f"{kind}: {e!r}"[:200])

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for th in threads:
        th.start()
    try:
        while time.monotonic() - t0 < duration_s:
            time.sleep(min(sample_s, max(0.0, duration_s - (time.monotonic() - t0))))
            all_lat = [x for v in lat.values() for x in v]
            samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(srv.rss_bytes() / 2**20, 1),
                            "requests": len(all_lat), "errors": len(errors)})
            log(f"soak: {samples[-1]}")
        stop.set()
        for th in threads:
            th.join(90)
    finally:
        srv.stop()
    warm = next((s for s in samples if s["t_s"] >= max(10.0, 0.2 * duration_s)), samples[0])
    growth = (samples[-1]["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"]
    out = {"clients": clients, "duration_s": duration_s, "errors": len(errors), "error_samples": errors[:5],
           "requests": {k: len(v) for k, v in lat.items()},
           "p50_s": {k: _r(percentile(v, 0.5)) for k, v in lat.items()},
           "p95_s": {k: _r(percentile(v, 0.95)) for k, v in lat.items()},
           "rss_samples": samples, "warm_up_sample_t_s": warm["t_s"], "rss_growth_frac": round(growth, 4),
           "pinned": srv.pinned}
    log(f"soak: {sum(out['requests'].values())} requests, {len(errors)} errors, RSS growth after warm-up "
        f"{growth:+.2%}, p95 {out['p95_s']}")
    return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
