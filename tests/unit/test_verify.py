"""Hand-built logits: the accept/reject rules case by case (cf. vLLM's test_rejection_sampler.py)."""

from __future__ import annotations

import pytest
import torch

from agentspec.types import DraftProposal, SamplingParams, SparseDist
from agentspec.verify import greedy_ids, sampling_probs, tree_attention, verify_greedy, verify_sampled

V = 8


def logits_for(argmaxes: list[int]) -> torch.Tensor:
    """[len, V] logits whose row i has its maximum at argmaxes[i]."""
    rows = torch.zeros(len(argmaxes), V)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


def onehot(rows: list[int]) -> torch.Tensor:
    probs = torch.zeros(len(rows), V)
    for i, a in enumerate(rows):
        probs[i, a] = 1.0
    return probs


class TestGreedy:
    def test_perfect_match_gives_bonus(self):
        r = verify_greedy(logits_for([3, 4, 5, 6]), [3, 4, 5])
        assert r.accepted_tokens == (3, 4, 5) and r.next_token == 6 and r.bonus
        assert r.output_tokens == (3, 4, 5, 6)

    def test_early_mismatch_recovers_target_token(self):
        r = verify_greedy(logits_for([3, 4, 5, 6]), [3, 7, 5])
        assert r.accepted_tokens == (3,) and r.next_token == 4 and not r.bonus

    def test_first_token_wrong(self):
        r = verify_greedy(logits_for([3, 4, 5, 6]), [2, 4, 5])
        assert r.num_accepted == 0 and r.next_token == 3 and not r.bonus

    def test_empty_draft_is_a_plain_step(self):
        r = verify_greedy(logits_for([6]), [])
        assert r.output_tokens == (6,) and r.bonus

    def test_stop_token_inside_draft_ends_the_round(self):
        r = verify_greedy(logits_for([3, 1, 5, 6]), [3, 1, 5], stop_token_ids={1})
        assert r.accepted_tokens == (3, 1) and r.next_token is None
        assert r.output_tokens == (3, 1)

    def test_stop_token_as_recovered_token(self):
        r = verify_greedy(logits_for([3, 1, 5]), [3, 2], stop_token_ids={1})
        assert r.output_tokens == (3, 1)

    def test_row_count_is_checked(self):
        with pytest.raises(ValueError, match="logit rows"):
            verify_greedy(logits_for([3, 4]), [3, 4])

    def test_tree_follows_the_matching_child(self):
        # root children: 0 (tok 2), 1 (tok 3); node 1 children: 2 (tok 5), 3 (tok 4); node 3 child: 4 (tok 7)
        tokens, parents = [2, 3, 5, 4, 7], [-1, -1, 1, 1, 3]
        # rows: root, after node0, node1, node2, node3, node4
        logits = logits_for([3, 0, 4, 0, 6, 0])
        r = verify_greedy(logits, tokens, parents)
        assert r.accepted_nodes == (1, 3) and r.accepted_tokens == (3, 4)
        assert r.next_token == 6 and not r.bonus  # node 3 has a child (tok 7) that was rejected

    def test_tree_bonus_at_leaf(self):
        tokens, parents = [2, 3, 4], [-1, -1, 1]
        r = verify_greedy(logits_for([3, 0, 4, 5]), tokens, parents)
        assert r.accepted_nodes == (1, 2) and r.next_token == 5 and r.bonus


