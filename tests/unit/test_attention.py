"""agentspec's CPU attention (SDPA reading grouped key/value heads in place) computes what transformers' SDPA
path computes, bit for bit: chains over a cache, trees under their mask, one-token steps, packed batches."""

from __future__ import annotations

import pytest
import torch

from agentspec import models
from agentspec.models.attention import attention_name, use_agentspec_attention
from agentspec.verify import tree_attention
from tests.helpers import make_prompt, tiny_model


def _passes(model) -> list[torch.Tensor]:
    """A prefill, a chain over the cache, a tree under its mask, a one-token step: each pass's logits."""
    prompt = make_prompt(1, 60)
    cache = models.new_cache(model)
    out = [models.forward(model, prompt[:50], cache, 50), models.forward(model, prompt[50:58], cache, 8)]
    mask, positions = tree_attention([-1, 0, 0, 1, 2, -1], 58, 0, model.dtype, model.device)
    out.append(models.forward(model, prompt[:6], cache, 6, mask, positions))
    models.crop_cache(cache, 58)
    out.append(models.forward(model, prompt[58:59], cache, 1))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_agentspec_attention_is_sdpa_bit_for_bit(dtype):
    target = tiny_model(3, dtype=dtype)
    model = target.model
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    use_agentspec_attention(model)
    assert model.config._attn_implementation == attention_name()
    ours = _passes(model)
    model.config._attn_implementation = "sdpa"  # transformers' own: repeats each key/value head per query head
    stock = _passes(model)
    for a, b in zip(ours, stock, strict=True):
        assert torch.equal(a, b)


def test_load_model_runs_cpu_inference_models_on_it(tmp_path):
    target = tiny_model(0)
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    loaded = models.load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.model.config._attn_implementation == attention_name()
    trainable = models.load_model(str(tmp_path), device="cpu", dtype="float32", pack_linears=False)
    assert trainable.model.config._attn_implementation == "sdpa"  # a model to train keeps transformers' own
