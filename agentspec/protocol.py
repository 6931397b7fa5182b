"""The speculation wire protocol (version 1): JSON messages between SpecClient and agentspec-verifier.

Endpoints (all under ``/v1/spec``, Bearer auth when the server has keys):

* ``POST /sessions`` — :class:`OpenSession` → :class:`SessionInfo`: a session from prompt ids or chat
  ``messages`` (the reply returns the ids); a prefix cached for the same API key is reused.
* ``POST /sessions/{id}/rounds`` — :class:`VerifyRound` → :class:`RoundReply`: one verification round of
  a ``draft`` (chain, or tree with ``parents``; sampled drafts carry their proposal ``q``) at ``base_len``.
* ``POST /sessions/{id}/generate`` — :class:`Generate` → NDJSON :class:`RoundReply` objects: the server
  drafts itself (``server``) or decodes plainly (``server-ar``) and streams tokens as they are committed.
* ``GET /sessions/{id}`` → :class:`SessionInfo`; ``DELETE`` closes it (its KV stays reusable as a prefix).

Errors use the OpenAI envelope; :data:`RESEND_PREFIX_CODES` tell the client to open a new session. Checks
that need the model are the ``check_against`` methods; ``from_*``/``to_*`` convert to :mod:`agentspec.types`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentspec.toolcalls import check_structure, flatten_content
from agentspec.types import DraftProposal, SamplingParams, SparseDist, check_parents

PROTOCOL_VERSION = 1

SESSION_NOT_FOUND = "session_not_found"
SESSION_EVICTED = "session_evicted"
BASE_LEN_MISMATCH = "base_len_mismatch"
RESEND_PREFIX_CODES = frozenset({SESSION_NOT_FOUND, SESSION_EVICTED, BASE_LEN_MISMATCH})

TokenId = Annotated[int, Field(ge=0)]
PROB_TOLERANCE = 1e-3


class ProtocolError(ValueError):
    """A request that is well-formed JSON but asks for something the server cannot do; maps to a 4xx."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request",
                 status: int = 400, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status
        self.extra = extra or {}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    def to_wire(self) -> dict[str, Any]:
        """This message as the JSON body a peer sends (optional fields left unset are left out)."""
        return self.model_dump(exclude_none=True)


class Sampling(_Strict):
    """Sampling settings of a round; temperature 0 is greedy (the default). ``logit_bias`` maps token ids
    (JSON keys are strings, as in OpenAI's API) to biases; the penalties count this turn's generated
    tokens; ``logprobs`` asks for each committed token's log-probability and that many top alternatives."""

    temperature: float = Field(0.0, ge=0.0, le=100.0)  # both bounded: nan and ±inf fail the bounds
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")], Annotated[float, Field(ge=-100.0, le=100.0)]] \
        | None = Field(None, max_length=1024)
    logprobs: int | None = Field(None, ge=0, le=20)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_params(cls, p: SamplingParams) -> Sampling:
        """The wire form of a request's sampling settings (``max_new_tokens`` and ``stop`` travel apart)."""
        return cls(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
                   presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                   logit_bias={str(t): b for t, b in p.logit_bias} or None, logprobs=p.logprobs)

    def to_params(self, **overrides: Any) -> SamplingParams:
        """The core :class:`SamplingParams`; ``overrides`` set the fields the wire does not carry here."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              logit_bias=tuple(sorted((int(t), b) for t, b in (self.logit_bias or {}).items())),
                              logprobs=self.logprobs,
                              **overrides)

    def check_against(self, vocab_size: int) -> None:
        _check_vocab([int(t) for t in self.logit_bias or ()], vocab_size, "sampling.logit_bias")


class TopLogprob(BaseModel):
    """One alternative at a position: its id, text and log-probability under the target."""

    token: int
    text: str = ""
    logprob: float


class TokenLogprob(TopLogprob):
    """A committed token's log-probability under the target, and the top alternatives there."""

    top: list[TopLogprob] = Field(default_factory=list)

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``logprobs.content`` entry for this token."""
        def entry(x: TopLogprob) -> dict[str, Any]:
            return {"token": x.text, "logprob": x.logprob, "bytes": list(x.text.encode("utf-8"))}
        return {**entry(self), "top_logprobs": [entry(t) for t in self.top]}


class SparseQ(_Strict):
    """A drafter's proposal distribution at one draft node: token ids and their probabilities."""

    ids: list[TokenId] = Field(min_length=1)
    probs: list[float] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> SparseQ:
        if len(self.ids) != len(self.probs):
            raise ValueError(f"ids ({len(self.ids)}) and probs ({len(self.probs)}) must have the same length")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("ids must be distinct")
        if any(not math.isfinite(p) or p < 0 or p > 1 for p in self.probs):
            raise ValueError("probs must be finite numbers in [0, 1]")
        if sum(self.probs) > 1 + PROB_TOLERANCE:
            raise ValueError(f"probs sum to {sum(self.probs):.6f}; a distribution sums to at most 1")
        return self


