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
import threading
import time
from dataclasses import dataclass, replace

from agentspec.cli import version
from agentspec.verifier_server.config import ServerConfig, add_config_flags, config_from_flags, env

log = logging.getLogger("agentspec.verifier")


def build_parser() -> argparse.ArgumentParser:
    """The flags: the model and how to load it, where to listen, then one flag per :class:`ServerConfig`
    knob (generated from its fields, so the defaults live in one place)."""
    from agentspec.models.loading import DTYPES  # (imports torch)
    p = argparse.ArgumentParser(prog="agentspec-verifier",
                                description="Serve a target model for lossless speculative verification.")
    p.add_argument("model", nargs="?", default=env("model", None),
                   help="hub id (offline unless --allow-download), local directory, .gguf file or offline alias "
                        "(smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--draft-model", default=env("draft_model", None),
                   help="server-side drafter for server mode (same tokenizer); default: n-gram drafting")
    p.add_argument("--draft-quantize", default=env("draft_quantize", None), choices=["int8", "int4"],
                   help="weight-only quantised linears for --draft-model on the CPU: a quarter (int4) or half "
                        "(int8) of the bytes per drafting step; output stays the target's (it verifies every draft)")
    p.add_argument("--host", default=env("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("port", 8000)))
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; env AGENTSPEC_API_KEY, "
                        "comma-separated). A key on the command line shows in the process list: prefer "
                        "--api-key-file or the env var")
    p.add_argument("--api-key-file", default=env("api_key_file", None),
                   help="a file with one API key per line (blank lines and # comments skipped)")
    p.add_argument("--served-model-name", nargs="+", default=env("served_model_name", None),
                   help="the name(s) requests use for this target; the first is reported, the others are aliases")
    p.add_argument("--dtype", default=env("dtype", "auto"), choices=["auto", *DTYPES])
    p.add_argument("--device", default=env("device", "auto"), choices=["auto", "cuda", "mps", "cpu"])
    add_config_flags(p)
    p.add_argument("--allow-download", action="store_true", help="let hub ids download (off by default)")
    p.add_argument("--log-level", default=env("log_level", "info"))
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return p


@dataclass(frozen=True)
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
    draft_quantize: str | None = None


def parse_args(argv: list[str] | None = None) -> Args:
    """The command line (and ``AGENTSPEC_*`` environment) as :class:`Args`."""
    parser = build_parser()
    a = parser.parse_args(argv)
    model = a.model_flag or a.model
    if not model:
        parser.error("MODEL is required (positional, --model or AGENTSPEC_MODEL)")
    if a.draft_quantize and not a.draft_model:
        parser.error("--draft-quantize quantises the --draft-model: pass one, or drop --draft-quantize")
    if a.draft_quantize and a.device not in ("cpu", "auto"):
        parser.error(f"--draft-quantize runs on the CPU only; drop it for --device {a.device}")
    keys = a.api_key or [k.strip() for k in str(env("api_key", "")).split(",") if k.strip()]
    if a.api_key_file:
        try:
            with open(a.api_key_file) as f:
                keys += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
        except OSError as e:
            parser.error(f"--api-key-file {a.api_key_file}: {e.strerror}")
        if not keys:
            parser.error(f"--api-key-file {a.api_key_file} holds no key")
    names = a.served_model_name.split() if isinstance(a.served_model_name, str) else list(a.served_model_name or [])
    config = config_from_flags(a, served_model_name=names[0] if names else model, model_aliases=tuple(names[1:]),
                               api_keys=tuple(keys))
    return Args(model, a.draft_model, a.host, a.port, config, a.dtype, a.device, a.allow_download, a.log_level,
                a.draft_quantize)


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
                                      allow_download=args.allow_download, quantize=args.draft_quantize)
        return target, draft

    log.info("loading model %s (dtype %s, device %s)%s", args.model, args.dtype, args.device,
             f" with drafter {args.draft_model}" if args.draft_model else "")
    t0 = time.perf_counter()
    target, draft = models.on_thread(thread, load)
    t1 = time.perf_counter()
    engine = VerifierEngine(target, args.config, draft_model=draft, metrics=Metrics(args.config.served_model_name),
                            executor=thread)
    engine.warm_up()
    params = sum(p.numel() for p in target.model.parameters())
    log.info("loading model %s took %.1f s: %.3gM parameters, dtype %s, device %s (warm-up %.1f s)",
             args.model, t1 - t0, params / 1e6, str(target.dtype).removeprefix("torch."), target.device,
             time.perf_counter() - t1)
    # The loaded model is hundreds of thousands of Python objects that live as long as the server. Left in
    # the collected generations, every full collection walks them all (a 210-275 ms pause every 12-36
    # requests with SmolLM2-135M, measured), stalling whatever request is running; frozen, they are skipped.
    gc.collect()
    gc.freeze()
    return engine


def main(argv: list[str] | None = None) -> int:
    """Bind the port, then serve while the model loads (``/health`` answers 503 until it is ready)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agentspec.verifier_server.http import listen

    if (fits := raise_fd_limit(args.config.max_connections)) < args.config.max_connections:
        args = replace(args, config=replace(args.config, max_connections=fits))
    try:  # listen before the model loads: a taken port fails at once, naming it
        sock = listen(args.host, args.port, args.config.max_connections)
    except OSError as e:
        raise SystemExit(f"agentspec-verifier: cannot bind {args.host}:{args.port}: {e.strerror}") from None
    if not args.config.api_keys:
        log.warning("no API key set: anyone who can reach %s:%d can use this verifier and its sessions; "
                    "set --api-key-file or AGENTSPEC_API_KEY", args.host, args.port)
    logging.getLogger("asyncio").addFilter(RepeatFilter())
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
    config = uvicorn.Config(lazy, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            lifespan="off", **args.config.uvicorn_options())
    uvicorn.Server(config).run(sockets=[sock])  # serves on the socket bound above
    return 0


# descriptors kept beyond the connection cap: the server's own (model files, logs, pipes, the event loop) and
# the one connection http.CappedListener is refusing
FD_RESERVE = 128


def raise_fd_limit(connections: int) -> int:
    """Raise the soft open-file limit to the hard one: each connection holds a descriptor, and running out
    makes the accept loop fail on every new connection, a client that connects then waits for nothing.
    Returns the connection cap that fits the limit: ``connections``, or fewer (with a warning)."""
    try:
        import resource
    except ImportError:  # not on this platform (Windows)
        return connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= connections + FD_RESERVE:
        return connections
    fits = max(1, soft - FD_RESERVE)
    log.warning("the open-file limit (%d) cannot hold --max-connections %d plus the server's own files: "
                "serving at most %d connections; raise it (ulimit -n) to serve more", soft, connections, fits)
    return fits


class RepeatFilter(logging.Filter):
    """Let one record of a repeated message through per ``window_s`` (the accept loop logs every failed
    accept: without this, fd exhaustion floods the log with thousands of identical lines a second)."""

    def __init__(self, window_s: float = 10.0) -> None:
        super().__init__()
        self.window_s, self.last = window_s, {}
        self.dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = f"{record.name}:{record.msg}", time.monotonic()
        if now - self.last.get(key, -math.inf) < self.window_s:
            self.dropped[key] = self.dropped.get(key, 0) + 1
            return False
        if n := self.dropped.pop(key, 0):
            record.msg = f"{record.msg} (and {n} more like it in the last {self.window_s:.0f} s)"
        self.last[key] = now
        return True


if __name__ == "__main__":
    raise SystemExit(main())
