"""Constrained decoding (a required/named tool_choice, a JSON response_format) under speculation.

Greedy: every drafter, tree shape and a drafter that proposes what the grammar forbids give output equal to
masked plain greedy (:func:`tests.helpers.masked_plain_greedy`, one full forward per token, llguidance
driven directly). Sampled: the output's law is the masked, renormalised target (total variation against
the exact law, enumerated). Jump-forward takes single-choice tokens without a pass, and its output is the
same.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from agentspec.constraint import Constraint, ConstraintError, wants_constraint
from agentspec.drafters import make_drafter
from agentspec.drafters.base import DraftContext, propose_round
from agentspec.local import SpecEngine
from agentspec.models import LoadedModel
from agentspec.toolcalls import ToolCallParser
from agentspec.types import DraftProposal, SamplingParams, SparseDist
from tests.helpers import EOS, masked_plain_greedy, tiny_model


def _bpe_tokenizer():
    """A byte-level BPE trained in memory on JSON-ish text: merged tokens (``{"``, ``name``...) make several
    tokenisations of one text valid, so the grammar's masks are rarely a single token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [json.dumps({"name": n, "arguments": {"city": c, "unit": u, "days": d}}, indent=i)
              for n in ("get_weather", "get_time", "book_flight") for c in ("Paris", "Lisbon", "Tokyo")
              for u in ("celsius", "fahrenheit") for d in (1, 7) for i in (None, 2)]
    corpus += ["<tool_call>\n" + line + "\n</tool_call>" for line in corpus[:8]]
    t = Tokenizer(models.BPE(unk_token=None))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")


BPE = _bpe_tokenizer()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "dict", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]
SCHEMAS = {
    "object": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                "ok": {"type": "boolean"}, "tags": {
                                                    "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
               "required": ["city", "ok"]},
    "refs": {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                              "additionalProperties": False}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/pt"}, "q": {"anyOf": [{"type": "null"},
                                                                                         {"const": 3}]}},
             "required": ["p", "q"], "additionalProperties": False},
}
STRUCTURES = {
    "required": {"tools": TOOLS, "tool_choice": "required"},
    "named": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    **{f"schema-{k}": {"response_format": {"type": "json_schema", "json_schema": {"name": k, "schema": v}}}
       for k, v in SCHEMAS.items()},
    "json_object": {"response_format": {"type": "json_object"}},
}


@pytest.fixture(scope="module")
def bpe_target() -> LoadedModel:
    base = tiny_model(seed=11, vocab=len(BPE))
    return LoadedModel(base.model, BPE, "tiny-bpe", base.device, base.dtype)


@pytest.fixture(scope="module")
def bpe_drafter_model() -> LoadedModel:
    base = tiny_model(seed=12, layers=1, vocab=len(BPE))
    return LoadedModel(base.model, BPE, "tiny-bpe-draft", base.device, base.dtype)


class Scrambler:
    """A wrong drafter: the real drafter's proposal with random tokens spliced in (chains and trees), some
    of which the grammar forbids — a client that does not respect the grammar."""

    name = "scrambler"

    def __init__(self, inner, vocab: int, seed: int) -> None:
        self.inner, self.vocab, self.rng = inner, vocab, random.Random(seed)

    def reset(self) -> None:
        self.inner.reset()

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        prop = self.inner.propose(ctx, k)
        tokens, parents = list(prop.tokens), list(prop.parent_list())
        probs = list(prop.draft_probs) if prop.draft_probs is not None else [None] * len(tokens)
        for _ in range(3):  # random tokens are point masses: deterministic, as a wrong client's would be
            tokens.append(self.rng.randrange(self.vocab))
            parents.append(self.rng.randrange(-1, len(tokens) - 1))
            probs.append(None)
        sampled = prop.draft_probs is not None
        return DraftProposal(tuple(tokens), tuple(parents), tuple(probs) if sampled else None, source=self.name)


def _prompt(tok, text: str = "<user>weather in Paris?\n<assistant>") -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _drafters(target: LoadedModel, drafter_model: LoadedModel):
    tok = target.tokenizer
    model = make_drafter("model", model=drafter_model)
    return {
        "plain": None,
        "ngram": make_drafter("ngram"),
        "model": model,
        "tree": make_drafter("default", tokenizer=tok, model=make_drafter("model", model=drafter_model,
                                                                           tree_width=2)),
        "scrambled": Scrambler(make_drafter("default", tokenizer=tok), len(tok), seed=3),
    }


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_greedy_constrained_output_is_masked_plain_greedy(bpe_target, bpe_drafter_model, structure):
    spec = STRUCTURES[structure]
    prompt = _prompt(BPE)
    reference = masked_plain_greedy(bpe_target, prompt, 48, **spec)
    for name, drafter in _drafters(bpe_target, bpe_drafter_model).items():
        engine = SpecEngine(bpe_target, drafter, num_draft_tokens=4)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=48), **spec)
        assert out.tokens == reference, (structure, name)
    if reference[-1] == EOS:  # a finished answer is valid for its structure
        _check_valid(BPE.decode(reference[:-1]), spec)


