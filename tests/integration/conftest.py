"""Integration tests: real servers on loopback only.

Tests marked ``capable_llm`` need a target that follows instructions (tool calls with the right
arguments, JSON answers); a tiny random model cannot. They are deselected unless
``AGENTSPEC_CAPABLE_LLM=1``, which makes those tests serve Qwen2.5-Coder-0.5B-Instruct (offline weights).
A test class lists inherited tests that need such a target in ``capable_llm_tests``.

Tests marked ``vllm`` talk to a live ``vllm serve`` from the vLLM venv; they are deselected unless
``AGENTSPEC_VLLM=1``, which ``make test-vllm`` sets after making the venv (``make vllm``).
"""

from __future__ import annotations

import os

import pytest


def capable_llm_enabled() -> bool:
    return os.environ.get("AGENTSPEC_CAPABLE_LLM", "") not in ("", "0")


def vllm_enabled() -> bool:
    return os.environ.get("AGENTSPEC_VLLM", "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)  # before -m filtering, so `-m capable_llm` sees the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(item, "originalname", item.name) in getattr(cls, "capable_llm_tests", ()):
            item.add_marker(pytest.mark.capable_llm)
    off = [m for m, on in (("capable_llm", capable_llm_enabled()), ("vllm", vllm_enabled())) if not on]
    deselected = [i for i in items if any(i.get_closest_marker(m) for m in off)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        gone = {id(i) for i in deselected}
        items[:] = [i for i in items if id(i) not in gone]
