"""A drafter's reduced output vocabulary: the head's rows it keeps (:func:`restrict_output_vocab`), chosen
from data by ``agentspec train`` or without it (:func:`lowest_ids_vocab`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["lowest_ids_vocab", "restrict_output_vocab", "vocab_size"]


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output head, read without running a torch op (see :func:`~agentspec.models.loading.model_thread`)."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)
    return int(rows) if rows is not None else int(head.weight.shape[0])


def lowest_ids_vocab(tokenizer: Any, size: int, full: int) -> list[int]:
    """A drafter's reduced vocabulary made without data: the tokenizer's added tokens (the chat template's
    and end-of-turn markers, which a drafter must be able to propose), then the lowest ids up to ``size``
    ids in all (``full``: the head's rows)."""
    kept = {i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < full}
    if size < len(kept):
        raise ValueError(f"draft_vocab={size} cannot hold the tokenizer's {len(kept)} added tokens")
    low = 0
    while len(kept) < min(size, full):
        kept.add(low)
        low += 1
    return sorted(kept)


def restrict_output_vocab(model: torch.nn.Module, token_ids: Sequence[int]) -> None:
    """Keep only the rows ``token_ids`` of ``model``'s output head: a drafter's reduced vocabulary.

    A drafter spends most of a step in its output head when the vocabulary is large (151,936 rows for
    Qwen2.5); drafting from the few thousand tokens tool calls actually use cuts that cost by the same
    factor. It stays lossless: the target verifies every draft, and the drafter simply never proposes a
    token outside its set. ``model.agentspec_token_map`` maps head rows back to token ids
    (:class:`~agentspec.drafters.model.ModelDrafter` uses it); the input embeddings are untouched.
    """
    head = model.get_output_embeddings()
    full = int(head.weight.shape[0])
    ids = sorted({int(t) for t in token_ids})
    if not ids or ids[0] < 0 or ids[-1] >= full:
        raise ValueError(f"a reduced vocabulary needs token ids in [0, {full}), got {len(ids)} ids "
                         f"spanning [{ids[0] if ids else None}, {ids[-1] if ids else None}]")
    index = torch.tensor(ids, dtype=torch.long, device=head.weight.device)
    small = torch.nn.Linear(head.weight.shape[1], len(ids), bias=head.bias is not None, device=index.device,
                            dtype=head.weight.dtype)
    small.load_state_dict({name: t.index_select(0, index) for name, t in head.state_dict().items()})  # copies
    model.set_output_embeddings(small)
    model.config.tie_word_embeddings = False  # the head is its own (smaller) matrix now
    model.agentspec_token_map = index
    model.agentspec_full_vocab = full
