"""litellm's call arguments → one validated :class:`Request` for :class:`agentspec.client.SpecClient`.

Pure: no litellm import, no I/O. Messages become plain JSON dicts, ``tool_choice`` is applied here, and
what agentspec cannot honour raises :class:`UnsupportedRequest` (the provider's ``BadRequestError``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

from agentspec.toolcalls import (
    add_instruction,
    check_structure,
    flatten_content,
    response_format_instruction,
    tool_choice_instruction,
)
from agentspec.transport import verifier_base
from agentspec.types import SamplingParams

DEFAULT_API_BASE = "http://127.0.0.1:8000"
DEFAULT_MAX_TOKENS = 256
DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_SEGMENT_TOKENS = 16
# Accepted with nothing to do: handled by litellm itself (streaming, retries, headers) or bookkeeping that
# does not change what the verifier generates; n is checked to be 1.
_IGNORED = frozenset({"stream", "stream_options", "user", "metadata", "extra_headers", "max_retries", "n"})
# agentspec's own knobs, via optional_params; vllm_base_url: a vLLM deployment of the target (the vllm mode)
_EXTRAS = ("mode", "num_draft_tokens", "segment_tokens", "vllm_base_url")


class UnsupportedRequest(ValueError):
    """A litellm argument agentspec cannot honour (the message says what to change)."""


@dataclass(frozen=True)
class Request:
    """One chat call, validated: everything :class:`SpecClient` needs."""

    model: str
    urls: tuple[str, ...]
    api_key: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    timeout_s: float | None
    mode: str | None
    num_draft_tokens: int
    segment_tokens: int
    single_call: bool = False  # parallel_tool_calls=False: the answer keeps its first tool call only
    tool_choice: str | dict[str, Any] | None = None  # required / named: enforced by the verifier's grammar
    response_format: dict[str, Any] | None = None  # json_object / json_schema: enforced likewise
    vllm_base_url: str | None = None

    @property
    def client_key(self) -> tuple[Any, ...]:
        return (self.urls, self.api_key, self.timeout_s, self.num_draft_tokens, self.segment_tokens,
                self.vllm_base_url)


def parse_request(model: str, messages: list[Any], api_base: str | None, api_key: str | None,
                  optional_params: dict[str, Any], timeout: Any, drop_params: bool = False) -> Request:
    """Validate litellm's arguments; raises :class:`UnsupportedRequest` for what agentspec cannot honour.

    A parameter agentspec does not support is an error naming it, unless the caller asked litellm to drop
    such parameters (``drop_params=True``, per call or ``litellm.drop_params``): then it is dropped.
    """
    params = dict(optional_params or {})
    bad = UnsupportedRequest
    if int(params.get("n") or 1) != 1:
        raise bad("agentspec generates one choice per request (n=1)")
    rf = _response_format(params.pop("response_format", None))
    base = api_base or os.environ.get("AGENTSPEC_API_BASE") or DEFAULT_API_BASE
    urls = tuple(verifier_base(u) for u in base.split(",") if u.strip())
    tools = params.pop("tools", None) or None
    try:
        messages = flatten_content([_plain(m) for m in messages])  # before any instruction is added
    except ValueError as e:
        raise bad(str(e)) from e
    single = params.pop("parallel_tool_calls", None) is False and bool(tools)
    choice = params.pop("tool_choice", None)
    try:
        check_structure(tools, choice, rf)
    except ValueError as e:
        raise bad(str(e)) from e
    tools, messages = _apply_tool_choice(choice, tools, messages, single)
    if rf is not None:
        messages = add_instruction(messages, response_format_instruction(rf) or "")
    stop = params.pop("stop", None) or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    limits = [params.pop(k, None) for k in ("max_completion_tokens", "max_tokens")]
    max_tokens = next((v for v in limits if v is not None), DEFAULT_MAX_TOKENS)
    try:
        logprobs, top = params.pop("logprobs", None), params.pop("top_logprobs", None)
        if top is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        sampling = SamplingParams(temperature=float(params.pop("temperature", None) or 0.0),
                                  top_p=float(params.pop("top_p", None) or 1.0),
                                  top_k=int(params.pop("top_k", None) or 0), seed=params.pop("seed", None),
                                  presence_penalty=float(params.pop("presence_penalty", None) or 0.0),
                                  frequency_penalty=float(params.pop("frequency_penalty", None) or 0.0),
                                  logit_bias=tuple(sorted((int(k), float(v)) for k, v in
                                                          (params.pop("logit_bias", None) or {}).items())),
                                  logprobs=int(top or 0) if logprobs else None)
    except ValueError as e:
        raise bad(str(e)) from e
    extras = {k: params.pop(k) for k in _EXTRAS if params.get(k) is not None}
    mode = extras.get("mode")
    if mode not in (None, "auto", "server", "server-ar", "vllm"):
        raise bad(f"mode must be auto, server, server-ar or vllm, got {mode!r} (edge mode needs a local "
                  "drafter, api mode a fallback model; through litellm, drafting happens on the verifier)")
    vllm = extras.get("vllm_base_url")
    if vllm is not None and (not isinstance(vllm, str) or not vllm.startswith(("http://", "https://"))):
        raise bad(f"vllm_base_url must be an http(s) URL, got {vllm!r}")
    if mode == "vllm" and vllm is None:
        raise bad("mode='vllm' needs vllm_base_url (a vLLM deployment of the same target)")
    if int(max_tokens) < 1:
        raise bad(f"max_tokens must be >= 1, got {max_tokens}")
    unknown = sorted(k for k in params if k not in _IGNORED and params[k] is not None)
    if unknown and not drop_params:
        raise bad(f"the agentspec provider does not support {', '.join(map(repr, unknown))}; leave "
                  f"{'them' if len(unknown) > 1 else 'it'} out, or pass drop_params=True to drop unsupported "
                  "parameters")
    return Request(model=model, urls=urls, api_key=api_key or os.environ.get("AGENTSPEC_API_KEY"),
                   messages=messages, tools=tools, max_tokens=int(max_tokens), sampling=sampling, stop=stop,
                   timeout_s=_seconds(timeout), mode=mode, num_draft_tokens=int(extras.get("num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)),
                   segment_tokens=int(extras.get("segment_tokens", DEFAULT_SEGMENT_TOKENS)), single_call=single,
                   tool_choice=choice if tools and choice not in (None, "auto", "none") else None,
                   response_format=rf, vllm_base_url=vllm)


def _response_format(rf: Any) -> dict[str, Any] | None:
    """litellm's ``response_format`` as an OpenAI dict (a Pydantic class becomes its JSON schema); None for
    text."""
    if isinstance(rf, type) and hasattr(rf, "model_json_schema"):
        rf = {"type": "json_schema", "json_schema": {"name": rf.__name__, "schema": rf.model_json_schema()}}
    if rf is None or (isinstance(rf, dict) and rf.get("type") in (None, "text")):
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        raise UnsupportedRequest(f"response_format must be text, json_object or json_schema, got {rf!r}")
    return rf


def _apply_tool_choice(choice: Any, tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]],
                       single: bool = False) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """``none`` hides the tools; ``required``/named add a hint (the verifier's grammar enforces them), as
    does ``single`` (``parallel_tool_calls=False``)."""
    if choice in (None, "auto") or not tools:
        if choice not in (None, "auto", "none"):
            raise UnsupportedRequest(f"tool_choice {choice!r} needs tools")
        hint = tool_choice_instruction(choice, single) if tools else None
        return tools, add_instruction(messages, hint) if hint else messages
    if choice == "none":
        return None, messages
    if choice == "required":
        return tools, add_instruction(messages, tool_choice_instruction("required", single))
    name = ((choice.get("function") or {}).get("name") if isinstance(choice, dict) else None)
    named = [t for t in tools if (t.get("function") or {}).get("name") == name]
    if not named:
        raise UnsupportedRequest(f"tool_choice must be 'none', 'auto', 'required' or name one of the tools, got {choice!r}")
    return named, add_instruction(messages, tool_choice_instruction({"function": {"name": name}}, single))


def _plain(message: Any) -> dict[str, Any]:
    """A JSON-ready message dict (litellm/pydantic ``Message`` objects are accepted, ``None`` fields dropped)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    out = {k: v for k, v in dict(message).items() if v is not None and k != "provider_specific_fields"}
    if out.get("role") == "assistant" and "content" not in out:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [_plain(c) for c in out["tool_calls"]]
    return out


def _seconds(timeout: Any) -> float | None:
    """litellm's ``timeout`` (seconds, a string, an ``httpx.Timeout`` or ``None``) as seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, httpx.Timeout):
        values = [v for v in (timeout.read, timeout.connect, timeout.write, timeout.pool) if v is not None]
        return max(values) if values else None
    return float(timeout)
