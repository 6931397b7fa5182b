"""logit_bias and presence/frequency penalties inside verification, and the target's logprobs.

Penalties are a function of each position's own prefix, so every draft node is penalised by its
root-to-node path: checked against a brute-force per-row computation, and end to end (chain, tree,
n-gram drafts) against a plain greedy loop written here, independent of the library's code.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.local import SpecEngine
from agentspec.types import SamplingParams
from agentspec.verify import process_logits, token_logprobs
from tests.helpers import EOS, make_prompt, tiny_model

PARAMS = dict(presence_penalty=0.7, frequency_penalty=0.4, logit_bias=((5, 3.0), (9, -100.0), (17, 1.5)))


def penalised(row: torch.Tensor, prefix: list[int], p: SamplingParams) -> torch.Tensor:
    out = row.clone().float()
    for tok, b in p.logit_bias:
        out[tok] += b
    for tok, k in Counter(prefix).items():
        out[tok] -= p.presence_penalty + p.frequency_penalty * k
    return out


def test_each_row_is_penalised_by_its_own_path():
    g = torch.Generator().manual_seed(0)
    vocab, generated = 40, [3, 5, 5, 7, 30]
    tokens = [5, 8, 3, 5, 5, 8, 12]
    parents = [-1, -1, 0, 0, 3, 4, 1]  # siblings and a chain that repeats a generated token
    logits = torch.randn(len(tokens) + 1, vocab, generator=g)
    p = SamplingParams(**PARAMS)
    got = process_logits(logits, p, generated, tokens, parents)
    paths = [[]]
    for i, par in enumerate(parents):
        paths.append(paths[par + 1] + [tokens[i]])
    for row in range(len(tokens) + 1):
        torch.testing.assert_close(got[row], penalised(logits[row], generated + paths[row], p))


def test_no_processing_returns_the_logits_untouched():
    logits = torch.randn(3, 10)
    assert process_logits(logits, SamplingParams(), [1, 2], [1, 2], [-1, 0]) is logits


def test_token_logprobs_are_the_raw_log_softmax():
    logits = torch.randn(4, 12)
    out = token_logprobs(logits, [0, 2], [3, 7], top_n=2)
    lp = torch.log_softmax(logits, dim=-1)
    assert out[0][0] == pytest.approx(float(lp[0, 3])) and out[1][0] == pytest.approx(float(lp[2, 7]))
    assert [i for i, _ in out[1][1]] == torch.topk(lp[2], 2).indices.tolist()


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
                                 dict(logit_bias={1: 101.0}), dict(logprobs=21)])
def test_out_of_range_settings_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=1)


def plain_penalised_greedy(target, prompt: list[int], p: SamplingParams) -> list[int]:
    """The reference: one full forward per token, the processing applied by hand, argmax."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_new_tokens):
            logits = target.model(torch.tensor([prompt + out], device=target.device)).logits[0, -1].cpu()
            tok = int(penalised(logits, out, p).argmax())
            out.append(tok)
            if tok == EOS:
                break
    return out


@pytest.mark.parametrize("drafter", ["none", "self", "self-tree", "ngram"])
def test_greedy_speculation_is_lossless_under_penalties_and_bias(target, drafter):
    p = SamplingParams(max_new_tokens=40, **PARAMS)
    d = {"none": None, "self": ModelDrafter(target), "self-tree": ModelDrafter(target, tree_width=3),
         "ngram": NgramDrafter(max_ngram=3, max_candidates=3)}[drafter]
    for seed in range(2):
        prompt = make_prompt(seed)
        ref = plain_penalised_greedy(target, prompt, p)
        result = SpecEngine(target, d, num_draft_tokens=5).generate(prompt, p)
        assert result.tokens == ref
        assert 9 not in result.tokens  # biased by -100
        unpenalised = SpecEngine(target, d, num_draft_tokens=5).generate(prompt, SamplingParams(max_new_tokens=40))
        assert unpenalised.tokens != ref  # the processing really changed the answer


def test_top_k_one_is_greedy_whatever_the_seed(target):
    prompt = make_prompt(0)
    greedy = SpecEngine(target, ModelDrafter(target)).generate(prompt, SamplingParams(max_new_tokens=24)).tokens
    for seed in range(3):
        p = SamplingParams(temperature=1.0, top_k=1, seed=seed, max_new_tokens=24)
        assert SpecEngine(target, ModelDrafter(target)).generate(prompt, p).tokens == greedy


def test_sampled_speculation_has_the_penalised_law(wrong_drafter_model):
    """Two sampled tokens through a sampled model-drafted tree: the pair's law is the processed target's,
    the second token penalised for repeating the first (total variation against the exact law)."""
    from tests.unit.test_sampling_distribution import tv_distance

    target = tiny_model(seed=0)
    p = SamplingParams(temperature=1.5, top_k=4, max_new_tokens=2, presence_penalty=1.5, frequency_penalty=0.5,
                       logit_bias=((7, 2.0),))
    prompt = [5, 9, 13, 5, 9]

    def law(prefix: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + prefix], device=target.device)).logits[0, -1].cpu()
        x = penalised(logits, prefix, p) / p.temperature
        kth = torch.topk(x, p.top_k).values[-1]
        return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)

    p1 = law([])
    exact = {(a, b): float(p1[a] * q) for a in torch.nonzero(p1).flatten().tolist()
             for b, q in enumerate(law([a]).tolist()) if q > 0}
    engine = SpecEngine(target, ModelDrafter(wrong_drafter_model, tree_width=2), num_draft_tokens=3,
                        stop_token_ids=())
    samples = [tuple(engine.generate(prompt, SamplingParams(**{**p.__dict__, "seed": s})).tokens)
               for s in range(1500)]
    assert set(samples) <= set(exact)
    assert tv_distance(samples, exact) < 0.06
