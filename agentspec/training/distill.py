"""Distillation: the target's own responses, a drafter to start from, and a resumable training loop.

:func:`target_responses` caches the target's (lossless) answers in JSONL; :func:`init_drafter` builds the
model to train; :func:`train` checkpoints every ``checkpoint_every`` steps and resumes with the same data
order, so an interrupted run ends where an uninterrupted one does.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentspec import models
from agentspec.local import SpecEngine
from agentspec.toolcalls import render_chat
from agentspec.training.config import TrainConfig
from agentspec.training.data import ChatExample
from agentspec.types import SamplingParams


@dataclass
class Sample:
    """One training sequence: the prompt's ids and the target's response ids (what the drafter learns)."""

    id: str
    temperature: float
    prompt_ids: list[int]
    response_ids: list[int]


def target_responses(target: models.LoadedModel, examples: Sequence[ChatExample], cfg: TrainConfig,
                     path: Path, progress: Callable[[int, int], None] | None = None) -> list[Sample]:
    """The target's responses to ``examples`` at each of ``cfg.temps``, cached in ``path`` (JSONL)."""
    done: dict[tuple[str, float], Sample] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[(rec["id"], rec["temperature"])] = Sample(**rec)
    todo = [(e, t) for e in examples for t in cfg.temps if (e.id, t) not in done]
    generate = _via_verifier(cfg) if cfg.verifier_url else _local(target, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        for i, (example, temperature) in enumerate(todo):
            prompt = render_chat(target.tokenizer, list(example.messages), list(example.tools) or None)
            seed = cfg.seed + int.from_bytes(example.id.encode()[:4].ljust(4, b"\0"), "big")
            response = generate(example, prompt, temperature, seed)
            sample = Sample(example.id, temperature, prompt, response)
            done[(example.id, temperature)] = sample
            f.write(json.dumps(sample.__dict__) + "\n")
            f.flush()
            if progress:
                progress(i + 1, len(todo))
    return [done[(e.id, t)] for e in examples for t in cfg.temps]


def _local(target: models.LoadedModel, cfg: TrainConfig) -> Callable[..., list[int]]:
    from agentspec.drafters import make_drafter

    drafter = make_drafter("default", tokenizer=target.tokenizer)
    engine = SpecEngine(target, drafter, num_draft_tokens=6)  # lossless, just faster

    def generate(example: ChatExample, prompt: list[int], temperature: float, seed: int) -> list[int]:
        params = SamplingParams(temperature=temperature, max_new_tokens=cfg.max_new_tokens, seed=seed)
        return engine.generate(prompt, params, tools=list(example.tools) or None).tokens
    return generate


def _via_verifier(cfg: TrainConfig) -> Callable[..., list[int]]:
    from agentspec.client import SpecClient

    client = SpecClient(cfg.verifier_url, mode="server")  # lossless: drafted answers equal plain ones

    def generate(example: ChatExample, prompt: list[int], temperature: float, seed: int) -> list[int]:
        final = client.generate(list(example.messages), list(example.tools) or None, max_tokens=cfg.max_new_tokens,
                                sampling=SamplingParams(temperature=temperature, seed=seed))
        return list(final.tokens)
    return generate


# -- the drafter --------------------------------------------------------------------------------------


def init_drafter(target: models.LoadedModel, cfg: TrainConfig) -> Any:
    """The model to train (in ``cfg.drafter_train_dtype``, on the target's device), sharing the target's
    tokenizer."""
    from transformers import AutoModelForCausalLM

    vocab = target.model.get_output_embeddings().weight.shape[0]
    if cfg.drafter:
        model = models.load_model(cfg.drafter, device=target.device, dtype=cfg.drafter_train_dtype,
                                  pack_linears=False).model
        if model.get_output_embeddings().weight.shape[0] != vocab:
            raise ValueError(f"drafter {cfg.drafter!r} has another vocabulary than the target ({vocab} ids)")
        return model
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = cfg.init_layers
    if hasattr(config, "layer_types") and config.layer_types:
        config.layer_types = config.layer_types[: cfg.init_layers]
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=models.resolve_dtype(cfg.drafter_train_dtype))
    source = target.model.state_dict()
    keep = {}
    for key, value in model.state_dict().items():
        is_layer = ".layers." in key
        if key in source and (cfg.init == "from-target" or (not is_layer and cfg.copy_embeddings)):
            keep[key] = source[key].to(value.dtype)
    model.load_state_dict(keep, strict=False)
    return model.to(target.device)


# -- training -----------------------------------------------------------------------------------------


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] = field(default_factory=list)