def _check_valid(text: str, spec: dict) -> None:
    rf = spec.get("response_format")
    if rf is not None:
        value = json.loads(text)
        jsonschema.validate(value, rf.get("json_schema", {}).get("schema", {"type": "object"}))
        return
    parser = ToolCallParser(tools_enabled=True)
    events = parser.feed(text) + parser.finish()
    calls = [e.call for e in events if e.call is not None]
    assert calls and not "".join(e.text for e in events if e.text).strip()
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        schema = json.loads(json.dumps(params[call.name]).replace('"dict"', '"object"'))
        jsonschema.validate(json.loads(call.arguments), schema)


def test_jump_forward_takes_single_choice_tokens_without_a_pass(target):
    """One character per token: every literal of the schema (keys, braces, the enum's tail) has one
    choice, taken without the target; the output is masked plain greedy all the same."""
    spec = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "n": {"type": "integer"}},
        "required": ["unit", "n"]}}}}
    prompt = _prompt(target.tokenizer)
    reference = masked_plain_greedy(target, prompt, 40, **spec)
    engine = SpecEngine(target, None)
    out = engine.generate(prompt, SamplingParams(max_new_tokens=40), **spec)
    assert out.tokens == reference
    assert len(out.stats.rounds) < len(out.tokens) - 10  # '{"unit": "' alone is 10 forced characters
    assert target.tokenizer.decode(out.tokens).startswith('{"unit": "')


def test_a_round_that_fails_halfway_leaves_the_grammar_where_the_tokens_are(bpe_target):
    """Rounds driven by hand; one fails after its masks moved the matcher (mid-tree) and before it commits:
    the sequence keeps its tokens, the next round re-syncs the grammar from them, and the whole output is
    still masked plain greedy."""
    from agentspec import models
    from agentspec.local import _Sequence
    from agentspec.round_step import commit_round, forward_round

    spec = STRUCTURES["required"]
    prompt = _prompt(BPE)
    reference = masked_plain_greedy(bpe_target, prompt, 30, **spec)
    c = Constraint(BPE, TOOLS, "required", None, [EOS])
    seq = _Sequence(list(prompt), len(prompt), models.new_cache(bpe_target.model), frozenset([EOS]), constraint=c)
    drafter = Scrambler(make_drafter("default", tokenizer=BPE), len(BPE), seed=1)
    params, rounds = SamplingParams(max_new_tokens=30), 0
    while len(seq.tokens) - len(prompt) < 30 and seq.tokens[-1] != EOS:
        ctx = DraftContext(seq.tokens, len(prompt), constraint=c, **spec)
        prop = propose_round(drafter, ctx, 4)
        logits, pending = forward_round(bpe_target.model, seq, prop)
        rounds += 1
        if rounds == 3:  # the failure: the matcher moved along a draft path, nothing committed
            c.allowed_after([*seq.tokens, *prop.tokens[:2]])
            models.crop_cache(seq.cache, seq.num_cached)
            continue
        commit_round(seq, prop, logits, pending, params, None, cap=len(prompt) + 30)
    assert seq.tokens[len(prompt):] == reference


def test_constraint_prunes_forbidden_deterministic_nodes_and_keeps_sampled_ones():
    c = Constraint(BPE, None, None, STRUCTURES["schema-object"]["response_format"], [EOS])
    prompt = _prompt(BPE)
    c.sync(prompt, len(prompt))
    good = BPE('{"city', add_special_tokens=False)["input_ids"]
    bad = BPE("xyz", add_special_tokens=False)["input_ids"]
    tree = DraftProposal(tuple(good + bad), tuple([-1, *range(len(good) - 1)] + [-1] * len(bad)), source="t")
    pruned = c.prune(tree)
    assert list(pruned.tokens) == good and not pruned.is_tree
    q = SparseDist((bad[0], good[0]), (0.5, 0.5))
    sampled = DraftProposal((bad[0],), None, (q,), source="m")
    assert c.prune(sampled) == sampled  # cutting a sampled token by its value would change its law
    rows = c.masks(tuple(good), [-1, *range(len(good) - 1)])
    assert not rows[0, EOS] and rows[0, good[0]]  # no stop before the value, its first token allowed
    with pytest.raises(ConstraintError):
        c.sync(prompt + bad, len(prompt))


def test_unenforceable_structures_are_clear_errors():
    assert not wants_constraint(TOOLS, "auto", None) and not wants_constraint(None, "required", None)
    assert wants_constraint(None, None, {"type": "json_object"})
    with pytest.raises(ConstraintError, match="cannot enforce"):
        Constraint(BPE, None, None, {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "format": "not-a-format-anyone-knows", "pattern": "(unclosed"}}}, [EOS])


