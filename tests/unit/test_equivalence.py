"""Greedy speculative output == plain greedy output (transformers' generate), token for token.

Drafters: always right (the target itself), almost always wrong (other random weights), scripted
right up to position j, scripted trees with the right branch at several depths and sibling positions,
the n-gram drafter (chain and tree) and the model drafter (chain and tree).
"""

from __future__ import annotations

import copy

import pytest
import torch

from agentspec import models
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.drafters.base import DraftContext
from agentspec.local import SpecEngine
from agentspec.types import DraftProposal, SamplingParams
from tests.helpers import make_prompt, plain_greedy

MAX_NEW = 48
PROMPTS = [make_prompt(s) for s in range(3)]


class ScriptedDrafter:
    """Knows the reference output; drafts it correctly up to position ``j`` of each round, then wrong.

    With ``width > 1`` it drafts a tree: at every depth ``width`` siblings, the correct token (when the
    script says it is right there) at sibling position ``right_sibling``; the chain continues from it.
    """

    name = "scripted"

    def __init__(self, reference: list[int], j: int, width: int = 1, right_sibling: int = 0) -> None:
        self.reference, self.j, self.width, self.right_sibling = reference, j, width, right_sibling
        self.prompt_len = 0

    def reset(self) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        done = len(ctx.tokens) - ctx.num_prompt_tokens
        truth = self.reference[done : done + k]
        tokens, parents = [], []
        parent = -1
        for depth, right in enumerate(truth):
            wrong = [(right + 7 + 13 * s) % 90 + 2 for s in range(self.width)]
            siblings = [w if w != right else (w + 1) % 90 + 2 for w in wrong]
            if depth < self.j:
                siblings[self.right_sibling % self.width] = right
            chain_slot = self.right_sibling % self.width
            for s, tok in enumerate(siblings):
                tokens.append(tok)
                parents.append(parent)
                if s == chain_slot:
                    chain_node = len(tokens) - 1
            parent = chain_node
        return DraftProposal(tokens=tuple(tokens), parents=tuple(parents) if self.width > 1 else None)


def run(target, drafter, prompt, k=4, max_new=MAX_NEW):
    engine = SpecEngine(target, drafter, num_draft_tokens=k)
    return engine.generate(prompt, SamplingParams(max_new_tokens=max_new))


@pytest.fixture(scope="module")
def references(target):
    return [plain_greedy(target, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_no_drafter_equals_plain(target, references, i):
    assert run(target, None, PROMPTS[i]).tokens == references[i]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_always_right_drafter(target, references, i):
    result = run(target, ModelDrafter(target), PROMPTS[i], k=5)
    assert result.tokens == references[i]
    assert result.stats.alpha == 1.0  # the target drafting for itself is never rejected


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_always_wrong_drafter(target, wrong_drafter_model, references, i):
    result = run(target, ModelDrafter(wrong_drafter_model), PROMPTS[i])
    assert result.tokens == references[i]
    assert result.stats.alpha < 0.5


@pytest.mark.parametrize("j", [0, 1, 2, 3, 5])
def test_scripted_right_up_to_j(target, references, j):
    result = run(target, ScriptedDrafter(references[0], j), PROMPTS[0], k=5)
    assert result.tokens == references[0]
    if j < 5:  # every full round accepts exactly j tokens
        assert all(r.accepted == min(j, r.drafted) for r in result.stats.rounds if r.drafted)


@pytest.mark.parametrize("j", [0, 1, 3, 4])
@pytest.mark.parametrize("right_sibling", [0, 1, 2])
def test_scripted_tree_right_branch_anywhere(target, references, j, right_sibling):
    drafter = ScriptedDrafter(references[1], j, width=3, right_sibling=right_sibling)
    result = run(target, drafter, PROMPTS[1], k=4)
    assert result.tokens == references[1]
    assert all(r.accepted == min(j, r.drafted // 3) for r in result.stats.rounds if r.drafted)


@pytest.mark.parametrize("i", range(len(PROMPTS)))
@pytest.mark.parametrize("candidates", [1, 3])
def test_ngram_drafter(target, references, i, candidates):
    result = run(target, NgramDrafter(max_ngram=3, max_candidates=candidates), PROMPTS[i], k=6)
    assert result.tokens == references[i]


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_model_drafter_tree(target, wrong_drafter_model, references, i):
    for drafter in (ModelDrafter(target, tree_width=3), ModelDrafter(wrong_drafter_model, tree_width=3)):
        assert run(target, drafter, PROMPTS[i], k=3).tokens == references[i]


@pytest.fixture(scope="module")
def reduced_self(target, references):
    """The target drafting for itself with its output head cut to the even ids plus prompt 0's answer:
    right wherever the target's token is kept, unable to propose the rest."""
    model = copy.deepcopy(target.model)
    keep = sorted(set(range(0, model.config.vocab_size, 2)) | set(references[0]))
    models.restrict_output_vocab(model, keep)
    return model, keep


@pytest.mark.parametrize("i", range(len(PROMPTS)))
def test_reduced_vocabulary_drafter(target, references, reduced_self, i):
    model, keep = reduced_self
    result = run(target, ModelDrafter(model), PROMPTS[i], k=4)
    assert result.tokens == references[i]
    if set(references[i]) <= set(keep):
        assert result.stats.alpha == 1.0
    else:  # some of the target's tokens cannot be drafted: rejected there, still lossless
        assert result.stats.alpha < 1.0
    prop = ModelDrafter(model).propose(DraftContext(PROMPTS[i], len(PROMPTS[i])), 4)
    assert set(prop.tokens) <= set(keep)
    sampled = ModelDrafter(model).propose(DraftContext(PROMPTS[i], len(PROMPTS[i]), SamplingParams(temperature=1.0),
                                                       torch.Generator().manual_seed(0)), 3)
    for dist in sampled.draft_probs:
        assert set(dist.ids) <= set(keep) and abs(sum(dist.probs) - 1) < 1e-5


def test_model_drafter_reused_across_requests(target, references):
    """One drafter instance, several generations: its cache must follow each new context."""
    drafter = ModelDrafter(target)
    for i in (0, 1, 0, 2):
        assert run(target, drafter, PROMPTS[i]).tokens == references[i]


@pytest.mark.parametrize("drafter_kind", ["none", "self", "ngram"])
def test_stops_at_stop_token_like_plain(target, references, drafter_kind):
    """A stop token in mid-output (inside drafts that run past it) ends generation exactly as plain does."""
    stop = references[0][25]  # the random tiny model never emits </s>; use a token it does emit
    reference = plain_greedy(target, PROMPTS[0], MAX_NEW, eos=stop)
    assert reference[-1] == stop and len(reference) <= 26
    drafter = {"none": None, "self": ModelDrafter(target), "ngram": NgramDrafter()}[drafter_kind]
    engine = SpecEngine(target, drafter, num_draft_tokens=6, stop_token_ids=[stop])
    result = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW))
    assert result.tokens == reference
    assert result.finish_reason == "stop"


def test_max_new_tokens_exact(target, references):
    for max_new in (1, 2, 7):
        result = run(target, ModelDrafter(target), PROMPTS[0], k=5, max_new=max_new)
        assert result.tokens == references[0][:max_new]
        assert result.finish_reason == "length"


def test_stop_string(target, references):
    text = target.tokenizer.decode(references[2])
    stop = text[10:12]
    engine = SpecEngine(target, ModelDrafter(target), num_draft_tokens=5)
    result = engine.generate(PROMPTS[2], SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,)))
    assert result.finish_reason == "stop"
    assert result.text.endswith(stop) and stop not in result.text[:-len(stop)]
    assert result.tokens == references[2][: len(result.tokens)]
    assert result.stats.emitted == len(result.tokens)  # statistics count only what was returned


