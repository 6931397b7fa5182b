"""agentspec's attention function for transformers models: SDPA with grouped-query attention read in place.

transformers' SDPA path repeats every cached key and value per query head (``repeat_kv``) whenever a pass
has a mask, i.e. every verify pass of more than one token (a chain over a cache, a tree): on a CPU that copy,
and the attention over six times the keys it makes, cost a 1.5B target's verify pass ~5 % over the same
pass reading each key/value head in place. Here each key/value head's query heads run as rows of one head
(:func:`_grouped_rows`). One-token steps (no mask: a plain decode step, a model drafter's step) run so too:
transformers sends them to SDPA's ``enable_gqa``, whose CPU kernel attends one query row per head, an order
of magnitude slower in bf16 over an agent's context (a third of a 1.5B's whole decode step at 1,500 tokens).
Rows give a step the same bits as the last row of a longer pass, and fp32 within rounding of the stock path.
Off the CPU the stock path runs. A packed pass of several sequences (:func:`agentspec.models.kv.forward_batch`)
attends per item here too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

NAME = "agentspec_sdpa"


def attention_name() -> str:
    """The registered name of :func:`_attention` (registered on the first call; importing agentspec changes no
    other library)."""
    return _register()


def use_agentspec_attention(model: Any) -> None:
    """Run ``model``'s attention through :func:`_attention` (CPU inference models: see the module's doc)."""
    model.config._attn_implementation = attention_name()


@functools.cache
def _register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # SDPA's masks (a custom name would get none)
    return NAME


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               agentspec_rows: Any = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gqa = getattr(module, "num_key_value_groups", 1) > 1
    rows = (gqa and query.device.type == "cpu" and key.shape[-1] == value.shape[-1]
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if agentspec_rows is not None:  # a packed pass: each item against its own cache, with its own mask
        outs, start = [], 0
        for (k, v), size, mask in zip(agentspec_rows.full[module.layer_idx], agentspec_rows.sizes,
                                      agentspec_rows.masks, strict=True):
            item = query[:, :, start : start + size]
            outs.append(_grouped_rows(item, k, v, mask, 0.0, scaling) if rows else
                        torch.nn.functional.scaled_dot_product_attention(
                            item, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa).transpose(1, 2))
            start += size
        return torch.cat(outs, dim=1).contiguous(), None
    if rows and (attention_mask is not None or query.shape[2] == 1):
        return _grouped_rows(query, key, value, attention_mask, dropout, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _grouped_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  dropout: float, scaling: float | None) -> torch.Tensor:
    """A pass under grouped-query attention (several queries under a mask, or a one-token step with ``mask``
    None), with each key/value head's query heads stacked as rows of one head (``[b, kv, group * q, d]``, the
    mask repeated per query head): the CPU kernel then reads each key/value block once for the whole group,
    where ``enable_gqa`` reads it once per query head. A verify pass's attention over an agent's 1,800-token
    context took about 40 % less (a 1.5B's 12-token tree); fp32 output is the same bits as repeated heads, bf16
    the same up to the last bit in a few elements. A mask with a head dimension of its own runs ``enable_gqa``."""
    b, heads, q, d = query.shape
    kv = key.shape[1]
    if mask is not None and (mask.dim() != 4 or mask.shape[1] != 1):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous()
    group = heads // kv
    rows = query.reshape(b, kv, group * q, d)
    mask = None if mask is None else mask.repeat(1, 1, group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(b, heads, q, d).transpose(1, 2).contiguous()
