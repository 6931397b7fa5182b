"""LangChain error types for verifier failures, so agent retry middleware can read ``is_retryable``.

Each verifier error class inherits from the agentspec transport type (callers catching it keep working)
and, second, the matching ``langchain_core.exceptions`` type, which the fallback API model's (litellm's)
errors map to.
"""

from __future__ import annotations

import sys

import httpx
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAPIError,
    ModelAuthenticationError,
    ModelConnectionError,
    ModelError,
    ModelInvalidRequestError,
    ModelNotFoundError,
    ModelPermissionDeniedError,
    ModelRateLimitError,
    ModelTimeoutError,
)

from agentspec.transport import VerifierError, VerifierUnavailable


class VerifierConnectionError(VerifierUnavailable, ModelConnectionError):
    """No verifier (and no fallback model) could be reached."""


class VerifierTimeoutError(VerifierUnavailable, ModelTimeoutError):
    """The verifier did not answer within ``timeout`` seconds (after ``max_retries`` retries)."""


class VerifierAPIError(VerifierUnavailable, ModelAPIError):
    """The verifier failed (HTTP 5xx) or lost the session more often than the client repairs."""


class VerifierRateLimitError(VerifierUnavailable, ModelRateLimitError):
    """The verifier answered HTTP 429."""


class VerifierAuthenticationError(VerifierError, ModelAuthenticationError):
    """The verifier refused the API key (set ``api_key`` or ``AGENTSPEC_API_KEY``)."""


class VerifierPermissionDeniedError(VerifierError, ModelPermissionDeniedError):
    """The verifier answered HTTP 403."""


class VerifierNotFoundError(VerifierError, ModelNotFoundError):
    """The verifier answered HTTP 404: it does not serve ``model`` (or ``base_url`` is wrong)."""


class VerifierInvalidRequestError(VerifierError, ModelInvalidRequestError):
    """The verifier rejected the request (HTTP 4xx)."""


class VerifierContextOverflowError(VerifierError, ContextOverflowError):
    """The prompt (plus ``max_tokens``) does not fit the verifier's ``--max-model-len``."""


class ToolChoiceError(ModelError):
    """The target answered without the tool call that ``tool_choice`` required.

    Decoding is not constrained yet, so a target that ignores the instruction fails here; ``raw_text`` is
    what it wrote instead. Greedy decoding would answer the same again, so this is not retryable.
    """

    def __init__(self, message: str, *, raw_text: str = "") -> None:
        super().__init__(message)
        self.raw_text = raw_text


_BY_STATUS: dict[int, type[VerifierError]] = {
    401: VerifierAuthenticationError, 403: VerifierPermissionDeniedError, 404: VerifierNotFoundError,
    408: VerifierTimeoutError, 429: VerifierRateLimitError, 504: VerifierTimeoutError,
}


def _timed_out(e: BaseException) -> bool:
    """Whether ``e`` or anything in its cause chain is a timeout."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (httpx.TimeoutException, TimeoutError)):
            return True
        openai = sys.modules.get("openai")  # litellm's errors subclass openai's; never import it here
        if openai is not None and isinstance(cur, openai.APITimeoutError):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _kind(status: int | None, message: str, timed_out: bool, unreachable: bool) -> type[VerifierError]:
    if timed_out:
        return VerifierTimeoutError
    if status is None:
        return VerifierConnectionError if unreachable else VerifierAPIError
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if status >= 500:
        return VerifierAPIError
    if "max-model-len" in message or "max_model_len" in message or "context length" in message:
        return VerifierContextOverflowError
    return VerifierInvalidRequestError


def map_error(e: BaseException) -> Exception | None:
    """The LangChain exception for ``e`` (raise it ``from e``), or None when ``e`` is not a model failure."""
    if isinstance(e, ModelError):
        return None  # already typed
    if isinstance(e, VerifierError):
        cls = _kind(e.status, str(e), _timed_out(e), isinstance(e, VerifierUnavailable))
        return cls(str(e), status=e.status, code=e.code, body=e.body)
    openai = sys.modules.get("openai")
    if openai is not None and isinstance(e, openai.APIError):  # the fallback API model, via litellm
        status = getattr(e, "status_code", None)
        if isinstance(e, openai.APIConnectionError) or not isinstance(status, int):
            status = None  # litellm gives connection errors a status of 500
        cls = _kind(status, str(e), _timed_out(e), isinstance(e, openai.APIConnectionError))
        return cls.__bases__[1](f"fallback model failed: {e}")  # the plain LangChain type
    if isinstance(e, (httpx.TimeoutException, TimeoutError)):
        return ModelTimeoutError(f"agentspec request timed out: {e}")
    if isinstance(e, httpx.TransportError):
        return ModelConnectionError(f"agentspec transport failed: {e}")
    return None
