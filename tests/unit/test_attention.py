"""agentspec's CPU attention (SDPA reading grouped key/value heads in place) computes what transformers' SDPA
path computes: bit for bit for chains over a cache, trees under their mask and packed batches (bf16 over long
contexts: up to a last bit in a few elements); one-token steps up to rounding (another summation order), and
bit for bit what the last row of a pass over several tokens computes."""

from __future__ import annotations

from types import SimpleNamespace

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
    for a, b in zip(ours[:-1], stock[:-1], strict=True):
        assert torch.equal(a, b)
    # the one-token step: stock runs SDPA's per-head GQA kernel, we run grouped rows (another summation order)
    torch.testing.assert_close(ours[-1], stock[-1], atol=1e-5, rtol=1e-5)


def _fp32_gemm_rows_are_independent() -> bool:
    """Whether this CPU's fp32 matrix product gives a row the same bits alone as among others."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 128, generator=g), torch.randn(128, 46, generator=g)
    return torch.equal(a[-1:] @ b, (a @ b)[-1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("context", [40, 1500])
def test_a_one_token_step_attends_as_the_last_row_of_a_longer_pass(dtype, context):
    """A 1.5B's heads (12 query, 2 key/value, 128 wide): a one-token step over the cache gives, bit for bit, the
    last row of a masked pass over the same keys (the row that sees them all), as a decode step and a verify
    pass should; and (fp32) what repeating each key/value head per query head gives."""
    from agentspec.models.attention import _attention, _grouped_rows

    torch.manual_seed(0)
    q = torch.randn(1, 12, 6, 128, dtype=dtype)
    k, v = torch.randn(1, 2, context + 6, 128, dtype=dtype), torch.randn(1, 2, context + 6, 128, dtype=dtype)
    mask, _ = tree_attention([-1, 0, 1, 2, 3, 4], context, 0, dtype, "cpu")
    chain = _grouped_rows(q, k, v, mask, 0.0, None)
    step = _grouped_rows(q[:, :, -1:], k, v, None, 0.0, None)
    if dtype == torch.float32 and not _fp32_gemm_rows_are_independent():
        # MKL on Intel CPUs sums a product of few rows (under 16) in another order than a row of a longer
        # one: a one-row step over it does not get a pass row's bits; only rounding may differ
        torch.testing.assert_close(step[:, 0], chain[:, -1], atol=1e-6, rtol=1e-5)
    else:
        assert torch.equal(step[:, 0], chain[:, -1])
    routed, _ = _attention(SimpleNamespace(num_key_value_groups=6, layer_idx=0), q[:, :, -1:], k, v, None)
    assert torch.equal(routed, step)  # a decode step (no mask) runs grouped rows
    if dtype == torch.float32:
        stock = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, -1:], k.repeat_interleave(6, 1), v.repeat_interleave(6, 1)).transpose(1, 2)
        torch.testing.assert_close(step, stock, atol=1e-6, rtol=1e-5)


def test_load_model_runs_cpu_inference_models_on_it(tmp_path):
    target = tiny_model(0)
    target.model.save_pretrained(tmp_path)
    target.tokenizer.save_pretrained(tmp_path)
    loaded = models.load_model(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.model.config._attn_implementation == attention_name()
    trainable = models.load_model(str(tmp_path), device="cpu", dtype="float32", pack_linears=False)
    assert trainable.model.config._attn_implementation == "sdpa"  # a model to train keeps transformers' own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_rows_attend_as_repeated_heads_do_over_an_agents_context(dtype):
    """A 1.5B's heads (12 query, 2 key/value, 128 wide) over 1,800 cached tokens and a 12-node tree: each
    key/value head's query heads as rows of one head give what repeating the key/value heads gives."""
    from agentspec.models.attention import _grouped_rows

    torch.manual_seed(0)
    q = torch.randn(1, 12, 12, 128, dtype=dtype)
    k, v = torch.randn(1, 2, 1812, 128, dtype=dtype), torch.randn(1, 2, 1812, 128, dtype=dtype)
    mask, _ = tree_attention([-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7], 1800, 0, dtype, "cpu")
    stock = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(6, 1), v.repeat_interleave(6, 1),
                                                             attn_mask=mask).transpose(1, 2)
    ours = _grouped_rows(q, k, v, mask, 0.0, None)
    if dtype == torch.float32:
        assert torch.equal(ours, stock)
    else:
        torch.testing.assert_close(ours, stock, atol=1e-4, rtol=1e-2)