def test_text_leaves_out_the_stop_token(target, references):
    stop_at = references[1][5]
    engine = SpecEngine(target, ModelDrafter(target), num_draft_tokens=4, stop_token_ids=[stop_at])
    result = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=MAX_NEW))
    assert result.finish_reason == "stop" and result.tokens[-1] == stop_at
    assert result.text == target.tokenizer.decode(result.tokens[:-1])


def test_model_drafter_times_catch_up_prefills_apart(target):
    """A first feed of CATCHUP_MIN tokens or more (a new prompt, tokens committed in another mode) is a
    catch-up prefill: counted and timed apart from drafting, reported once; one new token is drafting."""
    from agentspec.drafters.model import CATCHUP_MIN
    from agentspec.drafters.tree import TreeDrafter

    drafter = ModelDrafter(target)
    tree = TreeDrafter(model=drafter)  # the tool drafter's tree reports its model drafter's catch-up
    prompt = [t for s in range(4) for t in make_prompt(s)][: 2 * CATCHUP_MIN]
    assert tree.catchup_tokens(prompt) == len(prompt) and tree.take_catchup() == (0, 0.0)
    prop = drafter.propose(DraftContext(prompt, len(prompt)), 4)
    fed, seconds = tree.take_catchup()
    assert fed == len(prompt) and seconds > 0
    assert tree.take_catchup() == (0, 0.0)  # taken once
    committed = prompt + list(prop.tokens[:2]) + [3]  # two drafts accepted, then the target's own token
    assert drafter.catchup_tokens(committed) == 0  # one new token to feed: an ordinary drafting step
    drafter.propose(DraftContext(committed, len(prompt)), 4)
    assert drafter.take_catchup() == (0, 0.0)
    later = committed + list(range(5, 5 + CATCHUP_MIN))  # committed while another mode ran
    behind = drafter.catchup_tokens(later)  # 16, and the slots of its drafts the new tokens do not repeat
    assert CATCHUP_MIN <= behind <= CATCHUP_MIN + 1
    drafter.propose(DraftContext(later, len(prompt)), 2)
    assert drafter.take_catchup()[0] == behind  # what the router was told is what the drafter fed


def test_model_drafter_catch_up_off_the_critical_path_changes_no_draft(target):
    """``catch_up`` prefills all but the last committed token ahead of time (not reported as a catch-up):
    the next proposal then feeds one token and drafts what a drafter that never caught up drafts."""
    from agentspec.drafters.model import CATCHUP_MIN

    tokens = [t for s in range(3) for t in make_prompt(s)]
    ahead, cold = ModelDrafter(target), ModelDrafter(target)
    ahead.catch_up(tokens[: CATCHUP_MIN - 1])  # too few to be worth a prefill of its own: left to propose
    assert ahead.catchup_tokens(tokens) == len(tokens)
    ahead.catch_up(tokens)
    assert ahead.catchup_tokens(tokens) == 0 and ahead.take_catchup() == (0, 0.0)
    ctx = DraftContext(tokens, len(tokens))
    assert ahead.propose(ctx, 6).tokens == cold.propose(ctx, 6).tokens
    assert ahead.take_catchup() == (0, 0.0) and cold.take_catchup()[0] == len(tokens)
