"""A model drafter's confidence stop: a greedy chain drafted on the critical path ends after a token the
model is unsure of; one drafted ahead (while a round is in flight) does not; output stays plain greedy's."""

from __future__ import annotations

import pytest
import torch

from agentspec import models
from agentspec.client import SpecClient
from agentspec.drafters import DraftContext, ModelDrafter
from tests.helpers import make_prompt, plain_greedy
from tests.integration.server import LoopbackServer, config

MESSAGES = [{"role": "user", "content": "tell me about tools"}]


def _confidences(target, tokens: list[int], chain: list[int]) -> list[float]:
    """The model's probability of each of ``chain``'s tokens (its greedy picks) after ``tokens``."""
    with torch.inference_mode():
        logits = models.forward(target.model, tokens + chain, models.new_cache(target.model), len(chain) + 1)
    return [float(torch.softmax(row.float(), -1).max()) for row in logits[:-1]]


def test_a_critical_path_chain_stops_after_the_first_unsure_token_and_a_draft_ahead_does_not(target):
    tokens = make_prompt(3, 24)
    chain = list(ModelDrafter(target).propose(DraftContext(tokens, len(tokens)), 8).tokens)
    conf = _confidences(target, tokens, chain)
    cuts = sorted(set(conf))
    threshold = (cuts[len(cuts) // 2 - 1] + cuts[len(cuts) // 2]) / 2  # between two measured values: no ties
    first_unsure = next(i for i, c in enumerate(conf) if c < threshold)
    assert first_unsure < len(chain) - 1  # the stop cuts the chain short
    unsure = ModelDrafter(target, confidence_threshold=threshold)
    assert list(unsure.propose(DraftContext(tokens, len(tokens)), 8).tokens) == chain[: first_unsure + 1]
    ahead = ModelDrafter(target, confidence_threshold=threshold)
    in_flight = DraftContext(tokens, len(tokens), stop=lambda: False)  # a draft made ahead
    assert list(ahead.propose(in_flight, 8).tokens) == chain
    assert list(ModelDrafter(target).propose(DraftContext(tokens, len(tokens)), 8).tokens) == chain


@pytest.mark.parametrize("bad", [-0.1, 1.0, 2.0])
def test_a_confidence_threshold_outside_0_1_is_refused(target, bad):
    with pytest.raises(ValueError, match="confidence_threshold"):
        ModelDrafter(target, confidence_threshold=bad)


@pytest.mark.integration
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sync"])
def test_edge_with_a_confidence_stop_equals_plain_greedy(target, pipeline):
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    reference = plain_greedy(target, list(prompt), 40)
    with LoopbackServer(target, config()) as srv:
        client = SpecClient(srv.url, drafter=ModelDrafter(target, tree_width=2, confidence_threshold=0.2),
                            tokenizer=target.tokenizer, mode="edge", segment_tokens=8, pipeline=pipeline)
        final = client.generate(MESSAGES, max_tokens=40)
        client.close()
    assert final.tokens == reference
