"""ModelGate: a tree's model branch drafts only while the tokens it adds beyond the copies pay its time."""

from __future__ import annotations

import itertools

import pytest

from agentspec.drafters import make_drafter
from agentspec.drafters.copy import CopyDrafter
from agentspec.drafters.gate import ModelGate, ModelGates
from agentspec.drafters.tree import TreeDrafter
from agentspec.local import SpecEngine
from agentspec.types import SamplingParams
from tests.helpers import make_prompt, plain_greedy


class Clock:
    """A clock the test moves by hand (a round's seconds are what the test says they are)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def play(gate: ModelGate, clock: Clock, rounds: int, others: list[int], model: list[int], committed: list[int],
         model_s: float = 0.1, verify_s: float = 0.3) -> int:
    """``rounds`` rounds that draft ``others`` (copy) and ``model`` and commit ``committed``; how many used the model."""
    tokens, used, last = [7, 8, 9], 0, None
    for _ in range(rounds):
        with_model = gate.use_model(tokens, last)
        used += with_model
        last = gate.drafted(tokens, [others], [model] if with_model else [], model_s if with_model else 0.0,
                            clock.now)
        clock.now += verify_s + (model_s if with_model else 0.0)
        tokens = tokens + committed
    return used


def test_a_model_the_copies_already_cover_is_left_out_but_probed():
    clock = Clock()
    gate = ModelGate(probe_every=8, warmup=4, clock=clock)
    used = play(gate, clock, 64, others=[1, 2], model=[1, 2], committed=[1, 2, 3])
    assert not gate.pays and gate.w0 == pytest.approx(3) and gate.w1 == pytest.approx(3)
    assert used == 4 + 60 // 8  # the warm-up, then one probe every 8 rounds


def test_a_model_that_adds_tokens_keeps_drafting():
    clock = Clock()
    gate = ModelGate(probe_every=8, warmup=4, clock=clock)
    # the copy matches 1 token, the model 4: 2 vs 5 tokens a round for 0.1 s more on a 0.3 s round
    assert play(gate, clock, 32, others=[1, 9], model=[1, 2, 3, 4], committed=[1, 2, 3, 4, 5]) == 32
    assert gate.pays and gate.w0 == pytest.approx(2) and gate.w1 == pytest.approx(5)
    assert gate.round_s == pytest.approx(0.3)


def test_a_slow_model_is_left_out_even_where_it_adds_tokens():
    clock = Clock()
    gate = ModelGate(probe_every=100, warmup=4, clock=clock)
    # 2 vs 3 tokens a round: worth 0.15 s of a 0.3 s round, the model costs 0.5 s
    used = play(gate, clock, 20, others=[1, 9], model=[1, 2], committed=[1, 2, 3], model_s=0.5)
    assert used == 4 and not gate.pays


def test_new_turns_pauses_and_other_conversations_are_not_judged():
    clock = Clock()
    gate = ModelGate(clock=clock)
    last = gate.drafted([5], [[1]], [[1, 2]], 0.1, clock.now)
    clock.now += 0.4
    gate.use_model([5, 1, 2, 3, 4, 6, 7], last)  # 6 new tokens after a 2-token round: a tool result followed
    assert gate.samples == 0 and gate.round_s is None
    last = gate.drafted([6], [[1]], [[1, 2]], 0.1, clock.now)
    clock.now += 0.4
    gate.use_model([5, 1], last)  # the context does not continue the drafted one
    assert gate.samples == 0
    last = gate.drafted([5, 1], [[1]], [[1, 2]], 0.1, clock.now)
    clock.now += 0.4
    gate.use_model([5, 1, 1, 2, 3], last)
    assert gate.samples == 1 and gate.round_s == pytest.approx(0.3)
    last = gate.drafted([5, 1, 1, 2, 3], [[1]], [[1, 2]], 0.1, clock.now)
    clock.now += 10.0  # the caller ran a tool between two requests: not a round's time
    gate.use_model([5, 1, 1, 2, 3, 1, 2], last)
    assert gate.samples == 1 and gate.round_s == pytest.approx(0.3)
    last = gate.drafted([5, 1, 1, 2, 3, 1, 2], [[1]], [[1, 2]], 0.1, clock.now)
    clock.now += 0.4  # a round's time again after the pause: judged
    gate.use_model([5, 1, 1, 2, 3, 1, 2, 1, 2], last)
    assert gate.samples == 2 and gate.round_s == pytest.approx(0.3)
    with pytest.raises(ValueError):
        ModelGate(probe_every=0)


def test_rounds_that_got_slower_are_judged_after_one_is_taken_for_a_pause():
    """An average begun on a fast round (or a server that got busier) must not make every later round look
    like a pause: the gate would never judge the model again."""
    clock = Clock()
    gate = ModelGate(warmup=4, clock=clock)
    play(gate, clock, 2, others=[1, 9], model=[1, 2], committed=[1, 2, 3], verify_s=0.01)
    assert gate.samples == 1 and gate.round_s == pytest.approx(0.01)
    play(gate, clock, 8, others=[1, 9], model=[1, 2], committed=[1, 2, 3], verify_s=0.3)
    assert gate.samples >= 4 and gate.round_s > 0.1  # the first slow round is taken for a pause, not the rest


def test_sessions_of_one_key_share_a_gate_and_keys_do_not():
    """An agent opens a session per step: a later session starts from what the earlier ones measured, and
    another tenant's traffic never turns the model on or off for this one."""
    clock = Clock()
    gates = ModelGates(most=2, make=lambda: ModelGate(probe_every=8, warmup=4, clock=clock))
    play(gates.get("a"), clock, 8, others=[1, 2], model=[1, 2], committed=[1, 2, 3])  # step 1: useless model
    assert not gates.get("a").pays
    # step 2, a new session: no new warm-up, only the probe that falls due
    assert play(gates.get("a"), clock, 7, others=[1, 2], model=[1, 2], committed=[1, 2, 3]) == 1
    assert gates.get("b").pays and gates.get("b").samples == 0
    gates.get("c")  # a third key: "a", the least recently used, is dropped
    assert gates.get("a").samples == 0
    with pytest.raises(ValueError):
        ModelGates(most=0)


class Ticking:
    """Each reading one second after the last: a model draft (two readings) costs 1 s, a round a few."""

    def __init__(self) -> None:
        self.ticks = itertools.count()

    def __call__(self) -> float:
        return float(next(self.ticks))


@pytest.mark.parametrize("drafter_is_target", [False, True])
def test_the_gated_tree_is_lossless_and_judges_real_drafters(target, wrong_drafter_model, drafter_is_target):
    """A real model drafter inside the tree: a wrong one (random weights) is left out after the warm-up, the
    target drafting for itself is kept; either way the output is plain greedy."""
    prompt = make_prompt(5)
    model = make_drafter("model", model=target if drafter_is_target else wrong_drafter_model)
    gate = ModelGate(probe_every=6, warmup=3, clock=Ticking())
    tree = TreeDrafter(copy=CopyDrafter(max_candidates=3), model=model, gate=gate)
    engine = SpecEngine(target, tree, num_draft_tokens=4)
    out = engine.generate(prompt, SamplingParams(max_new_tokens=48))
    assert out.tokens == plain_greedy(target, prompt, 48)
    assert gate.samples >= 3
    assert gate.pays is drafter_is_target
