"""Tool-call drafting: grammar-forced tokens, copy drafting, the merged tree — and losslessness when the
target follows the grammar, leaves it, or never enters it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentspec.drafters import DraftContext, make_drafter
from agentspec.drafters.copy import CopyDrafter, SuffixIndex
from agentspec.drafters.grammar import GrammarDrafter
from agentspec.drafters.tree import TreeDrafter, _paths, default_drafter
from agentspec.local import SpecEngine
from agentspec.models import LoadedModel
from agentspec.router import DraftLengthPolicy
from agentspec.text import IncrementalDecoder
from agentspec.toolcalls import ToolCallParser
from agentspec.types import DraftProposal, SamplingParams
from tests.helpers import make_prompt, masked_plain_greedy, plain_greedy, tiny_model
from tests.unit.test_toolcalls import text_and_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "dict", "properties": {"city": {"type": "string"},
                                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def _byte_tokenizer():
    """A byte-level tokenizer with no merges: every UTF-8 byte is one token, so multi-byte characters
    and tags are always split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    t = Tokenizer(models.BPE(vocab, [], unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t)


BYTE_TOK = _byte_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return BYTE_TOK


@pytest.fixture(scope="module")
def byte_target():
    """A tiny random target over the byte-level vocabulary (tags, newlines and JSON are all spellable)."""
    base = tiny_model(seed=5, vocab=len(BYTE_TOK))
    return LoadedModel(base.model, BYTE_TOK, "tiny-bytes", base.device, base.dtype)


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def forced_text(tok, drafter, prompt: list[int], generated: str, **structure) -> str:
    ctx = DraftContext(prompt + ids(tok, generated), len(prompt), tools=TOOLS, **structure)
    return tok.decode(drafter.forced(ctx))


def test_grammar_forces_the_call_skeleton(tok):
    prompt = ids(tok, "<user>weather in Paris?\n<assistant>")
    g = GrammarDrafter(tok, max_forced=64)  # byte tokens: long forced runs
    assert forced_text(tok, g, prompt, "Let me") == ""  # free text: no grammar engaged
    assert forced_text(tok, g, prompt, "<tool_call>") == '\n{'  # then compact or indented
    assert forced_text(tok, g, prompt, '<tool_call>\n{"') == 'name": "get_'  # both names start "get_"
    assert forced_text(tok, g, prompt, '<tool_call>\n{"name": "get_w') == 'eather", "arguments": {"city": "'
    assert forced_text(tok, g, prompt, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"'
                       ) == ', "unit": "'
    assert forced_text(tok, g, prompt, CALL[: CALL.index("celsius") + 2]) == 'lsius"}}\n</tool_call>'
    assert forced_text(tok, g, prompt, '```json') == '\n'  # a fenced call
    assert forced_text(tok, g, prompt, '```json\n{"name": "get_t') == 'ime", "arguments": {"tz": "'
    # pretty-printed with two-space indents (what Qwen2.5-Coder writes in a fence): whitespace is forced too
    assert forced_text(tok, g, prompt, '```json\n{\n') == '  "name": "get_'
    assert forced_text(tok, g, prompt, '```json\n{\n  "name": "get_t') == (
        'ime",\n  "arguments": {\n    "tz": "')
    assert forced_text(tok, g, prompt, '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "tz": "UTC"'
                       ) == '\n  }\n}\n```'
    assert forced_text(tok, g, prompt, '{"name": "get_t') == 'ime", "arguments": {"tz": "'  # bare JSON


def test_grammar_respects_tool_choice_and_response_format(tok):
    prompt = ids(tok, "<user>hi\n<assistant>")
    g = GrammarDrafter(tok, max_forced=64)  # byte tokens: a long forced run
    assert forced_text(tok, g, prompt, "") == ""  # auto: the answer may be text
    named = {"type": "function", "function": {"name": "get_time"}}
    assert forced_text(tok, g, prompt, "", tool_choice=named) == '<tool_call>\n{'
    assert forced_text(tok, g, prompt, '<tool_call>\n{"', tool_choice=named) == (
        'name": "get_time", "arguments": {"tz": "')
    assert forced_text(tok, g, prompt, "", tool_choice="required") == '<tool_call>\n{'
    assert forced_text(tok, g, prompt, "<tool_call>", tool_choice="none") == ""
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}
    ctx = DraftContext(prompt, len(prompt), response_format=schema)
    assert tok.decode(g.forced(ctx)) == "{"  # compact or indented: open
    ctx = DraftContext(prompt + ids(tok, "{\n"), len(prompt), response_format=schema)
    assert tok.decode(g.forced(ctx)) == '  "answer": '


