"""agentspec's vLLM proposer (``agentspec.integrations.vllm``) driven the way vLLM's model runner drives it —
a batch of token histories in a 2-D array, one draft chain per row — with the default model's tokenizer and
chat template (the proposer finds the tools and the answer's start in the rendered prompt). vLLM itself is not
needed: ``make test-vllm`` runs the proposer inside a live vLLM server."""

from __future__ import annotations

import numpy as np
import pytest

from agentspec.integrations.vllm import ToolCallDrafting, tools_from_prompt

pytestmark = pytest.mark.integration
QWEN = "qwen2.5-coder-0.5b-instruct"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from agentspec.models import offline_model_path

    gguf = offline_model_path(QWEN)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def prompt_ids(tok, question: str, tools=TOOLS) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def batch(histories: list[list[int]], width: int = 2048) -> tuple[list[list[int]], list[int], np.ndarray]:
    """vLLM's arguments: last step's sampled tokens, committed lengths, the token-id rows."""
    rows = np.zeros((len(histories), width), dtype=np.int32)
    for i, h in enumerate(histories):
        rows[i, : len(h)] = h
    return [[h[-1]] for h in histories], [len(h) for h in histories], rows


def decode_with(drafting: ToolCallDrafting, prompt: list[int], answer: list[int]) -> tuple[int, list[list[int]]]:
    """Commit ``answer`` step by step as a greedy verifier whose output is ``answer`` would: accept the draft's
    agreeing prefix plus one token. Returns the steps taken and the drafts."""
    hist, steps, drafts = prompt + answer[:1], 0, []
    while len(hist) < len(prompt) + len(answer):
        draft = drafting.propose(*batch([hist]))[0]
        assert len(draft) <= drafting.k
        drafts.append(draft)
        truth = answer[len(hist) - len(prompt):]
        k = 0
        while k < min(len(draft), len(truth)) and draft[k] == truth[k]:
            k += 1
        hist = hist + truth[: k + 1]
        steps += 1
    return steps, drafts


def test_tools_are_read_from_the_rendered_prompt(tok):
    text = tok.decode(prompt_ids(tok, "Weather in Paris?"))
    assert tools_from_prompt(text) == TOOLS
    assert tools_from_prompt(tok.decode(prompt_ids(tok, "Hi", tools=None))) is None
    assert tools_from_prompt("<tools>\nnot json\n{\"name\": 5}\n</tools>") is None  # nothing usable: no tools


def test_tool_call_spans_are_drafted_from_the_grammar(tok):
    prompt, answer = prompt_ids(tok, "Weather in Paris?"), tok.encode(CALL, add_special_tokens=False)
    drafting = ToolCallDrafting(tok, k=8, cross_request=False)
    steps, drafts = decode_with(drafting, prompt, answer)
    # after "<tool_call>" the grammar forces '\n{"name":' and, once "get_w" is written, the rest of the name
    # and '", "arguments": {"': a verifier accepting them needs far fewer steps than tokens
    assert tok.decode(drafts[0]).startswith('\n{"name":')
    assert any('", "arguments": {"' in tok.decode(d) for d in drafts), [tok.decode(d) for d in drafts]
    assert drafting.stats["forced_tokens"] >= 10 and drafting.stats["with_tools"] == 1
    assert steps <= len(answer) // 2, (steps, len(answer))
    # without tools in the prompt there is no grammar: only copies (none here), so every step drafts less
    plain = ToolCallDrafting(tok, k=8, cross_request=False)
    plain_steps, _ = decode_with(plain, prompt_ids(tok, "Weather in Paris?", tools=None), answer)
    assert plain.stats["forced_tokens"] == 0 and plain_steps > steps


def test_requests_keep_their_state_when_rows_move_and_skip_rows_without_a_sample(tok):
    a = prompt_ids(tok, "Weather in Paris?") + tok.encode("<tool_call>\n", add_special_tokens=False)
    b = prompt_ids(tok, "What time is it in Lima?") + tok.encode("<tool_call>\n", add_special_tokens=False)
    drafting = ToolCallDrafting(tok, k=6, max_model_len=len(b) + 3, cross_request=False)
    first = drafting.propose(*batch([a, b]))
    swapped = drafting.propose(*batch([b, a]))  # vLLM condenses its batch: a request may change rows
    assert swapped == first[::-1] and drafting.stats["requests"] == 2
    assert all(tok.decode(d).startswith('{"name":') for d in first), [tok.decode(d) for d in first]
    sampled, lengths, rows = batch([a, b])
    assert drafting.propose([[], sampled[1]], lengths, rows)[0] == []  # still prefilling: no draft
    long = b + [tok.encode("x", add_special_tokens=False)[0]] * 3
    assert drafting.propose(*batch([long]))[0] == []  # at the model's length limit: no draft


def test_finished_answers_are_copied_into_later_requests(tok):
    prompt, answer = prompt_ids(tok, "Weather in Paris?"), tok.encode(CALL, add_special_tokens=False)
    drafting = ToolCallDrafting(tok, k=8)
    first, _ = decode_with(drafting, prompt, answer)
    for _ in range(10):  # steps without the request: it has finished, its answer joins the index
        drafting.propose(*batch([prompt_ids(tok, "Hello")]))
    again = prompt_ids(tok, "And the weather in Paris?")
    second, _ = decode_with(drafting, again, answer)
    assert second < first, (second, first)
    isolated = ToolCallDrafting(tok, k=8, cross_request=False)
    decode_with(isolated, prompt, answer)
    for _ in range(10):
        isolated.propose(*batch([prompt_ids(tok, "Hello")]))
    assert decode_with(isolated, again, answer)[0] == first  # no index: nothing learnt across requests


def test_bad_arguments_are_refused(tok):
    with pytest.raises(ValueError, match="k"):
        ToolCallDrafting(tok, k=0)
