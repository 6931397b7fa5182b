"""Verifier-server benchmark: loopback overhead, batched throughput, edge vs co-located server compute,
peak memory under the KV cap, and prefix reuse on an agent conversation.

Runs real ``agentspec-verifier`` processes on 127.0.0.1 (SmolLM2-135M-Instruct, the offline alias) and
talks to them over HTTP with httpx, like SpecClient does. Prompts are BFCL tool-calling questions
(``benchmarks.common.bfcl_prompts``), greedy. Writes ``benchmarks/results/server.json`` and ``.md``.

    python -m benchmarks.server [--dtypes bfloat16,float32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from agentspec import models
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import DraftContext
from agentspec.router import capacity_ratio
from benchmarks import common
from benchmarks.common import log

TARGET = "smollm2-135m-instruct"


class Verifier:
    """An ``agentspec-verifier`` subprocess on a free loopback port (``cpus``: pinned there with ``taskset``,
    as on a machine of its own)."""

    def __init__(self, dtype: str, *extra: str, threads: int = 2, target: str = TARGET, cpus: str | None = None
                 ) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, "-m", "agentspec.verifier_server", target, "--dtype", dtype, "--device", "cpu",
               "--port", str(self.port), "--log-level", "warning", *extra]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server; not a pipe, which could fill)
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"verifier exited: {self.log.read().decode()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("verifier did not become ready")
            time.sleep(0.5)

    def peak_rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def open_session(c: httpx.Client, ids: list[int], headers: dict | None = None, **kw: Any) -> dict:
    r = c.post("/v1/spec/sessions", json={"prompt_ids": ids, **kw}, headers=headers)
    r.raise_for_status()
    return r.json()


def run_rounds(c: httpx.Client, sid: str, base: int, rounds: int, draft: list[int]) -> list[tuple[float, dict]]:
    """``rounds`` edge rounds each carrying ``draft`` (a fixed k-token draft); (wall seconds, reply)."""
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        r = c.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": base, "draft": {"tokens": draft}})
        wall = time.perf_counter() - t0
        r.raise_for_status()
        rep = r.json()
        out.append((wall, rep))
        base = rep["committed_len"]
        if rep["finished"]:
            break
    return out


def overhead(dtype: str, ids: list[int], reps: int) -> dict:
    """(a) round wall time on loopback − the server's own verify time, as a fraction of verify time."""
    srv = Verifier(dtype)
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            res = {}
            for k in (1, 4, 8):
                info = open_session(c, ids, max_new_tokens=reps + 2)
                rows = run_rounds(c, info["session_id"], len(ids), 3, [ids[-1]] * k)  # warm-up rounds
                info = open_session(c, ids, max_new_tokens=10 * reps)
                rows = run_rounds(c, info["session_id"], len(ids), reps, [ids[-1]] * k)
                walls = [w for w, _ in rows]
                verify = [r["timings"]["verify_ms"] / 1e3 for _, r in rows]
                over = [w - v for w, v in zip(walls, verify, strict=True)]
                res[k] = {"rounds": len(rows), "wall_ms": statistics.median(walls) * 1e3,
                          "verify_ms": statistics.median(verify) * 1e3,
                          "overhead_ms": statistics.median(over) * 1e3,
                          "overhead_frac": sum(over) / sum(verify)}
                log(f"[{dtype}] (a) k={k}: round {res[k]['wall_ms']:.1f} ms, verify {res[k]['verify_ms']:.1f} ms, "
                    f"overhead {res[k]['overhead_ms']:.2f} ms = {res[k]['overhead_frac']:.3f} of verify")
            return res
    finally:
        srv.close()


