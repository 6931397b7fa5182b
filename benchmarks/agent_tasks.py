"""A deterministic tool environment for agent benchmarks: multi-step tasks with checkable end states.

Each :class:`World` is a fresh in-memory state (files, orders, a mailbox) with LangChain tools over it; a
:class:`Task` is a user request plus a check of the world and the agent's final answer after the run.
Every tool answers from fixed data, so two runs that make the same calls see the same results: a
speculative run's transcript can be compared with plain decoding's token for token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentspec.demo import FILES, make_tools

STATS_PY = FILES["stats.py"]  # the demo's project: a mean() that divides by len - 1
ORDERS = {
    "A-1042": {"order_id": "A-1042", "status": "shipped", "tracking_number": "1Z999AA10123456784",
               "customer": {"name": "Maria Santos", "email": "maria.santos@example.com"}},
    "B-2210": {"order_id": "B-2210", "status": "processing", "tracking_number": None,
               "customer": {"name": "Jon Berg", "email": "jon.berg@example.org"}},
}
EUR_PER = {"USD": 0.92, "EUR": 1.0, "JPY": 0.0061, "GBP": 1.17}  # fixed rates: EUR per unit


@dataclass
class World:
    """The environment one agent run acts on (a fresh copy per run)."""

    files: dict[str, str] = field(default_factory=lambda: {"stats.py": STATS_PY})
    sent: list[dict[str, str]] = field(default_factory=list)
    conversions: list[tuple[float, str, str]] = field(default_factory=list)

    def tools(self) -> list[Any]:
        """LangChain tools over this world."""
        from langchain_core.tools import tool

        @tool
        def get_order(order_id: str) -> str:
            """Look up an order by its id (e.g. A-1000): status, tracking number and customer."""
            order = ORDERS.get(order_id.strip().upper())
            return json.dumps(order) if order else f"error: no order {order_id!r}"

        @tool
        def send_email(to: str, subject: str, body: str) -> str:
            """Send an email to a customer."""
            self.sent.append({"to": to, "subject": subject, "body": body})
            return f"email sent to {to}"

        @tool
        def convert_currency(amount: float, from_currency: str, to_currency: str) -> str:
            """Convert an amount between currencies (ISO codes such as USD, EUR, JPY, GBP)."""
            src, dst = from_currency.strip().upper(), to_currency.strip().upper()
            if src not in EUR_PER or dst not in EUR_PER:
                return f"error: unknown currency {src if src not in EUR_PER else dst!r}"
            self.conversions.append((float(amount), src, dst))
            return json.dumps({"amount": amount, "from": src, "to": dst,
                               "result": round(float(amount) * EUR_PER[src] / EUR_PER[dst], 2)})

        return [*make_tools(self.files), get_order, send_email, convert_currency]  # the demo's three first


def _mentions(answer: str, *needles: str) -> bool:
    """The answer is prose for the user that names every needle. A tool call written as text, or a tool
    result pasted back (JSON, a ``<tool_response>`` block, a fence) answers no one, even if it holds the facts."""
    if answer.lstrip().startswith(("{", "[", "<", "```")):
        return False
    flat = answer.replace(",", "").replace("\u2212", "-").lower()
    return all(n.lower() in flat for n in needles)


def _weather_ok(world: World, answer: str) -> bool:
    return _mentions(answer, "21", "-3")


def _status_ok(world: World, answer: str) -> bool:
    return _mentions(answer, "processing", "Jon Berg")


def _email_ok(world: World, answer: str) -> bool:
    return any(m["to"].strip().lower() == "maria.santos@example.com" and "1Z999AA10123456784" in m["body"]
               for m in world.sent)


def _fix_ok(world: World, answer: str) -> bool:
    scope: dict[str, Any] = {}
    try:
        exec(compile(world.files.get("stats.py", ""), "stats.py", "exec"), scope)  # the agent's own file
        return scope["mean"]([1, 2, 3]) == 2 and scope["mean"]([4]) == 4 and scope["clamp"](5, 0, 3) == 3
    except (Exception, SystemExit):  # whatever the agent wrote, the check answers (a sys.exit included)
        return False


def _convert_ok(world: World, answer: str) -> bool:
    done = {(a, s, d) for a, s, d in world.conversions}
    return {(250.0, "USD", "EUR"), (250.0, "USD", "JPY")} <= done and _mentions(answer, "230", "37704.92")


@dataclass(frozen=True)
class Task:
    """A user request and the check of a finished run (the world after it, the agent's last answer)."""

    id: str
    prompt: str
    check: Callable[[World, str], bool]


TASKS = (
    Task("weather", "What is the weather in Lisbon and in Oslo right now, in celsius?", _weather_ok),
    Task("order_status", "What is the status of order B-2210, and who is its customer?", _status_ok),
    Task("order_email", "Order A-1042 has shipped. Look it up and email the customer their tracking number.",
         _email_ok),
    Task("fix_mean", "The mean function in stats.py returns the wrong value. Read the file, then fix the bug "
         "by writing the corrected file.", _fix_ok),
    Task("convert", "How much are 250 US dollars in euros and in Japanese yen?", _convert_ok),
)


def final_answer(messages: list[Any]) -> str:
    """The text of the agent's last AI message ('' when the run ended on a tool call)."""
    for m in reversed(messages):
        if getattr(m, "type", "") == "ai":
            return "" if getattr(m, "tool_calls", None) else str(m.content)
    return ""
