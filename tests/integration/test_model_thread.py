"""One thread runs every torch op of a served model (:func:`agentspec.models.model_thread`).

On CPU each thread that runs torch ops gets its own OpenMP team, and once a second thread has run even
one op the model thread decodes up to 2x slower for good (measured: SmolLM2-135M 57 → 96-130 ms per
step after one ``PackedLinear.weight`` read on the main thread). Creating, warming and serving a verifier
must therefore run no torch op anywhere else: not in the caller's thread, the HTTP server's or the client's.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from agentspec import models
from agentspec.client import SpecClient
from agentspec.drafters import NgramDrafter
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.local import LocalVerifier
from tests.helpers import tiny_model

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "count with me: one two three one two three one two"}]


def _is_torch(fn: object) -> bool:
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or ""
    return module.startswith("torch") or qualname.startswith(("Tensor.", "TensorBase.", "_TensorBase."))


@contextmanager
def torch_calls_off(thread_prefix: str) -> Iterator[list[str]]:
    """Collect every call into torch's C functions made by a thread whose name lacks ``thread_prefix``."""
    found: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 - the sys.setprofile signature
        if event == "c_call" and _is_torch(arg) and not threading.current_thread().name.startswith(thread_prefix):
            found.append(f"{threading.current_thread().name}: {getattr(arg, '__qualname__', arg)} "
                         f"at {frame.f_code.co_filename}:{frame.f_lineno}")

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield found
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_serving_runs_torch_only_on_the_model_thread():
    thread = models.model_thread("agentspec-model")
    target = models.on_thread(thread, tiny_model, 21)
    if models.on_thread(thread, models.pack_cpu_linears, target.model) == 0:
        pytest.skip("this torch build has no oneDNN linear kernels: nothing packed to test against")
    with torch_calls_off("agentspec-model") as found, \
            LocalVerifier(target, ServerConfig(served_model_name="tiny"), executor=thread) as v:
        client = SpecClient(v.url, drafter=NgramDrafter(), server_drafter="ngram", retries=0)
        for mode in ("edge", "server", "server-ar", "auto"):
            final = client.generate(MESSAGES, max_tokens=12, mode=mode)
            assert final.tokens, mode
        client.close()
    thread.shutdown()
    assert not found, "\n".join(found[:20])


def test_warm_up_builds_the_grammar_tokenizer_after_the_timings():
    """The grammar engine's tokenizer (seconds for a real vocabulary) is built once the verify-cost curve is
    measured, on a thread of its own, so no tenant's first tool-calling request waits for it."""
    from agentspec.drafters import grammar

    thread = models.model_thread("agentspec-model")
    target = models.on_thread(thread, tiny_model, 22)
    assert id(target.tokenizer) not in grammar._LL_TOKENIZERS  # a fresh tokenizer object: not built yet
    with LocalVerifier(target, ServerConfig(served_model_name="tiny"), executor=thread) as v:
        assert v.engine.verify_costs  # the curve came first
        v.engine.grammar_ready.join(timeout=60)
        assert not v.engine.grammar_ready.is_alive()
        assert grammar._LL_TOKENIZERS[id(target.tokenizer)][0] is target.tokenizer
    thread.shutdown()
