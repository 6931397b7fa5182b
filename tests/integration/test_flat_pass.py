"""A round's draft stays inside the flat part of the verifier's cost curve (``SessionInfo.flat_draft_tokens``),
at the edge and on the server, losslessly."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from agentspec import models
from agentspec.client import SpecClient
from agentspec.drafters import ModelDrafter
from agentspec.router import DraftLengthPolicy
from tests.helpers import plain_greedy
from tests.integration.server import LoopbackServer, config

MESSAGES = [{"role": "user", "content": "tell me about tools"}]
MAX = 40


def test_the_flat_length_ends_where_the_curve_steps_up():
    step = {k: 1.0 + 0.005 * k for k in range(1, 17)} | {17: 1.33, 18: 1.34}
    assert models.flat_pass_len(step) == 16
    assert models.flat_pass_len({**step, 12: 1.5}) == 16  # one slow sample past the base does not end it
    assert models.flat_pass_len({**step, 1: 1.2}) == 18  # a slow base: no step seen, no bound
    assert models.flat_pass_len({1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}) == 1  # a curve that climbs from the start
    assert models.flat_draft_tokens(step) == 15  # less the pending token
    assert models.flat_draft_tokens({1: 1.0, 2: 1.1, 3: 1.12, 4: 1.14, 5: 1.5}) is None  # no flat part to keep
    with pytest.raises(ValueError, match="1-token pass"):
        models.flat_pass_len({8: 1.0, 16: 1.1})


def test_the_start_up_curve_is_measured_over_an_agents_context(target, monkeypatch):
    """The verifier's start-up curve (which sets the flat draft cap) is measured over WARM_UP_CONTEXT tokens,
    fewer where the session length or the model's positions end first; each size's pass is a real one."""
    contexts = []
    measure = models.kv.measure_verify_cost

    def recording(model, prompt_ids, max_tokens, reps):
        contexts.append(len(prompt_ids))
        return measure(model, prompt_ids, max_tokens, reps)

    monkeypatch.setattr(models.kv, "measure_verify_cost", recording)
    vocab = target.model.config.vocab_size
    curve = models.warm_up_verify_cost(target.model, vocab, 17, 8192)
    assert sorted(curve) == list(range(1, 18)) and all(s > 0 for s in curve.values())
    assert models.warm_up_verify_cost(target.model, vocab, 17, 300)
    positions = target.model.config.max_position_embeddings
    assert contexts == [models.kv.WARM_UP_CONTEXT, 300 - 17] and positions >= models.kv.WARM_UP_CONTEXT + 17


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["edge", "server"])
def test_rounds_carry_at_most_the_verifiers_flat_draft_and_stay_lossless(target, mode):
    """The verifier says its rounds are flat up to 3 draft tokens: an int4 copy of the target drafting width-2
    trees (which would send up to 2γ nodes) at the edge, and the server's own drafter, send no round more,
    and the output is plain greedy's."""
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    reference = plain_greedy(target, list(prompt), MAX)
    model = copy.deepcopy(target.model).cpu()
    models.quantize_linears(model, "int4")
    close = replace(target, model=model, device=torch.device("cpu"), name=f"{target.name}-int4")
    with LoopbackServer(target, config(), draft_model=close) as srv:
        measured = srv.engine.flat_draft_tokens
        assert measured == models.flat_draft_tokens(srv.engine.verify_costs)
        assert measured is None or measured <= srv.engine.config.max_draft_tokens
        srv.engine.flat_draft_tokens = 3
        # and flat in its server-side γ policies too: a tiny model's measured curve is mostly per-pass overhead
        # (its 2-token pass can cost twice a 1-token one), which would keep the server drafting nothing
        flat = {k: 1e-3 for k in range(1, srv.engine.config.max_draft_tokens + 2)}
        srv.engine.policies |= {name: DraftLengthPolicy.from_calibration(flat) for name in srv.engine.policies}
        sizes: list[int] = []
        execute = srv.engine.execute

        def recording(items, limits):  # the real pass, with each round's draft size noted
            out = execute(items, limits)
            sizes.extend(len(item.draft) for item in items)
            drafts.extend(item.draft for item in items if len(item.draft))
            return out

        class Asked(ModelDrafter):  # the chain lengths the client asks its drafter for
            def propose(self, ctx, k, lead=()):
                asked.append(k)
                return super().propose(ctx, k, lead)

        asked: list[int] = []
        drafts: list = []
        srv.engine.execute = recording
        client = SpecClient(srv.url, drafter=Asked(close, tree_width=2), tokenizer=target.tokenizer,
                            mode=mode, num_draft_tokens=6, segment_tokens=8)
        final = client.generate(MESSAGES, max_tokens=MAX)
        client.close()
    assert final.tokens == reference
    assert sizes and max(sizes) == 3  # the cap binds, and holds for every round
    if mode == "edge":
        # no chain token is drafted past the cap (a draft ahead asks for its guess too), and a capped tree
        # keeps its chain's depth over sibling leaves: some round sends the three-deep chain
        assert asked and max(asked) <= 3 + 1
        assert any(len(d.spine()) == 3 for d in drafts)
