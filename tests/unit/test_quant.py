"""A drafter's weight-only int8/int4 linears: they compute their dequantised weights, refuse what they cannot
do, and quantise a whole model (its tied head included) without touching its embeddings."""

from __future__ import annotations

import copy

import pytest
import torch

from agentspec import models
from agentspec.models import QuantLinear, is_quantized, quantize_linears
from tests.helpers import tiny_model


def dequantised(w: torch.Tensor, scheme: str, group: int = 32) -> torch.Tensor:
    """What the kernel should multiply by: round to nearest, int8 symmetric per row, int4 min/max per group."""
    w = w.float()
    if scheme == "int8":
        scale = w.abs().amax(1, keepdim=True) / 127
        return torch.round(w / scale) * scale
    g = w.reshape(w.shape[0], -1, group)
    low, high = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
    scale = (high - low) / 15
    return (torch.round((g - low) / scale).clamp(0, 15) * scale + low).reshape(w.shape)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows", [16, 100, 7])  # the int4 packing pads rows to tiles of 16
def test_a_quantised_linear_computes_its_dequantised_weight(scheme, rows):
    torch.manual_seed(rows)
    w, b, x = torch.randn(rows, 64), torch.randn(rows), torch.randn(3, 5, 64)
    q = QuantLinear(w, b, scheme)
    out = q(x)
    assert out.shape == (3, 5, rows) and out.dtype == torch.float32
    expected = torch.nn.functional.linear(x, dequantised(w, scheme), b)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert (out - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3  # it really is rounded


def test_bf16_activations_stay_bf16():
    w, x = torch.randn(32, 64, dtype=torch.bfloat16), torch.randn(2, 64, dtype=torch.bfloat16)
    out = QuantLinear(w, None, "int4")(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x.float() @ dequantised(w, "int4").T, atol=0.1, rtol=0.02)


def test_what_cannot_be_quantised_is_refused():
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        QuantLinear(torch.randn(16, 64), None, "int3")
    with pytest.raises(ValueError, match="multiple of the group size"):
        QuantLinear(torch.randn(16, 48), None, "int4", group_size=32)
    q = QuantLinear(torch.randn(16, 64), None, "int4")
    with pytest.raises(RuntimeError, match="lives on the CPU in torch.float32"):
        q.to(torch.float16)
    with pytest.raises(ValueError, match="unknown quantisation"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(4, 4)), "nf4")
    with pytest.raises(ValueError, match="unknown quantize 'int2'"):
        models.load_model("qwen2.5-coder-0.5b-instruct", device="cpu", quantize="int2")
    with pytest.raises(ValueError, match="exclusive"):
        models.load_model("qwen2.5-coder-0.5b-instruct", device="cpu", quantize="int4", pack_linears=True)
    with pytest.raises(ValueError, match="quantize_dense_rows applies to quantised linears only"):
        models.load_model("qwen2.5-coder-0.5b-instruct", device="cpu", quantize_dense_rows=None)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_whole_model_is_quantised_its_tied_head_included(scheme):
    model = copy.deepcopy(tiny_model(seed=3).model).cpu()
    model.lm_head.weight = model.model.embed_tokens.weight  # tie it, as Qwen2.5-0.5B's head is
    model.config.tie_word_embeddings = True
    embeddings = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([[5, 17, 42, 8, 3]])
    with torch.no_grad():
        before = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_linears(model, scheme) == linears and is_quantized(model)
    assert isinstance(model.lm_head, QuantLinear) and not model.config.tie_word_embeddings
    assert torch.equal(model.model.embed_tokens.weight, embeddings)  # the input side is untouched
    with torch.no_grad():
        after = model(ids).logits
    # a drafter's rounding: close to the dense model's logits, not equal
    assert 0 < (after - before).abs().max() < 0.25 * before.abs().max()


def test_an_int4_group_that_does_not_divide_a_width_leaves_that_linear_dense():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    assert quantize_linears(model, "int4", group_size=32) == 2
    assert [type(m).__name__ for m in model] == ["QuantLinear", "QuantLinear", "Linear"]


def test_inputs_of_dense_rows_or_more_run_the_kept_dense_linear():
    torch.manual_seed(0)
    dense = torch.nn.Linear(64, 48)
    q = QuantLinear(dense.weight, dense.bias, "int4", dense=dense, dense_rows=4)
    with torch.no_grad():
        for rows in (1, 3):  # steps: the quantised weights
            x = torch.randn(rows, 64)
            torch.testing.assert_close(q(x), torch.nn.functional.linear(x, dequantised(dense.weight, "int4"),
                                                                        dense.bias), atol=1e-4, rtol=1e-4)
        x = torch.randn(2, 2, 64)  # four rows in all: a prefill, at the dense weight's own precision
        assert torch.equal(q(x), dense(x))
    assert "dense from 4 rows" in repr(q)
    with pytest.raises(ValueError, match="dense_rows must be >= 2"):
        QuantLinear(dense.weight, dense.bias, "int4", dense=dense, dense_rows=1)


def test_a_quantised_model_prefills_at_dense_precision_and_its_tied_head_shares_the_embeddings():
    model = copy.deepcopy(tiny_model(seed=3).model).cpu()
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    lean = copy.deepcopy(model)
    prompt = torch.tensor([[5, 17, 42, 8, 3, 9, 11, 2, 30, 7]])
    assert prompt.shape[1] >= models.DENSE_ROWS
    with torch.no_grad():
        before = model(prompt).logits
    n = quantize_linears(model, "int4")
    assert quantize_linears(model, "int4") == 0  # the kept dense linears are not quantised again
    assert quantize_linears(lean, "int4", dense_rows=None) == n
    assert model.lm_head.dense.weight is model.model.embed_tokens.weight  # no second copy of that matrix
    assert all(m.dense is None for m in lean.modules() if isinstance(m, QuantLinear))
    with torch.no_grad():
        prefill, rounded = model(prompt).logits, lean(prompt).logits
        step = model(prompt[:, :1]).logits  # one row: the quantised weights
    torch.testing.assert_close(prefill, before, atol=1e-4, rtol=1e-4)  # packed vs stock: summation order only
    assert (rounded - before).abs().max() > 1e-3
    torch.testing.assert_close(step, lean(prompt[:, :1]).logits)
    with pytest.raises(ValueError, match="dense_rows must be None or >= 2"):
        quantize_linears(copy.deepcopy(lean), "int8", dense_rows=0)
