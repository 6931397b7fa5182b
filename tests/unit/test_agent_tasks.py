"""The agent benchmark's tool world: deterministic tools, and checks that tell a done task from an undone one."""

from __future__ import annotations

import json

import pytest

from benchmarks.agent_tasks import STATS_PY, TASKS, World, final_answer


def tools(world: World) -> dict:
    return {t.name: t for t in world.tools()}


def test_tools_answer_from_fixed_data() -> None:
    a, b = tools(World()), tools(World())
    for name, args in (("get_weather", {"city": "Lisbon"}), ("get_order", {"order_id": "a-1042"}),
                       ("convert_currency", {"amount": 250, "from_currency": "usd", "to_currency": "JPY"}),
                       ("read_file", {"path": "stats.py"})):
        assert a[name].invoke(args) == b[name].invoke(args)
    assert json.loads(a["convert_currency"].invoke({"amount": 250, "from_currency": "USD", "to_currency": "JPY"})
                      )["result"] == 37704.92
    assert a["get_order"].invoke({"order_id": "Z-1"}).startswith("error:")
    assert a["get_weather"].invoke({"city": "Atlantis"}).startswith("error:")


def test_worlds_are_independent() -> None:
    one, two = World(), World()
    tools(one)["write_file"].invoke({"path": "stats.py", "content": "x = 1\n"})
    assert one.files["stats.py"] == "x = 1\n" and two.files["stats.py"] == STATS_PY


FIXED = STATS_PY.replace("(len(values) - 1)", "len(values)")


@pytest.mark.parametrize(("task_id", "act", "answer"), [
    ("weather", lambda t: None, "Lisbon is 21 °C and Oslo is −3 °C."),
    ("order_status", lambda t: None, "Order B-2210 is processing; the customer is Jon Berg."),
    ("order_email", lambda t: t["send_email"].invoke({"to": "maria.santos@example.com", "subject": "Shipped",
                                                     "body": "Tracking: 1Z999AA10123456784"}), ""),
    ("fix_mean", lambda t: t["write_file"].invoke({"path": "stats.py", "content": FIXED}), ""),
    ("convert", lambda t: [t["convert_currency"].invoke({"amount": 250, "from_currency": "USD", "to_currency": c})
                           for c in ("EUR", "JPY")], "230.0 EUR and 37,704.92 JPY"),
])
def test_each_check_passes_when_done_and_fails_when_not(task_id: str, act, answer: str) -> None:
    task = next(t for t in TASKS if t.id == task_id)
    assert not task.check(World(), ""), "an untouched world with no answer must not count as done"
    world = World()
    act(tools(world))
    assert task.check(world, answer)


def test_wrong_end_states_fail() -> None:
    checks = {t.id: t.check for t in TASKS}
    w = World()
    tools(w)["send_email"].invoke({"to": "someone@example.com", "subject": "s", "body": "1Z999AA10123456784"})
    assert not checks["order_email"](w, "")
    w = World()
    tools(w)["write_file"].invoke({"path": "stats.py", "content": "def mean(v):\n    raise SystemExit\n"})
    assert not checks["fix_mean"](w, "")
    assert not checks["weather"](World(), "Lisbon is 21 °C.")
    pasted = '{"order_id": "B-2210", "status": "processing", "customer": {"name": "Jon Berg"}}'
    for text in (pasted, f"<tool_response>\n{pasted}\n</tool_response>", f"```json\n{pasted}\n```"):
        assert not checks["order_status"](World(), text), "a pasted tool result is not an answer"
    assert checks["order_status"](World(), "It is processing; the customer is Jon Berg.")


def test_final_answer_is_the_last_ai_text() -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    assert final_answer([HumanMessage("q"), AIMessage("done")]) == "done"
    assert final_answer([HumanMessage("q"), AIMessage("", tool_calls=[{"name": "f", "args": {}, "id": "1"}])]) == ""


def _run(messages: list, choices: list) -> dict:
    return {"transcript": json.dumps([messages, {}, [], []]), "logprobs": choices}


def test_divergence_names_the_message_token_and_both_margins() -> None:
    from benchmarks.agent import divergence

    human = ["human", "hi", "[]"]
    plain = _run([human, ["ai", "ab", "[]"]], [None, [["a", [("a", -0.1), ("x", -2.0)]],
                                                       ["b", [("b", -0.50), ("c", -0.52)]]]])
    spec = _run([human, ["ai", "ac", "[]"]], [None, [["a", [("a", -0.1), ("x", -2.0)]],
                                                      ["c", [("c", -0.49), ("b", -0.51)]]]])
    d = divergence(spec, plain)
    assert (d["message"], d["token"]) == (1, 1)
    assert d["plain"] == {"chose": "b", "top2": ["b", "c"], "margin": 0.02}
    assert d["this"] == {"chose": "c", "top2": ["c", "b"], "margin": 0.02}


def test_divergence_where_one_run_stops_or_a_tool_result_differs() -> None:
    from benchmarks.agent import divergence

    human = ["human", "hi", "[]"]
    longer = _run([human, ["ai", "ab", "[]"]], [None, [["a", [("a", 0.0), ("b", -3.0)]],
                                                        ["b", [("b", 0.0), ("c", -3.0)]]]])
    shorter = _run([human, ["ai", "a", "[]"]], [None, [["a", [("a", 0.0), ("b", -3.0)]]]])
    assert divergence(shorter, longer) == {"message": 1, "token": 1, "why": "one run ended its message here"}
    tool_a = _run([human, ["tool", "1", "[]"]], [None, None])
    tool_b = _run([human, ["tool", "2", "[]"]], [None, None])
    assert divergence(tool_a, tool_b)["token"] is None