def train(drafter: Any, samples: Sequence[Sample], cfg: TrainConfig, checkpoint: Path,
          target: Any = None, stop_after: int | None = None,
          progress: Callable[[int, int, float], None] | None = None) -> TrainState:
    """Train ``drafter`` in place, resuming from ``checkpoint``; ``stop_after``: steps of this call (tests).

    ``target`` is needed when kl_weight > 0. A reduced output head is trained as it will draft: softmax over
    its rows only (tokens outside it carry no loss: never proposed); ``cfg.train_head`` trains those rows."""
    if not samples:
        raise ValueError("no training samples")
    if cfg.kl_weight > 0 and target is None:
        raise ValueError("kl_weight > 0 needs the target model")
    model = _trainable(drafter, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total = per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps)
                                              * 0.5 * (1 + math.cos(math.pi * min(s / total, 1.0))))
    state = TrainState()
    recipe = _recipe(cfg, len(samples))
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        before = saved.get("recipe", {})
        changed = {k: (before.get(k), v) for k, v in recipe.items() if before.get(k) != v}
        if changed:  # resuming another run's optimiser state and schedule would silently train something else
            raise ValueError(f"{checkpoint} was written by a different training run ({changed}: saved, now); "
                             "use another --output, or delete the checkpoint to start over")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        state = TrainState(saved["step"], saved["losses"])
    model.train()
    device = next(model.parameters()).device
    rows = _head_rows(drafter, device)
    first = state.step
    while state.step < total and (stop_after is None or state.step - first < stop_after):
        epoch, i = divmod(state.step, per_epoch)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        batch = [samples[j] for j in order[i * cfg.batch_size : (i + 1) * cfg.batch_size]]
        loss = _loss(model, batch, cfg, device, target, rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        state.step += 1
        state.losses.append(float(loss.detach()))
        if progress:
            progress(state.step, total, state.losses[-1])
        if state.step % cfg.checkpoint_every == 0 or state.step == total:
            _save_checkpoint(checkpoint, model, opt, sched, state, recipe)
    model.eval()
    return state


def _head_rows(model: Any, device: torch.device) -> torch.Tensor | None:
    """token id -> row of a reduced output head (-100: not in it), or None for a full head."""
    token_map = getattr(model, "agentspec_token_map", None)
    if token_map is None:
        return None
    rows = torch.full((int(model.agentspec_full_vocab),), -100, dtype=torch.long, device=device)
    rows[token_map.to(device)] = torch.arange(len(token_map), device=device)
    return rows


def _trainable(drafter: Any, cfg: TrainConfig) -> Any:
    if cfg.lora_rank <= 0:
        inherited = bool(cfg.drafter) or cfg.init == "from-target" or cfg.copy_embeddings
        frozen_modules = [drafter.get_input_embeddings()]
        if not (cfg.train_head and hasattr(drafter, "agentspec_token_map")):  # a reduced head is its own matrix
            frozen_modules.append(drafter.get_output_embeddings())
        frozen = {id(p) for m in frozen_modules
                  for p in m.parameters()} if inherited and not cfg.train_embeddings else set()
        for p in drafter.parameters():
            p.requires_grad_(id(p) not in frozen)
        return drafter
    if not hasattr(drafter, "peft_config"):
        from peft import LoraConfig, get_peft_model

        # every linear layer of the decoder (attention and MLP; peft leaves the output head out): a drafter
        # mostly has to learn the target's habits of phrasing, which the MLPs carry
        lora = LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, lora_dropout=0.0,
                          target_modules="all-linear")
        peft_model = get_peft_model(drafter, lora)  # injects adapters into ``drafter`` itself
        drafter.__dict__["agentspec_peft"] = peft_model  # not a submodule: save_drafter merges through it
        drafter = peft_model
    return drafter


def _loss(model: Any, batch: list[Sample], cfg: TrainConfig, device: torch.device, target: Any,
          rows: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over response tokens (+ kl_weight · KL(target ‖ drafter) there). ``rows``: a
    reduced head's token id -> row map (:func:`_head_rows`); the loss is then over those rows."""
    seqs, starts = [], []
    for s in batch:
        response = s.response_ids[: cfg.max_len - 1]
        prompt = s.prompt_ids[-(cfg.max_len - len(response)) :]
        seqs.append(prompt + response)
        starts.append(len(prompt))
    width = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for r, (seq, start) in enumerate(zip(seqs, starts, strict=True)):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, : len(seq)] = 1
        labels[r, start : len(seq)] = torch.tensor(seq[start:])
    ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
    targets = labels[:, 1:]
    if rows is not None:
        targets = torch.where(targets >= 0, rows[targets.clamp(min=0)], targets)
    on = targets != -100  # logits only where a response token is predicted: the vocabulary is large
    logits = _logits_at(model, ids, mask, on)
    if not bool(on.any()):  # no response token the head can draft: a zero loss (an empty mean is NaN)
        return logits.sum()
    loss = F.cross_entropy(logits, targets[on])
    if cfg.kl_weight > 0:
        with torch.no_grad():
            t_logits = _logits_at(target, ids, mask, on)
            if rows is not None:
                t_logits = t_logits.index_select(1, (rows >= 0).nonzero()[:, 0])  # the head's rows, in order
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1), log_target=True,
                      reduction="batchmean")
        loss = loss + cfg.kl_weight * kl
    return loss