def test_sampled_constrained_output_has_the_masked_law(target):
    """Temperature 1, a grammar with a handful of answers: the empirical law of speculative outputs (a
    sampled model drafter, masked, and a scrambling drafter) is the exact masked law (TV < 0.06)."""
    tok = target.tokenizer
    spec = {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {
        "enum": ["ab", "ac", "b", "bca", "cab"]}}}}
    prompt = _prompt(tok, "<user>pick\n<assistant>")
    exact = _exact_masked_law(target, prompt, spec)
    drafter_model = tiny_model(seed=4, layers=1)
    n = 600
    for drafter in (make_drafter("model", model=drafter_model),
                    Scrambler(make_drafter("model", model=drafter_model), len(tok), seed=5)):
        engine = SpecEngine(target, drafter, num_draft_tokens=3)
        counts: dict[str, int] = {}
        for i in range(n):
            out = engine.generate(prompt, SamplingParams(temperature=1.0, seed=i, max_new_tokens=12), **spec)
            counts[out.text] = counts.get(out.text, 0) + 1
        assert set(counts) <= set(exact)
        tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
        assert tv < 0.06, (drafter.name, tv, counts, exact)
        print(drafter.name, "TV", round(tv, 4))


def _exact_masked_law(target: LoadedModel, prompt: list[int], spec: dict) -> dict[str, float]:
    """Every answer the grammar allows, with its probability under the masked target (enumerated)."""
    tok = target.tokenizer
    out: dict[str, float] = {}
    c = Constraint(tok, None, None, spec["response_format"], [EOS])

    def walk(tokens: list[int], p: float) -> None:
        c.sync(prompt + tokens, len(prompt))
        allowed = c.masks((), [])[0]
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        probs = torch.softmax(logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf")), dim=-1)
        for t in allowed.nonzero()[:, 0].tolist():
            if t == EOS:
                out[tok.decode(tokens)] = out.get(tok.decode(tokens), 0.0) + p * float(probs[t])
            else:
                walk(tokens + [t], p * float(probs[t]))

    walk([], 1.0)
    assert abs(sum(out.values()) - 1.0) < 1e-4
    return out


def test_propose_round_never_sends_what_the_grammar_forbids(bpe_target):
    spec = STRUCTURES["schema-object"]
    c = Constraint(BPE, None, None, spec["response_format"], [EOS])
    prompt = _prompt(BPE)
    drafter = Scrambler(make_drafter("default", tokenizer=BPE), len(BPE), seed=9)
    for _ in range(20):
        ctx = DraftContext(prompt, len(prompt), constraint=c, **spec)
        prop = propose_round(drafter, ctx, 4)
        c.sync(prompt, len(prompt))
        assert len(c.prune(prop)) == len(prop)  # nothing left to prune: every node is allowed


def _accepts(schema, text: str) -> bool:
    """Whether the constraint of a json_schema answer takes ``text`` as a complete answer."""
    from tests.helpers import char_tokenizer

    tok = char_tokenizer()
    c = Constraint(tok, None, None, {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, [EOS])
    ids = tok(text, add_special_tokens=False)["input_ids"]
    try:
        c.sync(ids, 0)
    except ConstraintError:
        return False
    return bool(c.masks((), [])[0, EOS])


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "enum": ["a", 1]}, '"a"', "1"),
    ({"type": "integer", "enum": [1, "x"], "minimum": 0}, "1", '"x"'),
    ({"enum": [1, 2], "const": 1}, "1", "2"),
    ({"type": "object", "properties": {"a": False, "b": {"type": "integer"}}, "required": ["b"]}, '{"b": 1}',
     '{"a": 1, "b": 1}'),
    ({"type": "string", "format": "password", "maxLength": 3}, '"abc"', '"abcd"'),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 2}}, "required": ["n"]}, '{"n": 2}',
     '{"n": 1}'),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k", "z"]}, '{"k": "v", "z": 1}',
     '{"k": "v"}'),
])
def test_the_grammar_accepts_only_values_valid_for_the_schema(schema, good, bad):
    jsonschema.validate(json.loads(good), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(bad), schema)
    assert _accepts(schema, good) and not _accepts(schema, bad)


@pytest.mark.parametrize("schema", [False, {"enum": []}, {"type": "string", "enum": [1, 2]},
                                    {"type": "object", "properties": {"a": False}, "required": ["a"]}])
def test_unsatisfiable_schemas_are_refused(schema):
    with pytest.raises(ConstraintError):
        Constraint(BPE, None, None, {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, [EOS])


def test_a_stop_set_without_the_tokenizer_eos_never_commits_it(target):
    """Stop tokens are the session's: llguidance's own EOS (id 1 here) is not allowed when the session ends
    answers with another token, and the answer still ends at a stop token, valid."""
    spec = {"response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": ["ab"]}}}}
    prompt = _prompt(target.tokenizer, "<user>pick\n<assistant>")
    engine = SpecEngine(target, make_drafter("default", tokenizer=target.tokenizer), stop_token_ids=[0])
    out = engine.generate(prompt, SamplingParams(max_new_tokens=10), **spec)
    assert out.tokens[-1] == 0 and EOS not in out.tokens and out.text == '"ab"'
