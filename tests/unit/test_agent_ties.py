"""The agent benchmark's divergence judge: the context it rebuilds is the one the agent sent, its margin is the
target's there, and only a choice within the path noise of the top logit is a tie."""

from __future__ import annotations

import copy
import json

import torch

from agentspec import models
from agentspec.toolcalls import render_chat
from benchmarks import agent_ties
from tests.helpers import make_prompt, plain_greedy

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [["human", "Weather in Oslo?", "[]"], ["ai", "", json.dumps([["get_weather", {"city": "Oslo"}]])],
            ["tool", '{"temp": -3}', "[]"], ["ai", "Oslo is cold.", "[]"]]
TRANSCRIPT = json.dumps([MESSAGES, {}, [], []])
PLAIN = list("Oslo is cold.")


def by_hand(tokenizer) -> list[int]:
    """The prompt of message 3 from OpenAI-style dicts written out here, not rebuilt from the transcript."""
    chat = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "x"}]
    return render_chat(tokenizer, chat, TOOLS, True)


def runs(plain: list[str], other: list[str]) -> tuple[dict, dict]:
    ref = {"transcript": TRANSCRIPT, "logprobs": [None, [], None, [[p, []] for p in plain]]}
    return {"logprobs": [None, [], None, [[p, []] for p in other]]}, ref


def test_path_noise_is_rounding_only_and_one_prefill_serves_every_pass_size(target):
    prompt = make_prompt(3)
    gen = plain_greedy(target, prompt, 12, eos=None)
    noise = models.logit_path_noise(target.model, prompt, gen, (2, 5))
    # fp32: the paths agree to rounding; a prefix cache copied wrongly would move logits by whole units
    assert noise["positions"] == len(gen) and 0.0 <= noise["max_abs"] < 1e-3


def test_the_judge_rebuilds_the_agents_context_and_calls_a_far_choice_a_failure(target):
    tok = target.tokenizer
    rebuilt = agent_ties.messages_before(TRANSCRIPT, 3, "Use tools.")
    assert [m.type for m in rebuilt] == ["system", "human", "ai", "tool"]
    logits = models.logits_at(target.model, by_hand(tok) + tok.encode("Oslo", add_special_tokens=False))
    far = tok.decode([int(logits.argmin())])
    run, ref = runs(PLAIN, PLAIN[:4] + [far, "x"])
    judged = agent_ties.judge(target, run, ref, {"message": 3, "token": 4}, TOOLS, "Use tools.", {})
    top = torch.topk(logits, 2).values
    assert judged["margin"] == round(float(top[0] - top[1]), 4)  # the context the agent sent, not another
    assert judged["worst_gap"] == round(float(top[0] - logits.min()), 4)
    assert judged["verdict"] == "failure" and judged["path_noise"] < 1e-3


def test_two_tokens_the_target_cannot_tell_apart_are_a_tie_and_a_stop_against_text_is_not(target):
    tok = target.tokenizer
    prompt = by_hand(tok) + tok.encode("Oslo", add_special_tokens=False)
    top = int(models.logits_at(target.model, prompt).argmax())
    twin = next(t for t in map(tok.convert_tokens_to_ids, "QZ#") if t not in prompt)
    same = copy.copy(target)  # a head whose row for `twin` is `top`'s: their logits are equal everywhere
    same.model = copy.deepcopy(target.model)
    with torch.no_grad():
        same.model.lm_head.weight[twin] = same.model.lm_head.weight[top]
    plain = PLAIN[:4] + [tok.decode([top])]
    run, ref = runs(plain, PLAIN[:4] + [tok.decode([twin])])
    judged = agent_ties.judge(same, run, ref, {"message": 3, "token": 4}, TOOLS, "Use tools.", {})
    assert judged["verdict"] == "tie" and judged["worst_gap"] == 0.0
    stopped, _ = runs(PLAIN[:4], [])  # this run ended its message where plain went on
    judged = agent_ties.judge(same, stopped, ref, {"message": 3, "token": 4}, TOOLS, "Use tools.", {})
    assert judged["verdict"] == "failure"


def test_pieces_that_do_not_re_encode_leave_a_divergence_unjudged_and_verdicts_are_shared(target):
    run, ref = runs(["Os", "lo"] + PLAIN[4:], PLAIN)  # "Os" is two tokens of the char tokenizer
    judged = agent_ties.judge(target, run, ref, {"message": 3, "token": 4}, TOOLS, None, {})
    assert judged == {"verdict": "unjudged", "why": "plain's tokens before the divergence do not re-encode as they ran"}
    run, ref = runs(PLAIN, PLAIN[:6] + ["z"])
    where = {"message": 3, "token": 6}
    result = {"rtt": {r: {"methods": {"edge": {"divergences": {"weather": dict(where)}}}} for r in ("0", "50")},
              "runs": {f"bf16-{r}": {"edge": {"weather": run}, "plain": {"weather": ref}} for r in ("0", "50")}}
    assert agent_ties.judge_all(target, result, TOOLS, None) == 2
    a, b = (result["rtt"][r]["methods"]["edge"]["divergences"]["weather"]["judged"] for r in ("0", "50"))
    assert a is b and a["verdict"] in ("tie", "failure")  # one context, measured once