def _logits_at(model: Any, ids: torch.Tensor, mask: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """fp32 next-token logits at the positions ``on`` ([batch, len - 1] booleans) only."""
    core = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(core, core.base_model_prefix)
    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    return core.get_output_embeddings()(hidden[on]).float()


def _recipe(cfg: TrainConfig, num_samples: int) -> dict[str, Any]:
    """What a checkpoint's training depends on: a resume must match it."""
    keys = ("target", "drafter", "init", "init_layers", "copy_embeddings", "train_embeddings", "epochs",
            "batch_size", "lr", "warmup_steps", "weight_decay", "max_len", "kl_weight", "lora_rank", "seed", "dtype",
            "draft_vocab", "train_head")
    drafter_dtype = {"drafter_dtype": cfg.drafter_dtype} if cfg.drafter_dtype else {}  # older checkpoints lack it
    return {**{k: getattr(cfg, k) for k in keys}, **drafter_dtype, "samples": num_samples}


def _save_checkpoint(path: Path, model: Any, opt: Any, sched: Any, state: TrainState,
                     recipe: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": state.step, "losses": state.losses, "recipe": recipe}, tmp)
    tmp.replace(path)  # atomic: an interruption never leaves a half-written checkpoint


def draft_vocabulary(samples: Sequence[Sample], size: int, vocab_size: int, always: Sequence[int] = ()
                     ) -> list[int] | None:
    """The token ids a drafter's reduced output head keeps, or ``None`` when ``size`` covers the vocabulary.

    In order until ``size`` are taken: ``always`` (special tokens), every token of the target's responses
    (most frequent first), the prompts' tokens (most frequent first), then the lowest ids (BPE vocabularies
    number their most common merges first). A token left out is never drafted; losslessness does not
    depend on the choice, only acceptance does.
    """
    if size <= 0 or size >= vocab_size:
        return None
    responses = Counter(t for s in samples for t in s.response_ids)
    prompts = Counter(t for s in samples for t in s.prompt_ids)
    chosen: dict[int, None] = {}
    for t in itertools.chain(always, (t for t, _ in responses.most_common()), (t for t, _ in prompts.most_common()),
                             range(vocab_size)):
        if len(chosen) >= size:
            break
        if 0 <= t < vocab_size:
            chosen.setdefault(int(t))
    return sorted(chosen)


def save_drafter(drafter: Any, tokenizer: Any, out: Path, meta: dict[str, Any],
                 vocab: Sequence[int] | None = None, full_head: torch.Tensor | None = None) -> None:
    """A standard checkpoint directory that ``load_model`` opens; ``vocab`` goes to ``DRAFT_VOCAB_FILE``.

    A head reduced for training is saved full-size (``full_head`` with the trained rows written back), so
    the directory stays a plain checkpoint of the target's architecture; loading cuts it to ``vocab``."""
    peft_model = drafter.__dict__.pop("agentspec_peft", drafter)  # the base model train() adapted in place
    model = peft_model.merge_and_unload() if hasattr(peft_model, "merge_and_unload") else drafter
    out.mkdir(parents=True, exist_ok=True)
    token_map = getattr(model, "agentspec_token_map", None)
    if token_map is None:
        model.save_pretrained(out)
    else:
        if full_head is None:
            raise ValueError("the drafter's head is reduced: pass full_head, the head it was reduced from")
        head = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is head)
        state = dict(model.state_dict())
        weight = full_head.detach().to(head.weight.dtype).clone()
        weight[token_map.to(weight.device)] = head.weight.detach()
        state[f"{name}.weight"] = weight
        if head.bias is not None:
            bias = torch.zeros(weight.shape[0], dtype=head.bias.dtype, device=weight.device)
            bias[token_map.to(weight.device)] = head.bias.detach()
            state[f"{name}.bias"] = bias
        model.save_pretrained(out, state_dict=state)
    tokenizer.save_pretrained(out)
    vocab_file = out / models.DRAFT_VOCAB_FILE
    if vocab is not None:
        vocab_file.write_text(json.dumps(list(vocab)))
    elif vocab_file.exists():
        vocab_file.unlink()
    (out / "agentspec_drafter.json").write_text(json.dumps({**meta, "draft_vocab": len(vocab) if vocab else None},
                                                           indent=1, default=str))
