"""Judging the agent benchmark's bf16 divergences: was each place where a run parted from plain a rounding tie?

A bf16 run may commit another token than plain where the target's top two logits are closer than its
computation path can move them: a verify pass over several rows, a prefill split elsewhere, rounds differently
from one-token decoding, and every later position reads the keys and values that pass wrote. The runs' own
logprob margins show how close each choice was, but not how far the path moves logits at that context. This
measures it there, with the project's rule (:func:`agentspec.equivalence.judge_divergence`): the message's
context is rebuilt from plain's transcript (the agent's system prompt, the world's tools, the messages before,
plain's tokens of the message up to the divergence), the target's fresh bf16 logits there give the margin, and
:func:`agentspec.models.logit_path_noise` over the message's last ``WINDOW`` tokens, at the pass sizes an edge
round verifies (``CHUNKS``), gives the noise. A tie: both chosen tokens within max(``TIE_ULPS`` bf16 ulps, twice
the noise) of the top logit. A divergence whose tokens cannot be rebuilt is left unjudged (not a tie).
"""

from __future__ import annotations

import json
from typing import Any

from agentspec import models
from agentspec.adapters.langchain_io import to_chat_messages
from agentspec.equivalence import judge_divergence
from agentspec.toolcalls import render_chat

WINDOW = 16  # positions of the message, ending at the divergence, the path noise is measured over
CHUNKS = (2, 4, 8)  # verify pass sizes (the tree's rows) the noise is measured at, beside one-token decoding
TIE_ULPS = 1.0


def messages_before(transcript: str, index: int, system_prompt: str | None) -> list[Any]:
    """LangChain messages an agent sent for its ``index``-th message (a transcript from ``run_task``)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    out: list[Any] = [SystemMessage(system_prompt)] if system_prompt else []
    calls = 0  # ids pair each tool result with its call; chat templates do not render them
    for kind, content, tool_calls in json.loads(transcript)[0][:index]:
        if kind == "human":
            out.append(HumanMessage(content))
        elif kind == "ai":
            made = [{"name": n, "args": a, "id": f"call_{calls + k}"} for k, (n, a) in enumerate(json.loads(tool_calls))]
            out.append(AIMessage(content, tool_calls=made))
        elif kind == "tool":
            out.append(ToolMessage(content, tool_call_id=f"call_{calls}"))
            calls += 1
        else:
            raise ValueError(f"transcript message {kind!r} is not one run_task records")
    return out


def token_ids(tokenizer: Any, pieces: list[str]) -> list[int] | None:
    """The ids of tokens known by their texts (a run's logprobs): their joined text re-encoded, if that gives
    back the same pieces; else ``None`` (a split that encoding does not reproduce)."""
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    return ids if [tokenizer.decode([t]) for t in ids] == pieces else None


def judge(target: models.LoadedModel, run: dict[str, Any], ref: dict[str, Any], where: dict[str, Any],
          tools: list[dict[str, Any]], system_prompt: str | None, memo: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """The verdict on one divergence (``where``: :func:`benchmarks.agent.divergence`'s record, between ``run``
    and plain's ``ref``); ``memo`` keeps verdicts by context (the same divergence recurs across RTTs)."""
    i, j = where["message"], where["token"]
    if j is None:
        return {"verdict": "unjudged", "why": where["why"]}
    tok = target.tokenizer
    mine, plain = [e[0] for e in run["logprobs"][i]], [e[0] for e in ref["logprobs"][i]]
    prefix = token_ids(tok, plain[:j])
    if prefix is None:
        return {"verdict": "unjudged", "why": "plain's tokens before the divergence do not re-encode as they ran"}
    prompt = render_chat(tok, to_chat_messages(messages_before(ref["transcript"], i, system_prompt)), tools, True)
    key = (tuple(prompt), tuple(prefix), mine[j] if j < len(mine) else None, plain[j] if j < len(plain) else None)
    if key in memo:
        return memo[key]
    logits = models.logits_at(target.model, prompt + prefix)
    ends = max(target.eos_token_ids, key=lambda t: float(logits[t]), default=None)  # the stop the target favours

    def chosen(pieces: list[str]) -> int | None:  # the token a run chose at the divergence (a stop: the end)
        if j >= len(pieces):
            return ends
        one = token_ids(tok, [pieces[j]])
        return one[0] if one and len(one) == 1 else None

    a, b = chosen(mine), chosen(plain)
    if a is None or b is None:
        memo[key] = {"verdict": "unjudged", "why": "a chosen token does not re-encode as one token"}
        return memo[key]
    start = max(0, len(prefix) + 1 - WINDOW)  # noise over the message's last WINDOW tokens, ending at plain's
    window = (prefix + [b])[start:]
    noise = models.logit_path_noise(target.model, prompt + prefix[:start], window, CHUNKS)["max_abs"]
    verdict = judge_divergence(logits, prefix + [b], prefix + [a], len(prefix), True, TIE_ULPS, noise)
    memo[key] = {"verdict": verdict["verdict"].lower(), "margin": round(verdict["margin"], 4),
                 "worst_gap": round(verdict["worst_gap"], 4), "path_noise": round(noise, 4),
                 "tie_threshold": round(verdict["tie_threshold"], 4), "prompt_tokens": len(prompt) + len(prefix)}
    return memo[key]


def judge_all(target: models.LoadedModel, result: dict[str, Any], tools: list[dict[str, Any]],
              system_prompt: str | None) -> int:
    """Adds a ``"judged"`` verdict to every bf16 divergence record in ``result["rtt"]``; returns how many."""
    memo: dict[Any, dict[str, Any]] = {}
    n = 0
    for r, block in result["rtt"].items():
        runs = result["runs"][f"bf16-{r}"]
        for m, summary in block["methods"].items():
            for t, where in summary["divergences"].items():
                where["judged"] = judge(target, runs[m][t], runs["plain"][t], where, tools, system_prompt, memo)
                n += 1
    return n