def throughput(dtype: str, prompts: list[list[int]], rounds: int, k: int) -> dict:
    """(b) rounds/s with N concurrent sessions: batched server vs the same rounds one at a time."""
    out: dict[str, dict] = {}
    for label, extra in (("batched", ["--max-batch-size", "8"]), ("serial", ["--max-batch-size", "1"])):
        srv = Verifier(dtype, *extra)
        try:
            out[label] = {}
            for n in (1, 2, 4, 8):
                def client(i: int, res: list, barrier: threading.Barrier, url: str) -> None:
                    with httpx.Client(base_url=url, timeout=300) as c:
                        ids = prompts[i % len(prompts)]
                        info = open_session(c, ids, max_new_tokens=rounds * (k + 1) + 8)
                        run_rounds(c, info["session_id"], len(ids), 2, [ids[-1]] * k)  # warm
                        base = c.get(f"/v1/spec/sessions/{info['session_id']}").json()["committed_len"]
                        barrier.wait()
                        t0 = time.perf_counter()
                        rows = run_rounds(c, info["session_id"], base, rounds, [ids[-1]] * k)
                        res.append((len(rows), time.perf_counter() - t0,
                                    [r["timings"]["batch_size"] for _, r in rows],
                                    [(r["timings"]["verify_ms"], r["timings"]["queue_ms"], w * 1e3) for w, r in rows]))
                res: list = []
                barrier = threading.Barrier(n)
                threads = [threading.Thread(target=client, args=(i, res, barrier, srv.url)) for i in range(n)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = max(r[1] for r in res)
                total = sum(r[0] for r in res)
                sizes = [b for r in res for b in r[2]]
                times = [t for r in res for t in r[3]]
                med = {name: statistics.median(t[i] for t in times)
                       for i, name in enumerate(("verify_ms_median", "queue_ms_median", "round_ms_median"))}
                out[label][n] = {"rounds": total, "wall_s": wall, "rounds_per_s": total / wall,
                                 "max_batch": max(sizes), "mean_batch": sum(sizes) / len(sizes), **med}
                log(f"[{dtype}] (b) {label} n={n}: {total / wall:.2f} rounds/s (batch size: max {max(sizes)}, "
                    f"mean over rounds {out[label][n]['mean_batch']:.2f}; median pass {med['verify_ms_median']:.0f} "
                    f"ms, queue {med['queue_ms_median']:.0f} ms, round {med['round_ms_median']:.0f} ms)")
        finally:
            srv.close()
    out["ratio"] = {n: out["batched"][n]["rounds_per_s"] / out["serial"][n]["rounds_per_s"] for n in (1, 2, 4, 8)}
    return out


def capacity(dtype: str, target: models.LoadedModel, ids_list: list[list[int]], gamma: int, layers: int,
             max_new: int) -> dict:
    """(c) server compute per emitted token: edge (client drafts) vs server mode (server drafts)."""
    drafter = models.layer_skip_drafter(target, layers)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.model.save_pretrained(tmp)
        target.tokenizer.save_pretrained(tmp)
        srv = Verifier(dtype, "--draft-model", tmp)
        try:
            with httpx.Client(base_url=srv.url, timeout=300) as c:
                edge = {"verify_s": 0.0, "draft_s": 0.0, "tokens": 0, "rounds": 0}
                server = {"verify_s": 0.0, "draft_s": 0.0, "tokens": 0, "rounds": 0}
                local = ModelDrafter(drafter)
                for warm, ids in [(True, ids_list[0])] + [(False, x) for x in ids_list]:
                    info = open_session(c, ids, max_new_tokens=max_new)
                    tokens, local_draft_s = list(ids), 0.0
                    local.reset()
                    while True:  # edge: the same drafter, run here
                        t0 = time.perf_counter()
                        prop = local.propose(DraftContext(tokens, len(ids)), gamma)
                        local_draft_s += time.perf_counter() - t0
                        rep = c.post(f"/v1/spec/sessions/{info['session_id']}/rounds",
                                     json={"base_len": len(tokens), "draft": {"tokens": list(prop.tokens)}}).json()
                        tokens += rep["tokens"]
                        if not warm:
                            edge["verify_s"] += rep["timings"]["verify_ms"] / 1e3
                            edge["tokens"] += len(rep["tokens"])
                            edge["rounds"] += 1
                        if rep["finished"]:
                            break
                    if not warm:
                        edge["draft_s"] += local_draft_s
                    info = open_session(c, ids, max_new_tokens=max_new)
                    with c.stream("POST", f"/v1/spec/sessions/{info['session_id']}/generate",
                                  json={"base_len": len(ids), "mode": "server", "max_new_tokens": max_new,
                                        "num_draft_tokens": gamma, "drafter": "model"}) as r:
                        for line in r.iter_lines():
                            if line and not warm:
                                rep = json.loads(line)
                                server["verify_s"] += rep["timings"]["verify_ms"] / 1e3
                                server["draft_s"] += rep["timings"]["draft_ms"] / 1e3
                                server["tokens"] += len(rep["tokens"])
                                server["rounds"] += 1
        finally:
            srv.close()
    per_edge = edge["verify_s"] / edge["tokens"]
    per_server = (server["verify_s"] + server["draft_s"]) / server["tokens"]
    t_v = server["verify_s"] / server["rounds"]
    t_ds = server["draft_s"] / (server["rounds"] * gamma)
    res = {"gamma": gamma, "drafter_layers": layers, "edge": edge, "server": server,
           "server_compute_per_token_edge_ms": per_edge * 1e3, "server_compute_per_token_server_ms": per_server * 1e3,
           "t_v_ms": t_v * 1e3, "t_ds_ms": t_ds * 1e3, "measured": per_server / per_edge,
           "predicted": capacity_ratio(gamma, t_ds, t_v)}
    log(f"[{dtype}] (c) server compute/token: edge {per_edge * 1e3:.2f} ms, server mode {per_server * 1e3:.2f} ms; "
        f"ratio {res['measured']:.3f} vs predicted 1 + γ·t_ds/t_v = {res['predicted']:.3f}")
    return res


def kv_bytes_per_token(target: models.LoadedModel) -> int:
    """KV-cache bytes per cached position of ``target`` (measured on an 8-token cache)."""
    cache = models.new_cache(target.model)
    models.forward(target.model, list(range(1, 9)), cache, 1)
    return -(-models.cache_nbytes(cache) // 8)


def memory(dtype: str, target_bytes: int, prompts: list[list[int]], cap_mb: int, sessions: int,
           tokens_per_session: int, state_dict_bytes: int | None = None) -> dict:
    """(d) peak RSS while serving many long sessions under ``--kv-cache-memory``, vs model bytes + cap.

    ``target_bytes`` is what the server's weights occupy as loaded (:func:`models.resident_weight_bytes`:
    in bf16 on a CPU without bf16 kernels the packed linears hold an fp32 copy beside the bf16 weight);
    the ratio against the plain ``state_dict`` size is reported too.

    The kernel's peak-RSS mark is reset once the server is up (``/proc/PID/clear_refs`` = 5), so the
    serving peak excludes the one-off load transients; the peak since start is reported too.
    """
    srv = Verifier(dtype, "--kv-cache-memory", f"{cap_mb}MiB", "--max-sessions", str(sessions * 2))
    try:
        peak_at_load = srv.peak_rss()
        Path(f"/proc/{srv.proc.pid}/clear_refs").write_text("5")
        rss_ready = srv.peak_rss()
        long = [t for p in prompts for t in p]
        long = long * -(-tokens_per_session // len(long))  # repeated when the prompts are too short
        evicted = 0
        with httpx.Client(base_url=srv.url, timeout=600) as c:
            sids = []
            for i in range(sessions):
                ids = [i + 10, i + 11] + long[: tokens_per_session - 2]  # distinct from the first token: no reuse
                info = open_session(c, ids, max_new_tokens=64)
                sids.append(info["session_id"])
                run_rounds(c, info["session_id"], len(ids), 4, [ids[-1]] * 4)
            for sid in sids:
                evicted += c.get(f"/v1/spec/sessions/{sid}").status_code == 404
            metrics = c.get("/metrics").text
        peak = srv.peak_rss()
    finally:
        srv.close()
    kv_line = next((ln for ln in metrics.splitlines() if ln.startswith("agentspec:kv_cache_usage_perc")), "")
    bound = target_bytes + cap_mb * 1024**2
    res = {"sessions": sessions, "tokens_per_session": tokens_per_session, "kv_cap_bytes": cap_mb * 1024**2,
           "model_bytes": target_bytes, "peak_rss_at_load_bytes": peak_at_load, "rss_ready_bytes": rss_ready,
           "peak_rss_bytes": peak, "bound_bytes": bound, "peak_rss_over_bound": peak / bound,
           "peak_at_load_over_bound": max(peak, peak_at_load) / bound,
           "sessions_evicted": evicted, "kv_usage_metric": kv_line}
    if state_dict_bytes is not None:
        res["state_dict_bytes"] = state_dict_bytes
        res["peak_rss_over_state_dict_bound"] = peak / (state_dict_bytes + cap_mb * 1024**2)
    log(f"[{dtype}] (d) {sessions} sessions x {tokens_per_session} tokens, cap {cap_mb} MiB: serving peak RSS "
        f"{peak / 1024**2:.0f} MiB (ready {rss_ready / 1024**2:.0f} MiB, load peak {peak_at_load / 1024**2:.0f} MiB), "
        f"model {target_bytes / 1024**2:.0f} MiB resident, ratio {res['peak_rss_over_bound']:.3f} "
        f"(vs state-dict bytes {res.get('peak_rss_over_state_dict_bound', float('nan')):.3f}), {evicted} evicted")
    return res


def prefix_reuse(dtype: str, tokenizer: Any, prompt: common.Prompt, steps: int = 5) -> dict:
    """(e) a 5-step agent conversation; step 5's time to first token with and without prefix reuse."""
    srv = Verifier(dtype, "--api-key", "agent", "--api-key", "cold")
    try:
        msgs = [dict(m) for m in prompt.messages]
        convo: list[list[int]] = []
        for step in range(steps):
            ids = common.render(tokenizer, common.Prompt(prompt.id, prompt.category, tuple(msgs), prompt.tools))
            convo.append(ids)
            msgs += [{"role": "assistant", "content": f'{{"name": "step_{step}", "arguments": {{"i": {step}}}}}'},
                     {"role": "user", "content": f"Tool result {step}: ok, value {step * 17}. Continue."}]
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            def ttft(ids: list[int], key: str) -> tuple[float, int]:
                h = {"Authorization": f"Bearer {key}"}
                t0 = time.perf_counter()
                info = open_session(c, ids, headers=h, max_new_tokens=4)
                c.post(f"/v1/spec/sessions/{info['session_id']}/rounds", json={"base_len": len(ids)},
                       headers=h).raise_for_status()
                return time.perf_counter() - t0, info["reused_tokens"]

            ttft(convo[0][::-1][:50], "cold")  # warm-up, on tokens no step starts with
            warm = [ttft(ids, "agent") for ids in convo]  # steps 1..5, each reusing the previous one's KV
            cold = [ttft(convo[-1], "cold")]
            # make sure "cold" had nothing cached for this conversation: a different key's cache is invisible
    finally:
        srv.close()
    res = {"steps": steps, "prompt_tokens": [len(x) for x in convo], "ttft_with_reuse_s": [w[0] for w in warm],
           "reused_tokens": [w[1] for w in warm], "ttft_step5_without_reuse_s": cold[0][0],
           "reused_without": cold[0][1], "speedup": cold[0][0] / warm[-1][0]}
    log(f"[{dtype}] (e) step 5 ({len(convo[-1])} tokens): TTFT {warm[-1][0] * 1e3:.0f} ms with reuse "
        f"({warm[-1][1]} reused) vs {cold[0][0] * 1e3:.0f} ms without: x{res['speedup']:.2f}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16", help="the first one fills the top-level acceptance")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="benchmarks/results/server")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    q = args.quick
    prompts = common.bfcl_prompts(8)
    results: dict[str, Any] = {"meta": {"target": TARGET, "machine": common.machine_info(),
                                        "prompt_ids": [x.id for x in prompts], "greedy": True}, "runs": {}}
    for dtype in args.dtypes.split(","):
        target = models.load_model(TARGET, device="cpu", dtype=dtype)
        encoded = [common.render(target.tokenizer, x) for x in prompts]
        state_dict_bytes = sum(t.numel() * t.element_size() for t in target.model.state_dict().values())
        model_bytes = models.resident_weight_bytes(target.model)  # as loaded: the server packs the same way
        run: dict[str, Any] = {"model_bytes": model_bytes, "state_dict_bytes": state_dict_bytes}
        run["overhead"] = overhead(dtype, encoded[0], 5 if q else 30)
        run["throughput"] = throughput(dtype, encoded, 4 if q else 16, 4)
        run["capacity"] = capacity(dtype, target, encoded[:2 if q else 4], 4, 8, 16 if q else 48)
        # The server's default cap (2 GiB); 32 sessions long enough to need 1.35x the cap, so LRU eviction works.
        cap_mb, sessions = (64, 8) if q else (2048, 32)
        per_token = kv_bytes_per_token(target)
        tokens = min(-(-int(1.35 * cap_mb * 1024**2) // (sessions * per_token)), 8000)
        run["memory"] = memory(dtype, model_bytes, encoded, cap_mb, sessions, tokens, state_dict_bytes)
        run["prefix_reuse"] = prefix_reuse(dtype, target.tokenizer, prompts[5])
        results["runs"][dtype] = run
        del target
    first = results["runs"][args.dtypes.split(",")[0]]
    results["acceptance"] = {
        "dtype": args.dtypes.split(",")[0],
        "loopback_overhead_frac_k4": first["overhead"][4]["overhead_frac"],
        "batched_vs_serial_8": first["throughput"]["ratio"][8],
        "capacity_ratio_measured": first["capacity"]["measured"],
        "capacity_ratio_predicted": first["capacity"]["predicted"],
        "peak_rss_over_bound": first["memory"]["peak_rss_over_bound"],
        "prefix_reuse_ttft_speedup": first["prefix_reuse"]["speedup"],
        "by_dtype": {d: {"loopback_overhead_frac_k4": r["overhead"][4]["overhead_frac"],
                         "batched_vs_serial_8": r["throughput"]["ratio"][8],
                         "capacity_ratio_measured": r["capacity"]["measured"],
                         "capacity_ratio_predicted": r["capacity"]["predicted"],
                         "peak_rss_over_bound": r["memory"]["peak_rss_over_bound"],
                         "prefix_reuse_ttft_speedup": r["prefix_reuse"]["speedup"]}
                     for d, r in results["runs"].items()},
    }
    out = Path(args.out + ("_quick" if q else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1, default=str))
    Path(f"{out}.md").write_text(markdown(results))
    log("acceptance:", json.dumps(results["acceptance"]))
    return 0


def markdown(r: dict) -> str:
    lines = ["# agentspec-verifier benchmark", "",
             f"Target {r['meta']['target']} (offline GGUF alias), CPU, greedy; BFCL prompts "
             f"{', '.join(r['meta']['prompt_ids'])}. Servers are real `agentspec-verifier` processes on 127.0.0.1; "
             "the client is httpx over HTTP/1.1 keep-alive.", "", "## Acceptance", "", "```json",
             json.dumps(r["acceptance"], indent=1), "```", ""]
    for dtype, run in r["runs"].items():
        lines += [f"## {dtype}", "", "| k | round ms | verify ms | overhead ms | overhead / verify |", "|---|---|---|---|---|"]
        for k, v in run["overhead"].items():
            lines.append(f"| {k} | {v['wall_ms']:.1f} | {v['verify_ms']:.1f} | {v['overhead_ms']:.2f} | {v['overhead_frac']:.3f} |")
        lines += ["", "| sessions | batched rounds/s | serial rounds/s | ratio |", "|---|---|---|---|"]
        t = run["throughput"]
        for n in (1, 2, 4, 8):
            lines.append(f"| {n} | {t['batched'][n]['rounds_per_s']:.2f} | {t['serial'][n]['rounds_per_s']:.2f} | "
                         f"{t['ratio'][n]:.2f} |")
        c, m, e = run["capacity"], run["memory"], run["prefix_reuse"]
        lines += ["", f"Server compute per emitted token (γ={c['gamma']}, drafter = first {c['drafter_layers']} layers): "
                  f"edge {c['server_compute_per_token_edge_ms']:.2f} ms, server mode "
                  f"{c['server_compute_per_token_server_ms']:.2f} ms → ratio {c['measured']:.3f}; predicted "
                  f"1 + γ·t_ds/t_v = {c['predicted']:.3f} (t_ds {c['t_ds_ms']:.2f} ms, t_v {c['t_v_ms']:.2f} ms).", "",
                  f"Memory: {m['sessions']} sessions of {m['tokens_per_session']} tokens, cap "
                  f"{m['kv_cap_bytes'] / 1024**2:.0f} MiB: serving peak RSS {m['peak_rss_bytes'] / 1024**2:.0f} MiB "
                  f"(ready {m['rss_ready_bytes'] / 1024**2:.0f} MiB; load peak {m['peak_rss_at_load_bytes'] / 1024**2:.0f} MiB) "
                  f"vs model (resident weights, {m['model_bytes'] / 1024**2:.0f} MiB) + cap {m['bound_bytes'] / 1024**2:.0f} "
                  f"MiB → {m['peak_rss_over_bound']:.3f} (vs state-dict bytes "
                  f"{m.get('state_dict_bytes', m['model_bytes']) / 1024**2:.0f} MiB + cap: "
                  f"{m.get('peak_rss_over_state_dict_bound', m['peak_rss_over_bound']):.3f}); "
                  f"{m['sessions_evicted']} sessions evicted.", "",
                  f"Prefix reuse, 5-step conversation ({e['prompt_tokens']} tokens): step-5 TTFT "
                  f"{e['ttft_with_reuse_s'][-1] * 1e3:.0f} ms with reuse ({e['reused_tokens'][-1]} tokens reused) vs "
                  f"{e['ttft_step5_without_reuse_s'] * 1e3:.0f} ms without → x{e['speedup']:.2f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
