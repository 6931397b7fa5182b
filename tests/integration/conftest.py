"""Integration tests: real servers on loopback only.

Tests marked ``capable_llm`` need a target that follows instructions (tool calls with the right
arguments, JSON answers); a tiny random model cannot. They are deselected unless
``AGENTSPEC_CAPABLE_LLM=1``, which makes those tests serve Qwen2.5-Coder-0.5B-Instruct (offline weights).
A test class lists inherited tests that need such a target in ``capable_llm_tests``.
"""

from __future__ import annotations

import os

import pytest


def capable_llm_enabled() -> bool:
    return os.environ.get("AGENTSPEC_CAPABLE_LLM", "") not in ("", "0")


@pytest.hookimpl(tryfirst=True)  # before -m filtering, so `-m capable_llm` sees the marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and getattr(item, "originalname", item.name) in getattr(cls, "capable_llm_tests", ()):
            item.add_marker(pytest.mark.capable_llm)
    if capable_llm_enabled():
        return
    deselected = [i for i in items if i.get_closest_marker("capable_llm")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [i for i in items if not i.get_closest_marker("capable_llm")]
