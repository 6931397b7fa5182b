"""A drafter from ``agentspec train`` loads as the server's ``--draft-model`` (co-located mode) and as the
client's edge drafter; both stay lossless."""

from __future__ import annotations

import gc

from agentspec import models
from agentspec.client import SpecClient
from agentspec.drafters.model import ModelDrafter
from agentspec.local import SpecEngine
from agentspec.toolcalls import render_chat
from agentspec.training.run import run_training
from agentspec.types import SamplingParams
from agentspec.verifier_server.cli import build_engine, parse_args
from agentspec.verifier_server.local import LocalVerifier
from tests.helpers import plain_greedy
from tests.unit.test_train import config


def test_trained_drafter_loads_in_the_server_and_the_client(tmp_path, target):
    # LoRA: merged into the saved weights; a reduced output vocabulary of 40 of the 97 ids
    cfg = config(tmp_path, "drafter", epochs=1, lora_rank=4, draft_vocab=40)
    report = run_training(cfg, target=target)
    assert report["finished"] and (tmp_path / "drafter" / "report.md").exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "drafter" / "model.safetensors"), "pt") as f:  # the merged weights, by name
        saved = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in saved and "model.layers.0.mlp.down_proj.weight" in saved
    assert not [k for k in saved if "lora_" in k or "base_layer" in k], "LoRA adapters saved unmerged"
    drafter = models.load_model(cfg.output, dtype="float32")
    assert drafter.model.config.num_hidden_layers == 1 and not hasattr(drafter.model, "peft_config")
    assert report["draft_vocab"] == 40 and drafter.model.get_output_embeddings().weight.shape[0] == 40
    assert set(target.tokenizer.all_special_ids) <= set(drafter.model.agentspec_token_map.tolist())
    messages = [{"role": "user", "content": "look up item 3"}]
    prompt = render_chat(target.tokenizer, messages)
    reference = plain_greedy(target, prompt, 24)
    out = SpecEngine(target, ModelDrafter(drafter), num_draft_tokens=3).generate(prompt, SamplingParams(max_new_tokens=24))
    assert out.tokens == reference  # in process (what the server's co-located mode runs)
    with LocalVerifier(target, draft_model=drafter) as v:
        assert v.engine.draft_model is drafter
        server_mode = SpecClient(v.url, tokenizer=target.tokenizer, mode="server")
        edge_mode = SpecClient(v.url, drafter=ModelDrafter(drafter), tokenizer=target.tokenizer, mode="edge")
        assert server_mode.generate(messages, max_tokens=24).tokens == reference
        assert edge_mode.generate(messages, max_tokens=24).tokens == reference
    # the output directory is also a model agentspec-verifier serves; its loader leaves the heap frozen
    engine = build_engine(parse_args([cfg.output, "--draft-model", cfg.output, "--dtype", "float32"]))
    try:
        assert engine.draft_model is not None and gc.get_freeze_count() > 0
        assert engine.target.model.config.num_hidden_layers == 1
    finally:
        gc.unfreeze()
        engine.shutdown()


def test_client_request_log_feeds_training_data(tmp_path, target):
    from agentspec.training.data import load_examples

    log = tmp_path / "requests.jsonl"
    with LocalVerifier(target) as v:
        client = SpecClient(v.url, tokenizer=target.tokenizer, mode="server-ar", log_path=log)
        client.generate([{"role": "user", "content": "look up item 1"}], max_tokens=6)
        client.generate([{"role": "user", "content": "look up item 2"}], max_tokens=6)
    examples = load_examples(str(log))
    assert [e.messages[-1]["content"] for e in examples] == ["look up item 1", "look up item 2"]
