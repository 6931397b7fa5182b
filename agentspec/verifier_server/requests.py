"""The OpenAI-compatible request bodies: ``/v1/chat/completions`` and the legacy ``/v1/completions``.

Both share the sampling fields (OpenAI's plus vLLM's ``top_k``); any field a request names that agentspec
does not implement is a 400 naming it, never accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentspec.protocol import Sampling
from agentspec.toolcalls import check_structure, flatten_content


class SamplingRequest(BaseModel):
    """Fields both OpenAI endpoints share; subclasses add the prompt and their own ``logprobs`` form."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    top_k: int | None = Field(None, ge=-1)  # vLLM's extension; -1 and 0 disable it
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = 1  # only 1: checked in _unsupported, with a message that says so
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # these label or file a request away; they do not change the answer, so there is nothing to honour
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                them = "them" if len(unknown) > 1 else "it"
                raise ValueError(f"unsupported parameter(s) {', '.join(map(repr, unknown))}: agentspec-verifier "
                                 f"does not implement {them}; leave {them} out")
            if data.get("n") not in (None, 1):
                raise ValueError("n: only n=1 is supported (one choice per request)")
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isdigit() or not -100.0 <= b <= 100.0:
                raise ValueError('logit_bias maps token ids (as strings, e.g. {"1234": -100}) to biases in '
                                 "[-100, 100]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def num_logprobs(self) -> int | None:
        """How many top alternatives per token to return, or None for no logprobs at all."""
        return None

    def sampling(self) -> Sampling:
        """The round sampling settings this request asks for."""
        return Sampling(temperature=self.temperature or 0.0, top_p=self.top_p or 1.0, seed=self.seed,
                        top_k=max(self.top_k or 0, 0), presence_penalty=self.presence_penalty or 0.0,
                        frequency_penalty=self.frequency_penalty or 0.0,
                        logit_bias=self.logit_bias or None,
                        logprobs=self.num_logprobs)


class ChatRequest(SamplingRequest):
    """The OpenAI chat-completions request agentspec honours; any other field is a 400 naming it."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    parallel_tool_calls: bool | None = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] needs a string 'role'")
            if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{i}].role {m['role']!r} is not one of system, developer, user, "
                                 "assistant, tool")
            if not isinstance(m.get("content"), str | list | None):
                raise ValueError(f"messages[{i}].content must be a string, a list of content parts or null")
        return flatten_content(v)

    @model_validator(mode="after")
    def _choice(self) -> ChatRequest:
        check_structure(self.tools, self.tool_choice, self.response_format)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class CompletionRequest(SamplingRequest):
    """The legacy ``/v1/completions`` request: one ``prompt``, a string or token ids (a one-item batch of
    either is accepted too); ``logprobs`` is the number of top alternatives per token (0–5), ``echo`` puts
    the prompt's text before the completion."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # the legacy API's default
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    return_token_ids: bool = False  # vLLM's extension: the completion's token ids in each choice
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(f"prompt: one prompt per request (got a batch of {len(v)}); send them one "
                                 "by one")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("prompt token ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _echo(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix (insertion, fill-in-the-middle) is not implemented; leave it out")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs would need the prompt's logprobs, which are not returned; "
                             "ask for one of them")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
