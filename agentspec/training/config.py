"""The single source of ``agentspec train``'s defaults: :class:`TrainConfig` (CLI flags are built from it)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class TrainConfig:
    """What to distil, from what, and how. Defaults finish within an hour on 2 CPU cores for a 0.5B target."""

    target: str = "qwen2.5-coder-0.5b-instruct"  # alias, directory, GGUF file or hub id (cache only)
    output: str = "drafters/out"  # the drafter directory (loads as --draft-model and as an edge drafter)
    drafter: str = ""  # an existing same-tokenizer model to fine-tune; empty: build one (see init)
    init: str = "from-target"  # "from-target": the target's first init_layers layers; "scratch": new layers
    init_layers: int = 2
    copy_embeddings: bool = True  # scratch: start from the target's embeddings and output head
    train_embeddings: bool = False  # full fine-tuning: also train the (large) embeddings and output head
    data: str = "bfcl:simple_python,multiple,parallel,live_simple"  # "bfcl:<categories>" or JSONL paths, comma-separated
    split: str = "id"  # held-out split: "id" (a stable hash of each id) or "category"
    heldout_fraction: float = 0.2  # split by id: the share held out
    heldout_categories: str = "live_simple"  # split by category: these categories are held out
    max_train_prompts: int = 240
    max_heldout_prompts: int = 24
    temperatures: str = "0"  # the target's responses: greedy (0) and/or sampled at these temperatures
    max_new_tokens: int = 96
    verifier_url: str = ""  # distil through an agentspec-verifier instead of a local target
    epochs: int = 3
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_len: int = 768  # prompt tokens are cut from the left to fit prompt + response
    kl_weight: float = 0.0  # > 0: add KL(target ‖ drafter) on response tokens (one target pass per batch)
    draft_vocab: int = 8192  # > 0: the drafter's output head keeps this many token ids (see distill.draft_vocabulary)
    train_head: bool = False  # draft_vocab > 0, full fine-tuning: also train the reduced head's rows
    lora_rank: int = 0  # > 0: train LoRA adapters (peft) and merge them into the saved drafter
    checkpoint_every: int = 25  # steps between checkpoints (and always at the end)
    eval_ks: str = "2,4,8"
    eval_before: bool = True
    device: str = "auto"
    dtype: str = "float32"  # training dtype (bf16 is emulated on many CPUs; fp32 is faster there)
    eval_dtype: str = "bfloat16"  # the dtype acceptance and speed-up are measured in
    seed: int = 0
    threads: int = 0  # torch threads (0: torch's default)

    def __post_init__(self) -> None:
        if self.init not in ("from-target", "scratch"):
            raise ValueError(f"init must be 'from-target' or 'scratch', got {self.init!r}")
        if self.split not in ("id", "category"):
            raise ValueError(f"split must be 'id' or 'category', got {self.split!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for name in ("init_layers", "epochs", "batch_size", "max_len", "max_new_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.kl_weight < 0 or self.lora_rank < 0 or self.draft_vocab < 0:
            raise ValueError("lr must be > 0; kl_weight, lora_rank and draft_vocab must be >= 0")
        _ = self.ks, self.temps  # parse (and so validate) eval_ks and temperatures

    @property
    def ks(self) -> list[int]:
        ks = [int(k) for k in self.eval_ks.split(",") if k.strip()]
        if not ks or min(ks) < 1:
            raise ValueError(f"eval_ks must be positive integers, got {self.eval_ks!r}")
        return ks

    @property
    def temps(self) -> list[float]:
        temps = [float(t) for t in self.temperatures.split(",") if t.strip()]
        if not temps or min(temps) < 0:
            raise ValueError(f"temperatures must be >= 0, got {self.temperatures!r}")
        return temps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A config from a JSON file (keys are the field names), then ``overrides``."""
        values = json.loads(Path(path).read_text())
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown config keys {sorted(unknown)}")
        return cls(**{**values, **overrides})
