"""``ChatAgentSpec``: a LangChain chat model that runs each call through :class:`~agentspec.client.SpecClient`.

Streaming is the primitive (``_generate``/``_agenerate`` aggregate it); async uses ``SpecClient.astream``.
The SpecClient is built on first use, so constructing the model connects nowhere. Only verified tokens
reach LangChain (committed text, each tool call once, complete); failures are ``langchain_core.exceptions``.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput, ModelProfile
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    LangSmithParams,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import get_pydantic_field_names, secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.utils.utils import _build_model_kwargs  # what ChatOpenAI uses for the same purpose
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from agentspec.adapters.langchain_errors import map_error
from agentspec.adapters.langchain_io import (
    ToolChoice,
    event_chunk,
    final_chunk,
    parse_tool_choice,
    response_format_instruction,
    to_chat_messages,
)
from agentspec.client import Deployment, FinalEvent, SpecClient
from agentspec.client.api import check_api_kwargs
from agentspec.router import ModeConfig, ModePolicy
from agentspec.toolcalls import add_instruction
from agentspec.types import SamplingParams

# the sampling settings a call may override (their fields below are the defaults)
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logit_bias",
             "logprobs", "top_logprobs")
_CALL_KWARGS = {"tools", "tool_choice", "parallel_tool_calls", "response_format", "model", *_SAMPLING,
                "max_tokens", "mode", "stream", "ls_structured_output_format"}


class ChatAgentSpec(BaseChatModel):
    """A LangChain chat model served by agentspec-verifier(s), with speculative decoding and fallback.

    ``base_url``: one verifier or several serving target ``model`` (failover in order); ``fallback_model``: a
    litellm model id used when none is reachable; ``vllm_base_url``: a vLLM deployment of the same target (the
    ``vllm`` mode). ``mode`` pins a decoding mode or lets the router choose;
    ``edge`` needs a local ``drafter`` sharing the target's tokenizer. Greedy output is the target's own.
    """

    model_config = ConfigDict(populate_by_name=True)

    model_name: str = Field(default="agentspec", alias="model")
    """A name the verifier serves (sent with every request; unset: the verifier's own); reported as
    ``response_metadata["model_name"]``."""
    base_url: str | list[str] | None = None
    api_key: SecretStr | None = Field(default_factory=secret_from_env("AGENTSPEC_API_KEY", default=None))
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    """Token ids of the target's vocabulary → added to their logits (applied in verification: lossless)."""
    logprobs: bool | None = None
    """Return the target's log-probability of each token in ``response_metadata["logprobs"]``."""
    top_logprobs: int | None = None
    max_tokens: int | None = None
    """Most tokens to generate per call (default 512)."""
    timeout: float | None = None
    """httpx's limit in seconds (default 60) per HTTP request to a verifier: connecting, and each wait for
    bytes (a streamed segment's next line included); each of ``max_retries`` attempts has its own. Also
    litellm's ``timeout`` for the fallback model's call. Not a deadline for the whole call: a long answer
    may take longer, as it does with ``ChatOpenAI``'s ``timeout``."""
    stop: list[str] | None = None
    max_retries: int = 2
    streaming: bool = False
    mode: Literal["auto", "edge", "server", "server-ar", "vllm", "api"] = "auto"
    num_draft_tokens: int = Field(default=4, ge=0)
    segment_tokens: int = Field(default=16, ge=1)
    pipeline: bool | None = None
    """Edge mode drafts the next round while one is in flight (see :class:`~agentspec.client.SpecClient`):
    ``None`` (default) where a round's drafting is slow enough to be worth hiding; ``True`` always;
    ``False`` never."""
    fallback_model: str | None = None
    """A litellm model id (``"openai/gpt-4o"``) answering when no verifier is reachable, and in
    ``mode="api"`` (required there); it gets every argument of the call, streamed."""
    fallback_api_base: str | None = None
    """The fallback model's endpoint (litellm's ``api_base``); unset: litellm's default for the provider."""
    fallback_api_key: SecretStr | None = None
    """The fallback model's key (litellm's ``api_key``); never sent to a verifier (``api_key`` is theirs)."""
    vllm_base_url: str | None = None
    """An OpenAI-compatible deployment of the same target (vLLM) where the ``vllm`` mode runs, by token ids;
    ``mode="auto"`` weighs it against the verifiers' modes by measured speed."""
    vllm_api_key: SecretStr | None = None
    """The deployment's key (unset: none)."""
    api_kwargs: dict[str, Any] = Field(default_factory=dict)
    """More litellm arguments for the fallback model's call (``drop_params``, ``extra_headers``, ...)."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Call arguments applied to every call, as if given to ``invoke``; unknown constructor arguments land
    here with a warning, as in ``ChatOpenAI`` (an argument no call accepts then fails the call)."""
    drafter: Any = Field(default=None, exclude=True)
    """A local :class:`~agentspec.drafters.base.Drafter` (enables ``edge`` mode)."""
    tokenizer: Any = Field(default=None, exclude=True)

    _sync_client: SpecClient | None = PrivateAttr(default=None)
    _async_clients: weakref.WeakKeyDictionary = PrivateAttr(default_factory=weakref.WeakKeyDictionary)
    _policy: ModePolicy | None = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _token_counts: dict[str, int] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _build_extra(cls, values: Any) -> Any:
        """Unknown constructor arguments → ``model_kwargs``, with a warning naming each (as ChatOpenAI)."""
        if isinstance(values, dict):
            values = _build_model_kwargs(dict(values), get_pydantic_field_names(cls))
        return values

    @model_validator(mode="after")
    def _check(self) -> ChatAgentSpec:
        if not self.base_url and self.fallback_model is None and self.vllm_base_url is None:
            raise ValueError("give base_url (one or more agentspec-verifier URLs), vllm_base_url or a "
                             "fallback_model")
        if self.mode == "vllm" and self.vllm_base_url is None:
            raise ValueError("mode='vllm' needs vllm_base_url (a vLLM deployment of the same target)")
        if self.mode == "api" and self.fallback_model is None:
            raise ValueError("mode='api' needs fallback_model: set fallback_model to a litellm model id "
                             "(e.g. 'openai/gpt-4o'), with fallback_api_base / fallback_api_key")
        check_api_kwargs(self.api_kwargs)
        if twice := sorted({"api_base", "api_key"} & set(self.api_kwargs)):
            raise ValueError(f"set {twice} as fallback_api_base / fallback_api_key, not in api_kwargs")
        if self.mode == "edge" and self.drafter is None:
            raise ValueError("mode='edge' needs a local drafter (e.g. agentspec.drafters.NgramDrafter())")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        return self

    @property
    def _llm_type(self) -> str:
        return "agentspec"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Not serialisable: a drafter and a tokenizer are live objects."""
        return False

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "base_url": self.base_url, "mode": self.mode,
                "num_draft_tokens": self.num_draft_tokens, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "fallback_model": self.fallback_model,
                "fallback_api_base": self.fallback_api_base, "vllm_base_url": self.vllm_base_url}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="agentspec", ls_model_name=kwargs.get("model") or self.model_name,
                                 ls_model_type="chat", ls_temperature=kwargs.get("temperature", self.temperature))
        if (max_tokens := kwargs.get("max_tokens", self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = stop
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What this model supports: text in, text and tool calls out (see the fields' comments)."""
        return ModelProfile(
            text_inputs=True, image_inputs=False, image_url_inputs=False, pdf_inputs=False, audio_inputs=False,
            video_inputs=False, image_tool_message=False, pdf_tool_message=False, text_outputs=True,
            image_outputs=False, audio_outputs=False, video_outputs=False, reasoning_output=False,
            tool_calling=True, tool_call_streaming=True, temperature=True, attachment=False,
            tool_choice=True,  # required / named calls: enforced by the verifier's grammar
            structured_output=True,  # json_schema / json_mode / function_calling: grammar-enforced
        )

    def _new_client(self) -> SpecClient:
        if self._policy is None:  # shared by all clients of this model: one set of measurements
            self._policy = ModePolicy(ModeConfig(has_drafter=self.drafter is not None,
                                                 has_api=self.fallback_model is not None))
        api_kwargs = dict(self.api_kwargs)
        if self.fallback_api_base is not None:
            api_kwargs["api_base"] = self.fallback_api_base
        if self.fallback_api_key is not None:
            api_kwargs["api_key"] = self.fallback_api_key.get_secret_value()
        return SpecClient(self.base_url, api_key=self.api_key.get_secret_value() if self.api_key else None,
                          drafter=self.drafter, tokenizer=self.tokenizer, num_draft_tokens=self.num_draft_tokens,
                          mode=self.mode, fallback_model=self.fallback_model, timeout=self.timeout or 60.0,
                          retries=self.max_retries, segment_tokens=self.segment_tokens, policy=self._policy,
                          api_kwargs=api_kwargs, deployment=self._deployment(), pipeline=self.pipeline)

    def _deployment(self) -> Deployment | None:
        if self.vllm_base_url is None:
            return None
        key = self.vllm_api_key.get_secret_value() if self.vllm_api_key else None
        return Deployment(self.vllm_base_url, self.model_name, key)

    def _client(self) -> SpecClient:
        with self._lock:
            if self._sync_client is None:
                self._sync_client = self._new_client()
            return self._sync_client

    def _aclient(self) -> SpecClient:
        # httpx.AsyncClient's connections belong to one event loop: one SpecClient per loop.
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async_clients.get(loop)
            if client is None:
                client = self._async_clients[loop] = self._new_client()
            return client

    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
                 ) -> tuple[dict[str, Any], ToolChoice]:
        """SpecClient.stream arguments for this call, and the tool choice to check afterwards."""
        kwargs = {**self.model_kwargs, **kwargs}
        if unknown := set(kwargs) - _CALL_KWARGS:
            raise TypeError(f"ChatAgentSpec got unsupported call arguments {sorted(unknown)} (in the call or "
                            f"model_kwargs); supported: {sorted(_CALL_KWARGS)}")
        model = kwargs.get("model")
        if model is not None and not (isinstance(model, str) and model):
            raise ValueError(f"model must be a non-empty string (a name the verifier serves), got {model!r}")
        tools = kwargs.get("tools") or None
        choice = parse_tool_choice(kwargs.get("tool_choice"), tools, kwargs.get("parallel_tool_calls"))
        chat = to_chat_messages(messages, dict_arguments=False)  # render_chat parses them for templates
        for text in (choice.instruction(), response_format_instruction(kwargs.get("response_format"))):
            if text:
                chat = add_instruction(chat, text)
        sampling = self._sampling({k: kwargs[k] if k in kwargs else getattr(self, k) for k in _SAMPLING})
        args = {"messages": chat, "tools": None if choice.kind == "none" else tools,
                "max_tokens": kwargs.get("max_tokens") or self.max_tokens or 512, "sampling": sampling,
                "stop": list(stop if stop is not None else self.stop or ()), "mode": kwargs.get("mode"),
                # enforced by the verifier's grammar (required / named calls, JSON answers)
                "tool_choice": choice.openai(), "parallel_tool_calls": not choice.single,
                "response_format": rf if isinstance(rf := kwargs.get("response_format"), dict) else None,
                # the per-call or configured name (unset: the verifier's own), one the verifier serves
                "model": model or (self.model_name if "model_name" in self.model_fields_set else None)}
        return args, choice

    @staticmethod
    def _sampling(v: dict[str, Any]) -> SamplingParams:
        if v["top_logprobs"] is not None and not v["logprobs"]:
            raise ValueError("top_logprobs needs logprobs=True")
        return SamplingParams(temperature=v["temperature"] or 0.0, top_p=v["top_p"] or 1.0, top_k=v["top_k"] or 0,
                              seed=v["seed"], presence_penalty=v["presence_penalty"] or 0.0,
                              frequency_penalty=v["frequency_penalty"] or 0.0,
                              logit_bias=tuple(sorted((v["logit_bias"] or {}).items())),
                              logprobs=(v["top_logprobs"] or 0) if v["logprobs"] else None)

    def _chunk(self, event: Any, choice: ToolChoice, model: str | None) -> ChatGenerationChunk | None:
        if not isinstance(event, FinalEvent):
            return event_chunk(event)
        choice.check(event.tool_calls, event.text)
        return final_chunk(event, event.model or model or self.model_name)  # the model that answered

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        args, choice = self._prepare(messages, stop, kwargs)
        events = self._client().stream(**args)
        try:
            for event in events:
                chunk = self._chunk(event, choice, args["model"])
                if chunk is not None:
                    if run_manager:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        except Exception as e:
            _reraise(e)
        finally:
            events.close()  # a consumer that stops early ends the HTTP stream now, not at garbage collection

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        args, choice = self._prepare(messages, stop, kwargs)
        events = self._aclient().astream(**args)
        try:
            async for event in events:
                chunk = self._chunk(event, choice, args["model"])
                if chunk is not None:
                    if run_manager:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
        except Exception as e:
            _reraise(e)
        finally:
            await events.aclose()

    def get_num_tokens(self, text: str) -> int:
        """Tokens of ``text`` in the target's own tokenizer (the verifier's ``/tokenize``; cached per text)."""
        if text not in self._token_counts:
            if len(self._token_counts) >= 4096:
                self._token_counts.clear()
            self._token_counts[text] = self._call_counter(text=text)
        return self._token_counts[text]

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Tokens of the prompt these messages (+ tools) make with the target's chat template."""
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        return self._call_counter(messages=to_chat_messages(messages, dict_arguments=False), tools=formatted)

    def _call_counter(self, **kwargs: Any) -> int:
        try:
            return self._client().count_tokens(**kwargs)
        except Exception as e:
            _reraise(e)
            raise

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: str | dict[str, Any] | bool | None = None, strict: bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form ``convert_to_openai_tool`` takes) and an optional ``tool_choice``.

        ``tool_choice``: "auto", "none" (tools hidden), "any"/"required", a tool name or an OpenAI dict;
        required and named choices are asked for by instruction and checked (``ToolChoiceError``), not
        enforced by constrained decoding. ``strict`` is recorded in the schemas but not enforced.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        parse_tool_choice(tool_choice, formatted, parallel_tool_calls)  # fail here, not at call time
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *, include_raw: bool = False,
                               method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
                               strict: bool | None = None, **kwargs: Any
                               ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Answers parsed into ``schema`` (a Pydantic class, TypedDict, JSON schema or OpenAI tool).

        ``function_calling`` forces a call to a tool built from the schema; ``json_mode``/``json_schema`` ask
        for JSON text. Each is also said in an instruction and enforced by the verifier's grammar (every token
        the target's own under the mask, lossless under speculation), so the answer has the schema's form; an
        answer cut by ``max_tokens`` still raises a parsing error (returned instead with ``include_raw=True``).
        Through the API fallback the provider enforces what it supports.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: Runnable
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, ls_structured_output_format=ls_format)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic  # type: ignore[list-item]
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_mode", "json_schema"):
            if method == "json_mode":
                response_format: dict[str, Any] = {"type": "json_object"}
            else:
                json_schema = convert_to_json_schema(schema)
                response_format = {"type": "json_schema", "json_schema": {
                    "name": json_schema.get("title", "response"), "schema": json_schema, "strict": strict}}
            llm = self.bind(response_format=response_format, ls_structured_output_format=ls_format)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise ValueError(f"method must be 'function_calling', 'json_mode' or 'json_schema', got {method!r}")
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")


def _reraise(e: Exception) -> None:
    """Raise ``e`` as its ``langchain_core.exceptions`` type (cause kept), or as it is when it has none."""
    mapped = map_error(e)
    if mapped is None:
        raise e
    raise mapped from e
