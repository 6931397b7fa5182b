"""The quick-start job: speculative vs plain generation of agent tool calls on the offline default model.

Loads Qwen2.5-Coder-0.5B-Instruct (shipped inside PyPI packages, no hub), renders a few agent steps
with tools through the model's own chat template, and generates each one twice side by side — plain
greedy decoding and agentspec's speculative engine — printing the answer, whether the two outputs are
identical, mean accepted length and the measured speed-up. The engine measures the verify-cost curve
first and drafts, each round, as many tokens as pay for themselves (``agentspec.router``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the project.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]

STEPS = [
    [{"role": "user", "content": "What's the weather in Lisbon, in celsius?"}],
    [{"role": "user", "content": "Open the file agentspec/verifier_server/kv_store.py and summarise it."}],
    [
        {"role": "user", "content": "Compare the weather in Oslo and in Buenos Aires."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "call_1", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"city": "Oslo", "temp_c": -3})},
    ],
]


@dataclass(frozen=True)
class DemoConfig:
    model: str = "qwen2.5-coder-0.5b-instruct"
    dtype: str = "float32"
    device: str = "auto"
    num_draft_tokens: int = 8
    max_new_tokens: int = 96


def run_demo(config: DemoConfig = DemoConfig()) -> int:
    """Run the side-by-side demo; returns a process exit code (1 if any output differed)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from agentspec.drafters import NgramDrafter
    from agentspec.engine import SpecEngine
    from agentspec.models import load_model
    from agentspec.types import SamplingParams

    console = Console()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with console.status(f"loading {config.model} ({config.dtype}) — first run assembles the GGUF file"):
        target = load_model(config.model, device=config.device, dtype=config.dtype)
    console.print(f"target: [bold]{config.model}[/] on {target.device}, {target.dtype}")
    plain = SpecEngine(target, None)
    spec = SpecEngine(target, NgramDrafter(max_ngram=3), num_draft_tokens=config.num_draft_tokens)
    params = SamplingParams(max_new_tokens=config.max_new_tokens)
    prompts = [target.tokenizer.apply_chat_template(m, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"] for m in STEPS]
    with console.status("warming up; measuring the verify-cost curve (it sets how many tokens to draft)"):
        plain.generate(prompts[0], SamplingParams(max_new_tokens=8))
        curve = spec.calibrate(prompts[0][:64], reps=2)
        spec.generate(prompts[0], SamplingParams(max_new_tokens=8))
    console.print("verify cost t_v(k)/t_v(1): " + " ".join(f"{k}:{v / curve[1]:.2f}" for k, v in curve.items()))
    table = Table(title="plain greedy vs agentspec (n-gram copy drafter), same target, same prompts")
    for col in ("step", "identical", "tokens", "plain tok/s", "agentspec tok/s", "mean accepted", "speed-up"):
        table.add_column(col)
    all_same, total_plain, total_spec, total_tokens = True, 0.0, 0.0, 0
    for i, prompt in enumerate(prompts, 1):
        t0 = time.perf_counter()
        ref = plain.generate(prompt, params)
        t1 = time.perf_counter()
        out = spec.generate(prompt, params)
        t2 = time.perf_counter()
        same = out.tokens == ref.tokens
        all_same &= same
        n = len(out.tokens)
        total_plain, total_spec, total_tokens = total_plain + t1 - t0, total_spec + t2 - t1, total_tokens + n
        console.print(f"[bold]step {i}[/] answer: {out.text.strip()}")
        table.add_row(str(i), "yes" if same else "[red]NO[/]", str(n), f"{n / (t1 - t0):.1f}", f"{n / (t2 - t1):.1f}",
                      f"{out.stats.mean_accepted_length:.2f}", f"{(t1 - t0) / (t2 - t1):.2f}x")
    console.print(table)
    console.print(f"overall speed-up (end to end, incl. prefill): [bold]{total_plain / total_spec:.2f}x[/] "
                  f"over {total_tokens} tokens; outputs identical: {all_same}")
    return 0 if all_same else 1