def test_grammar_drops_out_when_the_target_leaves_it_and_re_engages(tok):
    prompt = ids(tok, "<user>hi\n<assistant>")
    g = GrammarDrafter(tok)
    assert forced_text(tok, g, prompt, '<tool_call>\n{"name": "ge') == "t_"
    assert forced_text(tok, g, prompt, '<tool_call>\n{"name": "get_xyz') == ""  # not a tool: grammar left
    assert g.left_grammar == 1
    later = '<tool_call>\n{"name": "get_xyz"}\n</tool_call>\n<tool_call>'
    assert forced_text(tok, g, prompt, later) == '\n{'  # the next opening engages again
    # the grammar filters other drafters' proposals to the prefix it allows
    forced_text(tok, g, prompt, '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}')
    assert g.valid_prefix(ids(tok, '}\n</tool_call>')) == len('}\n</tool_call>')
    assert g.valid_prefix(ids(tok, ', "x": 1}')) == 0


def test_copy_drafter_match_length_aware_and_cross_conversation(tok):
    prompt = ids(tok, "<user>book flight LH-4410-ZRH please\n<assistant>")
    copy = CopyDrafter(max_candidates=2)
    ctx = DraftContext(prompt + ids(tok, 'flight LH'), len(prompt))
    (n, cont), *_ = copy.candidates(ctx, 16)
    assert n == len("flight LH") and tok.decode(cont) == "-4410-ZRH please\n<"[: len(cont)]
    assert len(cont) == 16  # a long match proposes the full k
    short = copy.candidates(DraftContext(prompt + ids(tok, "zzzk"), len(prompt)), 16)
    assert short[0][0] == 1 and len(short[0][1]) == 1  # a 1-token match proposes 1 token
    # the per-key index: another conversation's output is a copy source for the same key only
    index = SuffixIndex(max_tokens=64)
    copy = CopyDrafter(index=index)
    done = DraftContext(prompt + ids(tok, "result: QX-778-ALPHA-3"), len(prompt), index_key="alice")
    copy.remember(done)
    other = ids(tok, "<user>again\n<assistant>result: QX")
    assert tok.decode(copy.propose(DraftContext(other, 20, index_key="alice"), 8).tokens).startswith("-778")
    assert not copy.propose(DraftContext(other, 20, index_key="bob"), 8).tokens
    for i in range(10):  # bounded: old outputs go first
        index.add(ids(tok, f"output number {i} with padding"), "alice")
    assert index.num_tokens <= 64 and len(index.sources("alice")) == 2


