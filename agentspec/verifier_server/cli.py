"""``agentspec-verifier MODEL [options]``: serve a target model for speculative verification.

Every flag has an environment fallback (``AGENTSPEC_<FLAG>``, e.g. ``AGENTSPEC_API_KEY``, comma-separated
for several keys). The server binds 127.0.0.1 unless ``--host`` says otherwise; ``/health`` answers 503
until the model is loaded and warmed up.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import re
import threading
from dataclasses import dataclass

from agentspec.verifier_server.engine import ServerConfig

log = logging.getLogger("agentspec.verifier")


def parse_bytes(text: str) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1.5g"``, ``"1000000"`` → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 2GB, 512MiB or a byte count")
    scale = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}[m.group(2)]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be > 0")
    return value


def _positive(kind: type) -> object:
    def convert(text: str) -> object:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return convert


def _env(name: str, default: object) -> object:
    return os.environ.get(f"AGENTSPEC_{name.upper().replace('-', '_')}", default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentspec-verifier",
                                description="Serve a target model for lossless speculative verification.")
    p.add_argument("model", nargs="?", default=_env("model", None),
                   help="hub id (offline unless --allow-download), local directory, .gguf file or offline alias "
                        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--draft-model", default=_env("draft_model", None),
                   help="server-side drafter for server mode (same tokenizer); default: n-gram drafting")
    p.add_argument("--host", default=_env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("port", 8000)))
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; env AGENTSPEC_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=_env("served_model_name", None),
                   help="the name(s) requests use for this target; the first is reported, the others are aliases")
    p.add_argument("--dtype", default=_env("dtype", "auto"), choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default=_env("device", "auto"), choices=["auto", "cuda", "mps", "cpu"])
    p.add_argument("--max-sessions", type=_positive(int), default=int(_env("max_sessions", 64)))
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes(str(_env("kv_cache_memory", "2GiB"))),
                   help="cap on KV-cache bytes over all sessions (LRU eviction beyond it), e.g. 2GiB")
    p.add_argument("--max-model-len", type=_positive(int), default=int(_env("max_model_len", 8192)))
    p.add_argument("--max-draft-tokens", type=_positive(int), default=int(_env("max_draft_tokens", 16)))
    p.add_argument("--max-batch-size", type=_positive(int), default=int(_env("max_batch_size", 8)))
    p.add_argument("--batch-window-ms", type=float, default=float(_env("batch_window_ms", 2.0)))
    p.add_argument("--prefill-chunk-tokens", type=_positive(int), default=int(_env("prefill_chunk_tokens", 512)),
                   help="prefill long prompts in chunks of this many tokens (bounds activation memory)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=parse_bytes(str(_env("max_body_bytes", "4MiB"))))
    p.add_argument("--request-timeout", type=_positive(float), default=float(_env("request_timeout", 600.0)),
                   help="seconds before a request is answered 504")
    p.add_argument("--keep-alive", type=_positive(float), default=float(_env("keep_alive", 75.0)),
                   help="seconds an idle HTTP connection stays open (default 75: longer than clients keep theirs)")
    p.add_argument("--allow-download", action="store_true", help="let hub ids download (off by default)")
    p.add_argument("--log-level", default=_env("log_level", "info"))
    return p


@dataclass
class Args:
    model: str
    draft_model: str | None
    host: str
    port: int
    config: ServerConfig
    dtype: str
    device: str
    allow_download: bool
    log_level: str


def parse_args(argv: list[str] | None = None) -> Args:
    parser = build_parser()
    a = parser.parse_args(argv)
    model = a.model_flag or a.model
    if not model:
        parser.error("MODEL is required (positional, --model or AGENTSPEC_MODEL)")
    keys = a.api_key or [k for k in str(_env("api_key", "")).split(",") if k]
    names = a.served_model_name.split() if isinstance(a.served_model_name, str) else list(a.served_model_name or [])
    config = ServerConfig(served_model_name=names[0] if names else model, model_aliases=tuple(names[1:]),
                          max_sessions=a.max_sessions,
                          kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len,
                          max_draft_tokens=a.max_draft_tokens, max_batch_size=a.max_batch_size,
                          batch_window_s=max(a.batch_window_ms, 0.0) / 1e3, api_keys=tuple(keys),
                          max_body_bytes=a.max_body_bytes, request_timeout_s=a.request_timeout,
                          prefill_chunk_tokens=a.prefill_chunk_tokens, keep_alive_s=a.keep_alive)
    return Args(model, a.draft_model, a.host, a.port, config, a.dtype, a.device, a.allow_download, a.log_level)


def build_engine(args: Args, load_now: bool = True):  # -> VerifierEngine
    """Load the target (and drafter), warm up, and return a ready engine."""
    from agentspec import models
    from agentspec.verifier_server.engine import VerifierEngine
    from agentspec.verifier_server.metrics import Metrics

    thread = models.model_thread()  # load, warm up and serve on one thread (see model_thread)

    def load() -> tuple[models.LoadedModel, models.LoadedModel | None]:
        target = models.load_model(args.model, device=args.device, dtype=args.dtype, allow_download=args.allow_download)
        draft = None
        if args.draft_model:
            draft = models.load_model(args.draft_model, device=target.device, dtype=target.dtype,
                                      allow_download=args.allow_download)
        return target, draft

    target, draft = models.on_thread(thread, load)
    engine = VerifierEngine(target, args.config, draft_model=draft, metrics=Metrics(args.config.served_model_name),
                            executor=thread)
    engine.warm_up()
    # The loaded model is hundreds of thousands of Python objects that live as long as the server. Left in
    # the collected generations, every full collection walks them all (a 210-275 ms pause every 12-36
    # requests with SmolLM2-135M, measured), stalling whatever request is running; frozen, they are skipped.
    gc.collect()
    gc.freeze()
    return engine


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from agentspec.verifier_server.app import create_app
    from agentspec.verifier_server.lazy import LazyApp

    lazy = LazyApp(args.config)  # /health answers 503 while the model loads

    def load() -> None:
        try:
            engine = build_engine(args)
        except Exception as e:
            log.error("could not load %s: %s", args.model, e)
            os._exit(1)
        lazy.set(create_app(engine))
        log.info("ready: %s on http://%s:%d", args.config.served_model_name, args.host, args.port)

    threading.Thread(target=load, daemon=True).start()
    uvicorn.run(lazy, host=args.host, port=args.port, log_level=args.log_level.lower(), lifespan="off",
                timeout_keep_alive=int(math.ceil(args.config.keep_alive_s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
