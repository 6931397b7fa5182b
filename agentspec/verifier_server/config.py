"""The verifier's limits and knobs: one frozen :class:`ServerConfig`, the single source of their defaults;
the CLI's flags (env fallback ``AGENTSPEC_<FLAG>``) are generated from its fields and parsed back."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any


def parse_bytes(text: str) -> int:
    """``"2GB"``, ``"512MiB"``, ``"1.5g"``, ``"1000000"`` → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 2GB, 512MiB or a byte count")
    value = int(float(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}[m.group(2)])
    if value <= 0:
        raise argparse.ArgumentTypeError("size must be > 0")
    return value


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, which must be > 0."""
    def convert(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return convert


def env(flag: str, default: Any) -> Any:
    """``AGENTSPEC_<FLAG>`` from the environment, else ``default``."""
    return os.environ.get(f"AGENTSPEC_{flag.upper().replace('-', '_')}", default)


POSITIVE_INT = positive(int)


def boolean(text: str) -> bool:
    """An argparse type: on/off, true/false, yes/no, 1/0."""
    value = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False,
             "0": False}.get(str(text).strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"must be on or off, got {text}")
    return value


def _flag(help: str, type: Callable[[str], Any] = POSITIVE_INT, name: str | None = None, scale: float = 1.0
          ) -> dict[str, Any]:
    """CLI metadata of a field: help, parser, flag name if not the field's, flag-to-field unit factor."""
    return {"help": help, "type": type, "name": name, "scale": scale}


ACCEPT_BATCH = 64  # the listen backlog, and so the most connections accepted in one go


@dataclass(frozen=True)
class ServerConfig:
    """Limits and knobs of one verifier (the CLI's flags; the fields with metadata are generated as flags)."""

    served_model_name: str = "agentspec"
    model_aliases: tuple[str, ...] = ()  # more names requests may use for the same target (vLLM-style)
    api_keys: tuple[str, ...] = ()
    max_sessions: int = field(default=64, metadata=_flag("most open sessions (LRU eviction beyond it)"))
    kv_cache_memory: int = field(default=2 * 1024**3, metadata=_flag(
        "cap on KV-cache bytes over all sessions (LRU eviction beyond it), e.g. 2GiB", parse_bytes))
    max_model_len: int = field(default=8192, metadata=_flag("most tokens in one session (prompt + output)"))
    max_draft_tokens: int = field(default=16, metadata=_flag("most draft tokens one round may carry"))
    max_batch_size: int = field(default=8, metadata=_flag("most sessions verified in one batched pass"))
    batch_window_s: float = field(default=0.002, metadata=_flag(
        "least time a batch waits for other active sessions' rounds, in ms", float, "batch-window-ms", 1e-3))
    default_num_draft_tokens: int = field(default=6, metadata=_flag(
        "server mode's most draft tokens per round when a request does not say", name="num-draft-tokens"))
    max_body_bytes: int = field(default=4 * 1024**2, metadata=_flag("largest request body, e.g. 4MiB", parse_bytes))
    prefill_chunk_tokens: int = field(default=512, metadata=_flag(
        "prefill long prompts in chunks of this many tokens (bounds activation memory)"))
    request_timeout_s: float = field(default=600.0, metadata=_flag(
        "seconds before a request is answered 504", positive(float), "request-timeout"))
    # idle HTTP keep-alive: longer than the client's (agentspec.transport.KEEPALIVE_EXPIRY_S, 60 s), so
    # the server never closes a connection the client is about to reuse (uvicorn's own default is 5 s)
    keep_alive_s: float = field(default=75.0, metadata=_flag(
        "seconds an idle HTTP connection stays open (longer than clients keep theirs)", positive(float),
        "keep-alive"))
    max_connections: int = field(default=1024, metadata=_flag(
        "most concurrent HTTP connections; beyond it new requests get a 503 (the fd limit is raised to fit)"))
    header_timeout_s: float = field(default=10.0, metadata=_flag(
        "seconds a new request's headers may take to arrive before a 408 (slow or silent clients)",
        positive(float), "header-timeout"))
    body_timeout_s: float = field(default=30.0, metadata=_flag(
        "seconds a request body may take to arrive before a 408", positive(float), "body-timeout"))
    jump_forward: bool = field(default=True, metadata=_flag(
        "constrained answers take the tokens their grammar alone decides without a target pass (on/off)",
        boolean))
    log_stats_interval_s: float = field(default=10.0, metadata=_flag(
        "seconds between stats lines in the log (throughput, requests, KV use, acceptance); 0 disables", float,
        "log-stats-interval"))

    def uvicorn_options(self) -> dict[str, Any]:
        """The HTTP server's settings these limits imply (the CLI and :class:`LocalVerifier` share them)."""
        from agentspec.verifier_server.http import header_deadline_protocol

        # backlog: also how many connections one wake-up of the accept loop takes (http.CappedListener
        # refuses those beyond the cap inside accept, so a batch holds no descriptor beyond it)
        return {"timeout_keep_alive": int(math.ceil(self.keep_alive_s)), "limit_concurrency": self.max_connections,
                "http": header_deadline_protocol(self.header_timeout_s), "backlog": ACCEPT_BATCH}

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name this verifier answers to: the served model name first, then its aliases."""
        return (self.served_model_name, *self.model_aliases)


def _cli_fields() -> list[tuple[Any, str, dict[str, Any]]]:
    return [(f, f.metadata["name"] or f.name.replace("_", "-"), f.metadata) for f in fields(ServerConfig)
            if f.metadata]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`ServerConfig` field with CLI metadata (default: its env var, else the field)."""
    for f, flag, meta in _cli_fields():
        shown = f.default / meta["scale"]
        shown = int(shown) if float(shown).is_integer() else shown
        var = flag.upper().replace("-", "_")
        parser.add_argument(f"--{flag}", dest=f.name, type=meta["type"], default=str(env(flag, shown)), metavar=var,
                            help=f"{meta['help']} (default {shown}; env AGENTSPEC_{var})")


def config_from_flags(ns: argparse.Namespace, **rest: Any) -> ServerConfig:
    """The config the parsed flags describe (``rest``: the fields without flags of their own)."""
    values = {f.name: getattr(ns, f.name) * meta["scale"] if meta["scale"] != 1.0 else getattr(ns, f.name)
              for f, _, meta in _cli_fields()}
    values["batch_window_s"] = max(values["batch_window_s"], 0.0)
    return ServerConfig(**values, **rest)