def test_tree_merges_forced_span_and_candidates_under_the_budget(tok):
    prompt = ids(tok, "<user>weather in Paris or in Parma?\n<assistant>")
    tree = TreeDrafter(GrammarDrafter(tok), CopyDrafter(max_candidates=3), max_forced=32)
    generated = ids(tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    ctx = DraftContext(prompt + generated, len(prompt), tools=TOOLS)
    chain = tree.propose(ctx, 3)
    assert chain.num_forced == 0 and not chain.is_tree and len(chain) <= 3
    assert tree.set_verify_costs({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.6}) == 3  # 4 tokens per pass stay flat
    wide = tree.propose(ctx, 3)
    assert wide.is_tree and len(wide) <= 3 + 3
    leaves = {tok.decode(list(p)) for p in _paths(wide)}
    assert {"is ", "ma?"} <= leaves  # both cities' continuations, verified in one pass
    ctx = DraftContext(prompt + ids(tok, '<tool_call>\n{"name": "get_t'), len(prompt), tools=TOOLS)
    prop = tree.propose(ctx, 0)  # forced tokens ride along even when the policy chose γ = 0
    assert tok.decode(list(prop.tokens)) == 'ime", "arguments": {"tz": "' and prop.num_forced == len(prop)
    with pytest.raises(ValueError):
        DraftProposal(tokens=(1, 2), num_forced=3)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tree_drafting_is_lossless_when_the_target_ignores_the_grammar(target, tool_choice):
    """A random target never writes the call the grammar expects. "auto": the grammar drops out and the
    output is plain greedy; "required" constrains the answer: it is masked plain greedy."""
    prompt = make_prompt(3)
    tree = default_drafter(target.tokenizer)
    engine = SpecEngine(target, tree, num_draft_tokens=4, draft_policy=DraftLengthPolicy())
    out = engine.generate(prompt, SamplingParams(max_new_tokens=40), tools=TOOLS, tool_choice=tool_choice)
    if tool_choice == "auto":
        assert out.tokens == plain_greedy(target, prompt, 40)
    else:
        assert out.tokens == masked_plain_greedy(target, prompt, 40, tools=TOOLS, tool_choice="required")
        # the char vocabulary has no newline: the grammar dead-ends after the tag and the answer stops there
        assert out.text == "<tool_call>" and out.finish_reason == "stop"


def test_tree_drafting_is_lossless_when_the_target_writes_calls(byte_target, tok):
    """The target continues a conversation whose history holds calls; the committed tokens enter and leave
    the grammar as the target pleases, drafts are forced spans + copies: output = plain greedy."""
    history = f"<user>weather?\n<assistant>{CALL}\n<user>and time?\n<assistant>"
    for text in (history, history + "<tool_call>", history + CALL[:30]):
        prompt = ids(tok, text)
        reference = plain_greedy(byte_target, prompt, 40, eos=None)
        tree = default_drafter(tok)
        engine = SpecEngine(byte_target, tree, num_draft_tokens=6, stop_token_ids=[])
        for _ in range(2):  # the second run also copies from the first output (cross-conversation index)
            out = engine.generate(prompt, SamplingParams(max_new_tokens=40), tools=TOOLS)
            assert out.tokens == reference
        if text.endswith("<tool_call>"):  # a prefilled opening: forced drafts, then the target left them
            assert tree.grammar.left_grammar >= 1


def test_make_drafter_knows_the_new_drafters(tok):
    assert isinstance(make_drafter("copy"), CopyDrafter)
    assert isinstance(make_drafter("grammar", tokenizer=tok), GrammarDrafter)
    assert isinstance(make_drafter("tree"), TreeDrafter)
    with pytest.raises(ValueError):
        GrammarDrafter(None)


# -- token-level chunking: committed ids in any grouping → the same text and calls ---------------------

TOKEN_TEXTS = [
    'Voilà ☀️: <tool_call>\n{"name": "météo", "arguments": {"ville": "Zürich 東京"}}\n</tool_call>',
    '```json\n[{"name": "a", "arguments": {"k": "ß"}}, {"name": "b", "arguments": {}}]\n```',
]


def _decode_parse(token_ids: list[int], cuts: list[int]) -> tuple[str, list[tuple[str, dict]]]:
    dec, parser, events = IncrementalDecoder(BYTE_TOK), ToolCallParser(), []
    points = sorted({c % (len(token_ids) + 1) for c in cuts} | {0, len(token_ids)})
    for a, b in zip(points, points[1:], strict=False):
        events += parser.feed(dec.add(token_ids[a:b]))
    return text_and_calls(events + parser.finish())


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(range(len(TOKEN_TEXTS))), st.lists(st.integers(min_value=0, max_value=300), max_size=40))
def test_any_token_chunking_gives_the_same_calls(i, cuts):
    token_ids = BYTE_TOK(TOKEN_TEXTS[i], add_special_tokens=False)["input_ids"]
    assert BYTE_TOK.decode(token_ids) == TOKEN_TEXTS[i]
    result = _decode_parse(token_ids, cuts)
    assert result == _decode_parse(token_ids, [])
    assert result[1] and all(isinstance(args, dict) for _, args in result[1])


def test_prepare_compiles_the_grammar_ahead_and_changes_no_draft(tok):
    """``prepare`` is the set-up a timed proposal runs first (the edge client keeps it out of the drafting
    seconds the router prices rounds by): after it the grammar is compiled, and the draft is the same."""
    prompt = ids(tok, "<user>weather in Paris?\n<assistant>")
    ctx = DraftContext(prompt + ids(tok, '<tool_call>\n{"name": "get_w'), len(prompt), tools=TOOLS)
    fresh, prepared = default_drafter(tok), default_drafter(tok)
    prepared.prepare(ctx)
    assert len(prepared.grammar._grammars) == 1 and not fresh.grammar._grammars
    assert prepared.propose(ctx, 4).tokens == fresh.propose(ctx, 4).tokens
    assert tok.decode(list(prepared.propose(ctx, 4).tokens)).startswith('eather", "argume')  # max_forced: 16
