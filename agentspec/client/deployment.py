"""The ``vllm`` mode: segments of an answer decoded by an OpenAI-compatible deployment of the *same* target —
vLLM (with or without its own speculative decoding, agentspec's proposer included), or an
``agentspec-verifier`` — by token ids, so a request moves between it and agentspec's own modes mid-answer
without re-tokenising or losing a token.

The prompt is rendered by the deployment (``POST /tokenize`` with the chat messages and tools: its chat
template, as every other mode uses the target's); each segment is ``POST /v1/completions`` with the committed
token ids as the prompt, streamed, with ``return_token_ids`` (vLLM's extension) so the client commits exactly
the tokens it decoded. With prefix caching on (vLLM's default), a segment costs its new tokens, not a prefill.
Tool calls and stop strings are parsed here from the committed text, as in the other modes.

An answer that segments cannot carry (:func:`segment_refusal`: a grammar, penalties over the answer so
far, chat-form logprobs) is one chat completion on the deployment instead, or runs in agentspec's modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentspec.client.api import api_segment
from agentspec.client.events import SegmentStats
from agentspec.client.ops import Call, Steps
from agentspec.client.run import Run
from agentspec.toolcalls import wants_constraint
from agentspec.transport import HTTPTransport, VerifierUnavailable, verifier_base


@dataclass(frozen=True)
class Deployment:
    """Where the ``vllm`` mode runs: an OpenAI-compatible server's base URL (``…/v1`` or not), the model name
    it serves, and its API key (None: no ``Authorization`` header)."""

    base_url: str
    model: str
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"Deployment.base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise ValueError("Deployment.model must name the model the deployment serves")

    def transport(self, timeout: float, retries: int) -> HTTPTransport:
        return HTTPTransport(self.base_url, api_key=self.api_key, timeout=timeout, retries=retries)


def segment_refusal(run: Run) -> str | None:
    """Why ``run``'s answer cannot be decoded in segments (each a new request continuing the token ids);
    None: it can. Such an answer runs on the deployment as one chat completion instead
    (:func:`whole_answer`), or in agentspec's own modes."""
    s = run.sampling
    if wants_constraint(run.tools, run.tool_choice, run.response_format):
        return "its tool_choice/response_format grammar would restart at every segment"
    if s.presence_penalty or s.frequency_penalty:
        return "presence/frequency penalties would not count the answer a segment sends as its prompt"
    if s.logprobs is not None:
        return "logprobs come in the chat form from a chat completion"
    return None


def completion_request(run: Run, model: str, max_new_tokens: int) -> dict[str, Any]:
    """The ``/v1/completions`` body of the next segment: the committed tokens as the prompt."""
    s = run.sampling
    body: dict[str, Any] = {"model": model, "prompt": list(run.tokens), "max_tokens": max_new_tokens,
                            "temperature": s.temperature, "stream": True, "return_token_ids": True}
    if s.top_p != 1.0:
        body["top_p"] = s.top_p
    if s.top_k:
        body["top_k"] = s.top_k
    if s.seed is not None:  # one seed per segment: the same request sampled again takes the same path
        body["seed"] = s.seed + run.generated
    if s.logit_bias:  # the same target, so the same vocabulary
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    return body


def whole_answer(run: Run, dep: Deployment, timeout: float) -> Steps:
    """``run``'s whole answer as one streamed chat completion on the deployment, with every argument of the
    request (its structure enforced by the deployment's own structured outputs, as vLLM does for it)."""
    assert not run.generated and not run.committed_text, "a whole answer starts the answer"
    extra = {"api_base": verifier_base(dep.base_url) + "/v1", "api_key": dep.api_key or "EMPTY"}
    try:
        yield from api_segment(run, f"hosted_vllm/{dep.model}", timeout, extra, mode="vllm", same_vocab=True)
    except Exception as e:
        status = getattr(e, "status_code", None)
        if run.committed_text or run.calls or (status is not None and status < 500):
            raise  # a request the deployment refused, or an answer begun: the caller sees it as it is
        raise VerifierUnavailable(f"deployment {dep.base_url} failed: {e}", status=status) from e
    run.served_model = dep.model


def deployment_segment(run: Run, dep: Deployment, transport: HTTPTransport, seg: SegmentStats,
                       max_new_tokens: int) -> Steps:
    """Up to ``max_new_tokens`` more tokens of ``run`` from the deployment, counted in ``seg``; yields the
    events they make final."""
    if not run.prompt:
        body = {"model": dep.model, "messages": run.messages, "add_generation_prompt": True,
                **({"tools": run.tools} if run.tools else {})}
        reply = yield Call(transport.post, transport.apost, ("/tokenize", body))
        tokens = reply.body.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise VerifierUnavailable(f"{dep.base_url}/tokenize answered no token ids")
        run.prompt, run.tokens = [int(t) for t in tokens], [int(t) for t in tokens]
        run.served_model = dep.model
    body = completion_request(run, dep.model, max_new_tokens)
    lines = yield Call(transport.stream_lines, transport.astream_lines, ("/v1/completions", body))
    while run.finish is None and (r := (yield Call(next, anext, (lines, None)))) is not None:
        for choice in r.body.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is None:
                raise VerifierUnavailable(f"{dep.base_url} does not return token ids (return_token_ids): the "
                                          "vllm mode needs a vLLM that has it, or agentspec-verifier")
            run.tokens.extend(int(t) for t in ids)
            seg.tokens += len(ids)
            seg.rounds += 1 if ids else 0
            yield from run.feed_text(choice.get("text") or "")
            if choice.get("finish_reason") == "stop":
                run.finish = "stop"
