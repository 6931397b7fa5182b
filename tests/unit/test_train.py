"""``agentspec train`` on tiny models: data loading and splits, resumable training, and an output
directory that loads as the server's ``--draft-model`` and as the client's edge drafter (lossless)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from agentspec import models
from agentspec.cli import build_parser
from agentspec.training import data, distill
from agentspec.training.config import TrainConfig
from agentspec.training.run import run_training

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]


def write_jsonl(path, n: int = 12) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "category": "odd" if i % 2 else "even",
                                "messages": [{"role": "user", "content": f"look up item {i} please"}],
                                "tools": TOOLS}) + "\n")


def config(tmp_path, out: str, **kw) -> TrainConfig:
    path = tmp_path / "prompts.jsonl"
    if not path.exists():
        write_jsonl(path)
    base = dict(target="tiny", output=str(tmp_path / out), data=str(path), heldout_fraction=0.3, init_layers=1,
                epochs=2, batch_size=4, lr=3e-3, warmup_steps=1, max_new_tokens=8, eval_ks="2", eval_before=False,
                eval_dtype="float32", checkpoint_every=1, max_len=64)
    return TrainConfig(**{**base, **kw})


def test_config_validates_and_cli_builds_it(tmp_path):
    with pytest.raises(ValueError):
        TrainConfig(init="magic")
    with pytest.raises(ValueError):
        TrainConfig(eval_ks="0")
    with pytest.raises(ValueError, match="drafter_dtype"):
        TrainConfig(drafter_dtype="float64")
    (tmp_path / "c.json").write_text(json.dumps({"epochs": 5, "lora_rank": 4}))
    cfg = TrainConfig.from_file(tmp_path / "c.json", epochs=7)
    assert (cfg.epochs, cfg.lora_rank) == (7, 4)
    (tmp_path / "bad.json").write_text(json.dumps({"epochz": 5}))
    with pytest.raises(ValueError, match="epochz"):
        TrainConfig.from_file(tmp_path / "bad.json")
    args = build_parser().parse_args(["train", "--target", "t", "--output", "o", "--epochs", "2", "--eval-before",
                                      "false"])
    assert (args.target, args.epochs, args.eval_before, args.lr) == ("t", 2, False, None)


def test_config_dtype_names_are_the_loaders() -> None:
    from agentspec.training.config import DTYPES

    assert set(DTYPES) == set(models.loading.DTYPES) | {"auto"}


def test_the_drafter_trains_in_its_own_dtype(tmp_path, target):
    """A bf16 target with an fp32 drafter: the drafter is built, and trained, in fp32; the recipe says so."""
    cfg = config(tmp_path, "mixed", dtype="bfloat16", drafter_dtype="float32")
    bf16 = models.LoadedModel(copy.deepcopy(target.model).to(torch.bfloat16), target.tokenizer, target.name,
                              target.device, torch.bfloat16)  # a copy: the fixture is shared
    drafter = distill.init_drafter(bf16, cfg)
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    assert {p.dtype for p in distill.init_drafter(bf16, config(tmp_path, "same", dtype="bfloat16")).parameters()
            } == {torch.bfloat16}
    assert distill._recipe(cfg, 3)["drafter_dtype"] == "float32"
    assert "drafter_dtype" not in distill._recipe(config(tmp_path, "plain"), 3)  # older checkpoints resume


def test_jsonl_and_splits(tmp_path):
    path = tmp_path / "p.jsonl"
    write_jsonl(path)
    examples = data.load_examples(str(path))
    assert len(examples) == 12 and examples[0].tools[0]["function"]["name"] == "lookup"
    train, held = data.split(examples, "id", 0.3)
    assert {e.id for e in train}.isdisjoint({e.id for e in held}) and len(train) + len(held) == 12
    assert data.split(examples, "id", 0.3) == (train, held)  # stable
    train, held = data.split(examples, "category", heldout_categories=["odd"])
    assert {e.category for e in held} == {"odd"} and {e.category for e in train} == {"even"}
    (tmp_path / "bad.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(ValueError, match="messages"):
        data.load_examples(str(tmp_path / "bad.jsonl"))
    # a logged request with its answer: the answer is not part of the prompt
    (tmp_path / "log.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n")
    assert [m["role"] for m in data.load_examples(str(tmp_path / "log.jsonl"))[0].messages] == ["user"]


def test_interrupted_training_resumes_to_the_same_loss(tmp_path, target):
    full = run_training(config(tmp_path, "full", epochs=4), target=target)
    assert full["finished"] and full["train_steps"] == len(full["losses"])
    per_epoch = full["train_steps"] // 4
    first, last = full["losses"][:per_epoch], full["losses"][-per_epoch:]
    assert sum(last) / per_epoch < 0.8 * sum(first) / per_epoch  # it learns the target's responses
    part = run_training(config(tmp_path, "resumed", epochs=4), target=target, stop_after=2)
    assert not part["finished"] and part["train_steps"] == 2
    resumed = run_training(config(tmp_path, "resumed", epochs=4), target=target)
    assert resumed["finished"] and resumed["train_steps"] == full["train_steps"]
    assert resumed["final_loss"] == pytest.approx(full["final_loss"], rel=1e-4, abs=1e-5)
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-4, abs=1e-5)
    assert set(full["train_ids"]).isdisjoint(full["heldout_ids"])
    part = run_training(config(tmp_path, "changed", epochs=4), target=target, stop_after=1)
    with pytest.raises(ValueError, match="different training run"):  # another recipe must not resume it
        run_training(config(tmp_path, "changed", epochs=5), target=target)
    assert full["after"]["by_k"][2]["identical_to_plain"]


@pytest.mark.parametrize("train_head", [False, True])
def test_reduced_head_trains_as_it_drafts_and_saves_full_size(tmp_path, target, train_head):
    from safetensors.torch import load_file

    cfg = config(tmp_path, f"head{int(train_head)}", epochs=1, draft_vocab=40, train_head=train_head)
    assert run_training(cfg, target=target)["finished"]
    out = tmp_path / f"head{int(train_head)}"
    vocab = json.loads((out / models.DRAFT_VOCAB_FILE).read_text())
    saved = next(v for k, v in load_file(out / "model.safetensors").items() if k.endswith("lm_head.weight"))
    original = target.model.get_output_embeddings().weight.detach().float()
    assert saved.shape == original.shape  # a plain checkpoint of the target's architecture
    outside = torch.ones(len(original), dtype=torch.bool)
    outside[vocab] = False
    assert torch.equal(saved[outside], original[outside])
    assert torch.equal(saved[vocab], original[vocab]) != train_head  # trained rows were written back
    loaded = models.load_model(cfg.output, dtype="float32", pack_linears=False).model
    assert torch.equal(loaded.get_output_embeddings().weight, saved[vocab])


def test_tokens_outside_a_reduced_head_carry_no_loss(tmp_path, target):
    cfg = config(tmp_path, "outside", epochs=1, draft_vocab=40)
    drafter = distill.init_drafter(target, cfg)
    models.restrict_output_vocab(drafter, range(40))
    samples = [distill.Sample(f"s{i}", 0.0, [1, 2, 3], [50, 60, 70]) for i in range(4)]  # ids >= 40
    state = distill.train(drafter, samples, cfg, tmp_path / "outside.pt")
    assert state.losses == [0.0]
    samples = [distill.Sample("s", 0.0, [1, 2, 3], [5, 60, 7])]
    assert distill.train(drafter, samples, cfg, tmp_path / "inside.pt").losses[0] > 0