class Draft(_Strict):
    """Draft tokens: a chain (``parents`` omitted) or a tree in topological order (``parents[i] < i``)."""

    tokens: list[TokenId] = Field(default_factory=list)
    parents: list[int] | None = None
    q: list[SparseQ] | None = None
    source: str = Field("", max_length=64)

    @model_validator(mode="after")
    def _check(self) -> Draft:
        n = len(self.tokens)
        if self.parents is not None:
            check_parents(self.parents, n)
        if self.q is not None:
            if len(self.q) != n:
                raise ValueError(f"q has {len(self.q)} entries for {n} tokens")
            for i, (tok, dist) in enumerate(zip(self.tokens, self.q, strict=True)):
                if tok not in dist.ids or dist.probs[dist.ids.index(tok)] <= 0:
                    raise ValueError(f"q[{i}] gives the drafted token {tok} no probability; q must be the "
                                     "distribution the token was sampled from")
        return self

    @classmethod
    def from_proposal(cls, p: DraftProposal) -> Draft:
        """The wire form of a proposal: ``parents`` only for a real tree, ``q`` only for sampled drafts
        (a deterministic node inside one, ``None``, is its point mass). ``num_forced`` stays local."""
        q = None
        if p.draft_probs is not None:
            q = [SparseQ(ids=list(d.ids if d else (t,)), probs=list(d.probs if d else (1.0,)))
                 for t, d in zip(p.tokens, p.draft_probs, strict=True)]
        parents = list(p.parents) if p.is_tree else None
        return cls(tokens=list(p.tokens), parents=parents, q=q, source=p.source[:64])

    def to_proposal(self) -> DraftProposal:
        """The core :class:`DraftProposal` this draft describes."""
        probs = None if self.q is None else tuple(SparseDist(tuple(d.ids), tuple(d.probs)) for d in self.q)
        parents = tuple(self.parents) if self.parents is not None else None
        return DraftProposal(tokens=tuple(self.tokens), parents=parents, draft_probs=probs, source=self.source)


