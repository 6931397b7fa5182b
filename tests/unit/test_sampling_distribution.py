"""Speculative sampling reproduces the target distribution: empirical TV distance shrinks with n.

A toy target and drafter are Markov chains over a small vocabulary, so the exact distribution of
generated sequences is known. Sequences are produced by speculative rounds (linear chains and trees,
sampled drafts with their real sparse proposal), then compared with the exact distribution.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from agentspec.types import SamplingParams, SparseDist
from agentspec.verify import sampling_probs, verify_sampled

V, LENGTH, START = 4, 3, 0


def markov(seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * sharp, dim=-1)  # [last, next]


TARGET = markov(0, 1.5)
CLOSE_DRAFT = markov(0, 1.2)  # similar to the target
FAR_DRAFT = torch.softmax(-TARGET.log() * 2, dim=-1)  # favours what the target dislikes


def exact_distribution() -> dict[tuple[int, ...], float]:
    out = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        p, last = 1.0, START
        for tok in seq:
            p, last = p * float(TARGET[last, tok]), tok
        out[seq] = p
    return out


def speculative_sequence(draft: torch.Tensor, k: int, width: int, g: torch.Generator) -> tuple[int, ...]:
    """Generate LENGTH tokens with rounds of: draft a chain (first level: ``width`` i.i.d. siblings)."""
    out: list[int] = []
    while len(out) < LENGTH:
        last = out[-1] if out else START
        tokens, parents, probs = [], [], []
        # first level: `width` independent samples from q(.|last); chain continues from the first one
        q0 = draft[last]
        for _ in range(width):
            tokens.append(int(torch.multinomial(q0, 1, generator=g)))
            parents.append(-1)
            probs.append(SparseDist(tuple(range(V)), tuple(q0.tolist())))
        prev_node, prev_tok = 0, tokens[0]
        for _ in range(k - 1):
            q = draft[prev_tok]
            tok = int(torch.multinomial(q, 1, generator=g))
            tokens.append(tok)
            parents.append(prev_node)
            probs.append(SparseDist(tuple(range(V)), tuple(q.tolist())))
            prev_node, prev_tok = len(tokens) - 1, tok
        # target rows: root, then after each node (a Markov target only looks at the node's own token)
        rows = torch.stack([TARGET[last]] + [TARGET[t] for t in tokens])
        result = verify_sampled(rows, tokens, probs, parents, generator=g)
        out.extend(result.output_tokens)
    return tuple(out[:LENGTH])


def tv_distance(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    counts = Counter(samples)
    return 0.5 * sum(abs(counts[s] / len(samples) - p) for s, p in exact.items())


@pytest.mark.parametrize(
    "draft,k,width",
    [(CLOSE_DRAFT, 2, 1), (FAR_DRAFT, 2, 1), (CLOSE_DRAFT, 2, 3), (FAR_DRAFT, 3, 2)],
    ids=["linear-close", "linear-far", "tree-close", "tree-far"],
)
def test_sampled_output_converges_to_target(draft, k, width):
    exact = exact_distribution()
    g = torch.Generator().manual_seed(1234)
    samples = [speculative_sequence(draft, k, width, g) for _ in range(12000)]
    tv_small, tv_large = tv_distance(samples[:750], exact), tv_distance(samples, exact)
    # 64 cells: sampling noise alone gives TV ~ 0.1 at n=750 and ~ 0.025 at n=12000
    assert tv_large < 0.04, tv_large
    assert tv_large < tv_small


def test_accepting_everything_would_be_detected():
    """The statistic has power: drafting from FAR_DRAFT and accepting it unverified is far off."""
    exact = exact_distribution()
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(4000):
        seq, last = [], START
        for _ in range(LENGTH):
            last = int(torch.multinomial(FAR_DRAFT[last], 1, generator=g))
            seq.append(last)
        samples.append(tuple(seq))
    assert tv_distance(samples, exact) > 0.2


@pytest.mark.parametrize("kind", ["model_tree", "reduced_vocab_tree", "grammar_copy_model"])
def test_engine_sampling_matches_target_model(target, wrong_drafter_model, kind):
    """End to end through SpecEngine: the first two tokens match the target's law — with a model drafter
    (a sampled tree), and with the tree drafter on a constrained JSON answer (a grammar-forced point-mass
    ``{``, then the model's sampled tokens, both under the grammar's mask: the law is the masked target's)."""
    from agentspec.constraint import Constraint
    from agentspec.drafters import ModelDrafter
    from agentspec.drafters.copy import CopyDrafter
    from agentspec.drafters.grammar import GrammarDrafter
    from agentspec.drafters.tree import TreeDrafter
    from agentspec.local import SpecEngine

    params = SamplingParams(temperature=1.5, top_k=3, max_new_tokens=2)
    prompt = [5, 9, 13, 5, 9]
    json_answer = {"type": "json_object"} if kind == "grammar_copy_model" else None
    # a JSON answer is constrained: its law is the target's under the grammar's mask
    constraint = Constraint(target.tokenizer, None, None, json_answer, ()) if json_answer else None

    def law(tokens: list[int]) -> torch.Tensor:
        logits = target.model(torch.tensor([tokens], device=target.device)).logits[0, -1:].cpu()
        if constraint is not None:
            constraint.sync(tokens, len(prompt))
            logits = constraint.apply(logits, (), [])
        return sampling_probs(logits[0], params)

    # exact law of (x1, x2) under the processed target distribution
    with torch.inference_mode():
        p1 = law(prompt)
        exact = {}
        for x1 in torch.nonzero(p1).flatten().tolist():
            p2 = law(prompt + [x1])
            for x2 in torch.nonzero(p2).flatten().tolist():
                exact[(x1, x2)] = float(p1[x1] * p2[x2])
    if kind == "reduced_vocab_tree":  # a drafter that can only propose half the tokens: q is 0 elsewhere
        import copy

        from agentspec import models

        small = copy.deepcopy(wrong_drafter_model.model)
        models.restrict_output_vocab(small, range(0, small.config.vocab_size, 2))
        model = ModelDrafter(small, tree_width=2)
    else:
        model = ModelDrafter(wrong_drafter_model, tree_width=2)
    drafter = model if kind != "grammar_copy_model" else TreeDrafter(GrammarDrafter(target.tokenizer), CopyDrafter(), model)
    engine = SpecEngine(target, drafter, num_draft_tokens=3, stop_token_ids=())
    samples = [tuple(engine.generate(prompt, SamplingParams(temperature=1.5, top_k=3, max_new_tokens=2, seed=s),
                                     response_format=json_answer).tokens) for s in range(1500)]
    if kind == "grammar_copy_model":
        assert engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=1.5, top_k=3),
                               response_format=json_answer).stats.drafted >= 1  # the forced "{" was drafted
    assert set(samples) <= set(exact)
    tv_small, tv_large = tv_distance(samples[:150], exact), tv_distance(samples, exact)
    assert tv_large < 0.06, tv_large
    assert tv_large < tv_small
