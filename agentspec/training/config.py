"""The single source of ``agentspec train``'s defaults: :class:`TrainConfig` (CLI flags are built from it)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

# the names agentspec.models.resolve_dtype takes (kept here: this module must not import torch)
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")


def _f(default: Any, help: str, required: bool = False) -> Any:
    """A field with its flag's help (``required``: ``agentspec train`` needs the flag)."""
    return field(default=default, metadata={"help": help, "required": required})


@dataclass
class TrainConfig:
    """What to distil, from what, and how. Defaults finish within an hour on 2 CPU cores (0.5B target)."""

    target: str = _f("qwen2.5-coder-0.5b-instruct", "alias, directory, GGUF or cached hub id", required=True)
    output: str = _f("drafters/out", "drafter directory (a --draft-model, an edge drafter)", required=True)
    drafter: str = _f("", "an existing same-tokenizer model to fine-tune; empty: build one (see --init)")
    init: str = _f("from-target", "from-target: the target's first --init-layers layers; scratch: new layers")
    init_layers: int = _f(2, "decoder layers of a built drafter")
    copy_embeddings: bool = _f(True, "scratch: start from the target's embeddings and output head")
    train_embeddings: bool = _f(False, "full fine-tuning: also train the (large) embeddings and output head")
    data: str = _f("bfcl:simple_python,multiple,parallel,live_simple",
                   "prompts: bfcl:<categories> or JSONL paths, comma-separated")
    split: str = _f("id", "held-out split: id (a stable hash of each id) or category")
    heldout_fraction: float = _f(0.2, "split by id: the share held out")
    heldout_categories: str = _f("live_simple", "split by category: these categories are held out")
    max_train_prompts: int = _f(240, "most training prompts")
    max_heldout_prompts: int = _f(24, "most held-out prompts (evaluation)")
    temperatures: str = _f("0", "the target's responses: greedy (0) and/or sampled at these temperatures")
    max_new_tokens: int = _f(96, "most tokens of each target response")
    verifier_url: str = _f("", "distil through an agentspec-verifier at this URL instead of a local target")
    epochs: int = _f(3, "passes over the training responses")
    batch_size: int = _f(8, "sequences per optimiser step")
    lr: float = _f(5e-4, "peak learning rate")
    warmup_steps: int = _f(10, "linear learning-rate warm-up steps")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_len: int = _f(768, "most tokens of prompt + response (prompts are cut from the left)")
    kl_weight: float = _f(0.0, "> 0: add KL(target || drafter) on response tokens (a target pass per batch)")
    draft_vocab: int = _f(8192, "> 0: the drafter's output head keeps this many token ids")
    train_head: bool = _f(False, "draft vocab > 0, full fine-tuning: also train the reduced head's rows")
    lora_rank: int = _f(0, "> 0: train LoRA adapters (peft) and merge them into the saved drafter")
    checkpoint_every: int = _f(25, "steps between checkpoints (and always at the end)")
    eval_ks: str = _f("2,4,8", "draft lengths to evaluate acceptance at, comma-separated")
    eval_before: bool = _f(True, "also evaluate the untrained drafter")
    device: str = _f("auto", "auto, cpu, cuda[:N] or mps")
    dtype: str = _f("float32", "training dtype (bf16 is emulated on many CPUs; fp32 is faster there)")
    drafter_dtype: str = _f("", "the drafter's dtype while it trains (empty: --dtype); float32 with a bf16 "
                            "target keeps the small weight updates that bf16 rounds away")
    eval_dtype: str = _f("bfloat16", "the dtype acceptance and speed-up are measured in")
    seed: int = _f(0, "random seed")
    threads: int = _f(0, "torch threads (0: torch's default)")

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
        for name, allowed in (("dtype", DTYPES), ("drafter_dtype", ("", *DTYPES)), ("eval_dtype", DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        _ = self.ks, self.temps  # parse (and so validate) eval_ks and temperatures

    @property
    def drafter_train_dtype(self) -> str:
        """The dtype the drafter trains in: ``drafter_dtype``, else ``dtype``."""
        return self.drafter_dtype or self.dtype

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
        return asdict(self)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A config from a JSON file (keys are the field names), then ``overrides``."""
        values = json.loads(Path(path).read_text())
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown config keys {sorted(unknown)}")
        return cls(**{**values, **overrides})