class OpenSession(_Strict):
    """Open a session from ``prompt_ids`` or chat ``messages``.

    ``tools``, ``tool_choice`` and ``response_format`` let server mode draft the tokens their grammar forces;
    a required or named ``tool_choice`` (with tools) or a JSON ``response_format`` also *constrains* every
    answer of the session to that grammar, losslessly (``SessionInfo.constrained``). ``num_generated``: the
    last that many ``prompt_ids`` are an answer being continued (a session reopened mid-answer), so the
    grammar, the penalties and ``max_new_tokens`` count from where that answer began."""

    prompt_ids: list[TokenId] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    max_new_tokens: int | None = Field(None, ge=1)
    stop_token_ids: list[TokenId] | None = None
    model: str | None = None  # one of the server's served names (checked by the server); echoed back
    num_generated: int = Field(0, ge=0)
    parallel_tool_calls: bool = True  # False: a constrained answer holds one tool call
    protocol_version: int = PROTOCOL_VERSION

    @model_validator(mode="after")
    def _check(self) -> OpenSession:
        if (self.prompt_ids is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt_ids or messages")
        if self.num_generated and (self.prompt_ids is None or self.num_generated >= len(self.prompt_ids)):
            raise ValueError("num_generated counts trailing prompt_ids: it needs prompt_ids longer than it")
        if self.prompt_ids is not None and not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        self.messages = flatten_content(self.messages) if self.messages else self.messages
        check_structure(self.tools, self.tool_choice, self.response_format)
        if self.protocol_version != PROTOCOL_VERSION:
            raise ValueError(f"this server speaks protocol version {PROTOCOL_VERSION}")
        return self


class VerifyRound(_Strict):
    """One verification round (edge mode)."""

    base_len: int = Field(ge=1)
    new_tokens: list[TokenId] = Field(default_factory=list)
    draft: Draft = Field(default_factory=Draft)
    sampling: Sampling = Field(default_factory=Sampling)

    @model_validator(mode="after")
    def _check(self) -> VerifyRound:
        if self.sampling.greedy and self.draft.q is not None:
            raise ValueError("q is for sampled drafts; a greedy round (temperature 0) must not send it")
        if not self.sampling.greedy and self.draft.tokens and self.draft.q is None:
            raise ValueError("a sampled round (temperature > 0) must send q, the distribution each draft "
                             "token was sampled from; without it verification cannot be lossless")
        return self

    def check_against(self, vocab_size: int, max_draft_tokens: int) -> None:
        """Checks that need the server's model and limits."""
        if len(self.draft.tokens) > max_draft_tokens:
            raise ProtocolError(f"draft has {len(self.draft.tokens)} tokens; this server allows at most "
                                f"{max_draft_tokens} (--max-draft-tokens)", param="draft.tokens")
        _check_vocab(self.new_tokens, vocab_size, "new_tokens")
        self.sampling.check_against(vocab_size)
        _check_vocab(self.draft.tokens, vocab_size, "draft.tokens")
        for i, dist in enumerate(self.draft.q or ()):
            _check_vocab(dist.ids, vocab_size, f"draft.q[{i}].ids")


ServerDrafter = Literal["default", "model", "ngram"]
SERVER_DRAFTERS: tuple[str, ...] = get_args(ServerDrafter)


class Generate(_Strict):
    """Server-side generation on a session: co-located speculation (``server``) or plain decoding."""

    base_len: int = Field(ge=1)
    new_tokens: list[TokenId] = Field(default_factory=list)
    mode: Literal["server", "server-ar"] = "server"
    max_new_tokens: int = Field(256, ge=1)
    # the most rounds (target passes) this request runs; None: as many as max_new_tokens takes. A router's
    # probe sends a few: a mode that commits one token a pass is judged on those as well as on more
    max_rounds: int | None = Field(None, ge=1)
    num_draft_tokens: int | None = Field(None, ge=0)
    sampling: Sampling = Field(default_factory=Sampling)
    # server mode's drafter: "default" combines grammar, copy and the --draft-model (a token tree); "model" is
    # that model alone; "ngram" is prompt lookup (a chain: what the router's closed forms describe)
    drafter: ServerDrafter = "default"

    def check_against(self, vocab_size: int, max_draft_tokens: int) -> None:
        _check_vocab(self.new_tokens, vocab_size, "new_tokens")
        self.sampling.check_against(vocab_size)
        if self.num_draft_tokens is not None and self.num_draft_tokens > max_draft_tokens:
            raise ProtocolError(f"num_draft_tokens {self.num_draft_tokens} exceeds this server's "
                                f"--max-draft-tokens {max_draft_tokens}", param="num_draft_tokens")


class Timings(BaseModel):
    queue_ms: float = 0.0
    verify_ms: float = 0.0
    draft_ms: float = 0.0
    batch_size: int = 1


class Load(BaseModel):
    running: int = 0
    waiting: int = 0
    sessions: int = 0
    kv_cache_bytes: int = 0
    kv_cache_capacity_bytes: int = 0


class RoundReply(BaseModel):
    """What a round committed: ``tokens`` = accepted draft tokens + the recovered/bonus token."""

    session_id: str
    accepted: int
    drafted: int
    tokens: list[int]
    text: str = ""  # the text these tokens add (special tokens skipped; a split character waits a round)
    committed_len: int
    finished: bool = False  # this request is over (a generate call may end at its max_new_tokens or max_rounds)
    finish_reason: Literal["stop", "length"] | None = None
    session_finished: bool = False  # the session itself ended (stop token or its token limit)
    logprobs: list[TokenLogprob] | None = None  # one per token, when the sampling settings ask
    timings: Timings = Field(default_factory=Timings)
    load: Load = Field(default_factory=Load)


class Tokenize(_Strict):
    """``POST /tokenize``: a ``prompt`` string, or chat ``messages`` (+ ``tools``) rendered with the target's
    chat template (what the target will really see: LangChain's ``get_num_tokens`` counts with it)."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    model: str | None = None  # as vLLM's: must name a served model when given

    @model_validator(mode="after")
    def _check(self) -> Tokenize:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        self.messages = flatten_content(self.messages) if self.messages is not None else None
        return self


class Detokenize(_Strict):
    """``POST /detokenize``: token ids back to text."""

    tokens: list[TokenId]


class SessionInfo(BaseModel):
    session_id: str
    prompt_ids: list[int]
    committed_len: int
    reused_tokens: int = 0
    prefill_ms: float = 0.0
    server_ms: float = 0.0  # the server's whole time on the open (rendering, grammar, prefill): not the link's
    vocab_size: int
    max_draft_tokens: int
    # the most draft tokens a round carries at the verifier's flat cost (one more costs a step: flat_pass_len)
    flat_draft_tokens: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)  # the tokens that end this session's answers
    constrained: bool = False  # answers are decoded under the grammar of tool_choice / response_format
    protocol_version: int = PROTOCOL_VERSION
    model: str
    load: Load = Field(default_factory=Load)


def _check_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if t >= vocab_size]
    if bad:
        raise ProtocolError(f"{param} has token id {bad[0]} but the model's vocabulary has {vocab_size} ids "
                            f"(0 … {vocab_size - 1})", param=param)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, **extra: Any) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}
