"""A model drafter reading a guessed continuation (a copy) in one pass: it drafts its own greedy chain for
fewer passes, and the tree lets that chain lead over the copy it read."""

from __future__ import annotations

import pytest

from agentspec.drafters import DraftContext, ModelDrafter
from agentspec.drafters import model as model_module
from agentspec.drafters.copy import CopyDrafter
from agentspec.drafters.gate import ModelGate
from agentspec.drafters.tree import TreeDrafter
from agentspec.local import SpecEngine
from agentspec.types import SamplingParams
from tests.helpers import VOCAB, make_prompt, plain_greedy


@pytest.fixture
def passes(monkeypatch):
    """The drafter's forward passes, counted (each still runs the real model)."""
    count = [0]
    real = model_module.models.forward

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module.models, "forward", counted)
    return count


def _own_chain(target, tokens: list[int], k: int) -> list[int]:
    return list(ModelDrafter(target).propose(DraftContext(tokens, len(tokens)), k).tokens)


@pytest.mark.parametrize("seed", range(4))
def test_a_lead_gives_the_models_own_chain_in_fewer_passes(target, passes, seed):
    """Whatever the lead (the model's chain itself, a prefix of it then a wrong token, all wrong, too long),
    the draft is the chain the model drafts alone; each lead token the model agrees with saves a pass, and
    the drafter's cache is left as if it had drafted step by step (its next draft is the same too)."""
    tokens = make_prompt(seed)
    k = 6
    own = _own_chain(target, tokens, k)
    wrong = [(t + 1 - 2) % (VOCAB - 2) + 2 for t in own]  # another printable token at every position
    for lead, saved in ((own[:5], 5), (own[:2] + wrong[2:5], 2), (wrong[:4], 0), (own + own, k - 1), ([], 0)):
        drafter = ModelDrafter(target)
        drafter.propose(DraftContext(tokens[:-3], len(tokens) - 3), 2)  # a cache a few tokens behind, as in use
        before = passes[0]
        got = list(drafter.propose(DraftContext(tokens, len(tokens)), k, lead=lead).tokens)
        assert got == own, lead
        assert passes[0] - before == k - saved
        assert drafter._cached == [*tokens, *own[:-1]]  # as after drafting step by step: the last is fed next
        after = [*tokens, *own[:3]]  # the next round, two of the draft's tokens accepted plus a correction
        assert list(drafter.propose(DraftContext(after, len(tokens)), 4).tokens) == _own_chain(target, after, 4)


def test_a_lead_is_ignored_where_it_cannot_stand_for_the_models_draws(target, passes):
    """Sampled drafts (the law each token was drawn from is sent along) and a catch-up's prefill draft as
    without a lead: one pass a token."""
    tokens = make_prompt(7)
    own = _own_chain(target, tokens, 4)
    cases = ((ModelDrafter(target), DraftContext(tokens, len(tokens), SamplingParams(temperature=1.0, seed=0))),)
    for drafter, ctx in cases:
        drafter.propose(DraftContext(tokens[:-2], len(tokens) - 2), 1)
        before = passes[0]
        drafter.propose(ctx, 4, lead=own)
        assert passes[0] - before == 4
    fresh = ModelDrafter(target)  # nothing cached: the first pass prefills the prompt
    before = passes[0]
    assert list(fresh.propose(DraftContext(tokens, len(tokens)), 4, lead=own).tokens) == own
    assert passes[0] - before == 4 and fresh.take_catchup()[0] == len(tokens)


def test_the_tree_lets_the_model_read_the_copy_and_lead(target):
    """A strong copy is read by the model in its first pass; the model's chain goes first (it has seen where
    the copy parts from its picks), the copy follows where the node budget leaves room, and the gate still
    judges the model against the copy that would have led without it. A model with sibling leaves reads it
    too, and its leaves ride on top of the node budget (verified with the chain they hang from)."""
    tokens = make_prompt(3)  # its second half repeats its first: the copy drafter finds long matches
    copy = CopyDrafter(max_candidates=1)
    ctx = DraftContext(tokens[:30], 20)
    (match, copied), = copy.candidates(ctx, 6)
    assert match >= 2
    own = _own_chain(target, tokens[:30], 6)
    assert own != copied  # a random model does not continue the repeat: the chains differ
    gate = ModelGate()
    tree = TreeDrafter(copy=copy, model=ModelDrafter(target), gate=gate)
    assert list(tree.propose(ctx, 6).tokens) == copied  # a first pass that prefills reads no lead: the copy leads
    tree.catch_up(tokens[:30])  # caught up (its cache holds all but the last token), as in a session's rounds
    assert list(tree.propose(ctx, 6).tokens) == own
    assert tree._drafted.others[-1] == copied and tree._drafted.model == [own]
    tree.node_budget = 6
    wide = tree.propose(DraftContext(tokens[:30], 20), 6)
    assert list(wide.tokens[:6]) == own and wide.is_tree  # the copy is a branch after the model's chain
    siblings = TreeDrafter(copy=copy, model=ModelDrafter(target, tree_width=2))
    siblings.catch_up(tokens[:30])
    tree_draft = siblings.propose(DraftContext(tokens[:30], 20), 6)
    assert [tree_draft.tokens[i] for i in tree_draft.spine()] == own  # the model's chain leads
    assert len(tree_draft) == 12  # each chain node has its sibling leaf


def test_sibling_leaves_read_a_lead_in_one_pass_and_draft_what_they_draft_without(target, passes):
    """A drafter with sibling leaves reads a lead too: the same tree as drafted a token a pass, for one pass
    over the lead's tokens the model agrees with."""
    tokens = make_prompt(7)
    own = _own_chain(target, tokens, 4)
    alone = ModelDrafter(target, tree_width=2)
    alone.propose(DraftContext(tokens[:-2], len(tokens) - 2), 1)
    reading = ModelDrafter(target, tree_width=2)
    reading.propose(DraftContext(tokens[:-2], len(tokens) - 2), 1)
    expected = alone.propose(DraftContext(tokens, len(tokens)), 4)
    before = passes[0]
    got = reading.propose(DraftContext(tokens, len(tokens)), 4, lead=own)
    assert passes[0] - before == 1
    assert (got.tokens, got.parents) == (expected.tokens, expected.parents) and expected.is_tree


@pytest.mark.parametrize("drafter_is_target", [True, False])
def test_rounds_with_leads_equal_plain_greedy(target, wrong_drafter_model, drafter_is_target):
    """Copies read by the model, whose drafts are all kept (the target drafting for itself) or mostly
    rejected (a wrong model): the output is plain greedy's."""
    for seed in (3, 5):
        prompt = make_prompt(seed)
        model = _Reading(target if drafter_is_target else wrong_drafter_model)
        tree = TreeDrafter(copy=CopyDrafter(max_candidates=2), model=model)
        engine = SpecEngine(target, tree, num_draft_tokens=5)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=40))
        assert out.tokens == plain_greedy(target, prompt, 40)
        assert model.leads_read > 0  # the path under test ran


class _Reading(ModelDrafter):
    """A model drafter that counts the leads it reads."""

    leads_read = 0

    def _read_lead(self, logits, lead):
        self.leads_read += 1
        return super()._read_lead(logits, lead)
