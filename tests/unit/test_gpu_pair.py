"""The accelerator benchmark's measuring loop on tiny models, and the device wait its clocks rely on."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from agentspec import models
from benchmarks.gpu_pair import METHODS, acceptance, run_dtype
from tests.helpers import tiny_model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]


def test_every_method_is_timed_and_checked_against_plain_greedy() -> None:
    target, drafter = tiny_model(seed=0), tiny_model(seed=0, layers=1)
    prompts = [{"id": f"p{i}", "messages": [{"role": "user", "content": text}], "tools": TOOLS}
               for i, text in enumerate(("warm up", "weather in Paris?", "and in Rome, twice"))]
    args = SimpleNamespace(num_draft_tokens=4, max_new_tokens=24)
    out = run_dtype(target, drafter, prompts, args, METHODS)
    assert [r["id"] for r in out["rows"]] == ["p1", "p2"]  # the first prompt only warms up
    for name in METHODS:
        m = out["methods"][name]
        assert m["identical_prompts"] == m["prompts"] == 2, name
        assert m["tokens"] == out["methods"]["plain"]["tokens"] and m["target_passes"] <= m["tokens"]
    assert out["methods"]["plain"]["tokens_per_pass"] == 1.0
    verdict = acceptance({"setup": {"device": "cpu", "gpu": None}, "bfloat16": out})
    assert verdict["best_method_bf16"] in METHODS[1:] and verdict["identical_bf16"]["default_0.5b"] == "2/2"


def test_device_clocks_wait_for_queued_kernels_on_cuda_and_mps(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append(("mps", None)))
    models.synchronize(torch.device("cpu"))
    assert calls == []  # nothing queued on a CPU
    models.synchronize(torch.device("cuda", 0))
    models.synchronize(torch.device("mps"))
    assert calls == [("cuda", torch.device("cuda", 0)), ("mps", None)]
