"""One tree-masked forward pass gives every node exactly the logits of a plain forward over its path."""

from __future__ import annotations

import torch

from agentspec import models
from agentspec.verify import tree_attention
from tests.helpers import make_prompt


def test_tree_logits_equal_path_logits(target):
    prompt = make_prompt(4, length=20)
    cached, pending = prompt[:-3], prompt[-3:]
    #          0   1   2   3   4   5   6
    tokens = [10, 11, 12, 13, 14, 15, 16]
    parents = [-1, -1, 0, 0, 1, 4, 2]
    cache = models.new_cache(target.model)
    models.forward(target.model, cached, cache, 1)
    mask, positions = tree_attention(parents, len(cached), len(pending), target.dtype, target.device)
    logits = models.forward(target.model, pending + tokens, cache, len(tokens) + 1, mask, positions)
    assert models.cache_length(cache) == len(prompt) + len(tokens)
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        with torch.inference_mode():
            ref = target.model(torch.tensor([prompt + path], device=target.device)).logits[0, -1]
        torch.testing.assert_close(logits[i + 1], ref, atol=1e-4, rtol=1e-4)
    with torch.inference_mode():
        root = target.model(torch.tensor([prompt], device=target.device)).logits[0, -1]
    torch.testing.assert_close(logits[0], root, atol=1e-4, rtol=1e-4)