class TestSampled:
    def test_point_mass_target_accepts_matching_draft(self):
        r = verify_sampled(onehot([3, 4, 5]), [3, 4], None)
        assert r.output_tokens == (3, 4, 5) and r.bonus

    def test_point_mass_target_rejects_other_draft(self):
        r = verify_sampled(onehot([3, 4, 5]), [3, 6], None, generator=torch.Generator().manual_seed(0))
        assert r.accepted_tokens == (3,) and r.next_token == 4

    def test_residual_excludes_rejected_token(self):
        # target 50/50 on {2, 3}; deterministic draft 2 rejected w.p. 1/2, and then the residual is all on 3
        target = torch.zeros(2, V)
        target[0, 2] = target[0, 3] = 0.5
        target[1, 0] = 1.0
        g = torch.Generator().manual_seed(0)
        outs = {verify_sampled(target, [2], None, generator=g).output_tokens for _ in range(200)}
        assert outs == {(2, 0), (3,)}

    def test_draft_token_outside_its_proposal_is_an_error(self):
        with pytest.raises(ValueError, match="support"):
            verify_sampled(onehot([3, 4]), [3], [SparseDist((4,), (1.0,))])

    def test_stop_token_inside_draft(self):
        r = verify_sampled(onehot([3, 1, 5]), [3, 1], None, stop_token_ids={1})
        assert r.output_tokens == (3, 1) and r.next_token is None

    def test_siblings_tried_in_turn(self):
        # target is a point mass on 4; root has children 3 then 4; the second sibling must be accepted
        r = verify_sampled(onehot([4, 0, 6]), [3, 4], None, parents=[-1, -1],
                           generator=torch.Generator().manual_seed(0))
        assert r.accepted_nodes == (1,) and r.next_token == 6 and r.bonus


def test_sampling_probs_processing():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert torch.allclose(sampling_probs(logits, SamplingParams(temperature=1.0)), torch.softmax(logits, -1))
    top2 = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert top2[0, :2].sum() == 0 and torch.isclose(top2.sum(), torch.tensor(1.0))
    # softmax = [0.032, 0.087, 0.237, 0.644]: 0.644 alone covers top_p=0.5, top_p=0.7 needs two tokens
    assert (sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))[0] > 0).tolist() == [0, 0, 0, 1]
    nucleus = sampling_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert (nucleus[0] > 0).tolist() == [False, False, True, True]
    assert torch.isclose(nucleus.sum(), torch.tensor(1.0))


def test_tree_attention_mask_and_positions():
    # 2 cached, 1 pending, nodes: 0 <- root, 1 <- root, 2 <- 1
    mask, pos = tree_attention([-1, -1, 1], num_cached=2, num_pending=1, dtype=torch.float32, device="cpu")
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 1, 1, 0, 0, 0],  # pending token: cached + itself
        [1, 1, 1, 1, 0, 0],  # node 0
        [1, 1, 1, 0, 1, 0],  # node 1
        [1, 1, 1, 0, 1, 1],  # node 2 sees node 1
    ]
    assert pos.tolist() == [[2, 3, 3, 4]]


def test_draft_proposal_validates_topology():
    with pytest.raises(ValueError, match="topological"):
        DraftProposal(tokens=(1, 2), parents=(1, -1))
    assert DraftProposal(tokens=(1, 2, 3), parents=(-1, -1, 1)).depth() == 2
    assert not DraftProposal(tokens=(1, 2), parents=(-1, 0)).is_tree


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_takes_the_first_of_equal_maxima(dtype):
    """greedy_ids stands in for argmax on the target's rows: ties (common in bf16) must go to the lower id
    as argmax's do, or speculative greedy output would part from plain decoding at a tie."""
    gen = torch.Generator().manual_seed(0)
    for width in (7, 151_936):  # a short row and a real vocabulary's (the kernels vectorise long rows)
        rows = torch.randint(0, 3, (13, width), generator=gen).to(dtype)  # every row full of tied maxima
        rows[3, width - 1] = 5  # a unique maximum at the end
        rows[4, :] = 0  # a row that is all one value
        ids = greedy_ids(rows)
        assert torch.equal(ids, rows.argmax(dim=-1))
        assert ids[4] == 0 and ids[3] == width - 1
        assert torch.equal(greedy_ids(rows[0]), rows[0].argmax(dim=-1))  # one row, no batch dimension
