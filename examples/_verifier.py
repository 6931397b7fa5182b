"""Shared by the examples: start agentspec-verifier on 127.0.0.1, in-process (a thread) or as a subprocess.

Every example takes ``--model`` (default: the offline Qwen2.5-Coder-0.5B-Instruct, shipped inside PyPI
packages) and ``--tiny`` (a tiny random-weight model from ``tests/helpers.py``: it checks the plumbing in
seconds on a busy CPU, but its answers are gibberish and it never calls a tool).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REAL_MODEL = "qwen2.5-coder-0.5b-instruct"
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the repo's own tools: tests/helpers.py (tiny models), benchmarks/delay_proxy.py
    sys.path.insert(0, str(REPO))


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--tiny`` for an example's command line."""
    parser.add_argument("--model", default=REAL_MODEL, help="offline alias, .gguf file or local directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="float32 is exact; bfloat16 is faster on CPUs with bf16 support")
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random-weight model instead (seconds; gibberish answers, no tool calls)")


def load_target(args: argparse.Namespace) -> Any:
    """The target model (``agentspec.models.LoadedModel``) the example's verifier serves."""
    import torch

    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    if args.tiny:
        from tests.helpers import tiny_model

        return tiny_model(seed=0)
    from agentspec.models import load_model

    print(f"loading {args.model} ({args.dtype}); the first run assembles the GGUF file from its packages ...",
          file=sys.stderr)
    return load_model(args.model, device="cpu", dtype=args.dtype)


def served_name(args: argparse.Namespace) -> str:
    return "tiny" if args.tiny else args.model


@contextlib.contextmanager
def in_process_verifier(target: Any, name: str, api_key: str | None = None) -> Iterator[str]:
    """Serve ``target`` on a free loopback port from a background thread; yields the base URL."""
    from agentspec.verifier_server.config import ServerConfig
    from agentspec.verifier_server.local import LocalVerifier

    config = ServerConfig(served_model_name=name, api_keys=(api_key,) if api_key else ())
    with LocalVerifier(target, config) as verifier:  # no draft model: n-gram drafting
        yield verifier.url


@contextlib.contextmanager
def verifier_subprocess(args: argparse.Namespace, api_key: str, ready_timeout_s: float = 600.0) -> Iterator[str]:
    """Run ``python -m agentspec.verifier_server MODEL --port P --api-key KEY``; yields the base URL once
    ``/health`` answers 200 (it answers 503 while the model loads)."""
    with contextlib.ExitStack() as stack:
        model = args.model
        if args.tiny:  # the CLI loads local directories: save the tiny model into one
            target = load_target(args)
            model = stack.enter_context(tempfile.TemporaryDirectory(prefix="agentspec-tiny-"))
            target.model.save_pretrained(model)
            target.tokenizer.save_pretrained(model)
        port = _free_port()
        cmd = [sys.executable, "-m", "agentspec.verifier_server", model, "--port", str(port), "--api-key", api_key,
               "--served-model-name", served_name(args), "--dtype", args.dtype, "--device", "cpu",
               "--log-level", "warning"]
        print("$", " ".join(cmd[1:]), file=sys.stderr)
        proc = subprocess.Popen(cmd)
        stack.callback(_stop, proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"agentspec-verifier exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"agentspec-verifier not ready after {ready_timeout_s} s")
            time.sleep(0.5)
        yield url


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
