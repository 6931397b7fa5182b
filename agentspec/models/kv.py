"""KV caches and forward passes over them, in the installed transformers' terms:

1. the cache operations speculation needs (``DynamicCache.crop`` takes a negative count in 5.x);
2. :func:`forward` over one sequence, and what such passes measure (verify cost, the equivalence probes);
3. :func:`forward_batch`: several sequences packed into one pass, each against its own cache. It swaps
   ``config._attn_implementation`` for the pass and registers its attention with transformers lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from agentspec.equivalence import first_divergence, judge_divergence
from agentspec.models.attention import attention_name
from agentspec.models.loading import LoadedModel

__all__ = ["cache_length", "cache_nbytes", "check_divergence", "copy_cache_prefix", "crop_cache", "forward",
           "flat_draft_tokens", "flat_pass_len", "forward_batch", "keep_cache_positions", "logit_path_noise", "logits_at",
           "measure_verify_cost", "warm_up_verify_cost",
           "new_cache", "spare_positions", "synchronize"]


def new_cache(model: Any, spare: bool = False) -> Any:
    """An empty cache that can be cropped and re-indexed. ``spare``: its full-attention layers keep room to
    grow (:class:`SpareLayer`), for a cache a few tokens are appended to per pass (a model drafter's, a
    verifier session's): a stock layer copies all of itself on every append."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    if spare:
        spare_layer = _spare_class()
        cache.layers = [spare_layer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _spare_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class SpareLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values are views of buffers with room to spare, so appending a
        token writes it in place instead of concatenating (copying) the whole layer, which at an agent's
        context length is a sizeable share of a small drafter's step (a verifier session's pass copied the
        whole cache twice a layer too: a few ms of a 1.5B's pass). When full, the buffers are reallocated with
        :func:`spare_positions` room; a crop only shortens the views (the next tokens overwrite what it
        dropped). Anything that puts other tensors in ``keys``/``values`` (a batch re-index) is picked up
        by the next append, which copies them into fresh buffers."""

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, add = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
            bufs = getattr(self, "_bufs", None)
            if bufs is None or n + add > bufs[0].shape[-2] or not _views_of(bufs, self.keys, self.values):
                cap = spare_positions(n + add)
                bufs = tuple(x.new_empty((*x.shape[:-2], cap, x.shape[-1])) for x in (key_states, value_states))
                if n:
                    bufs[0][..., :n, :].copy_(self.keys)
                    bufs[1][..., :n, :].copy_(self.values)
                self._bufs = bufs
            bufs[0][..., n : n + add, :].copy_(key_states)
            bufs[1][..., n : n + add, :].copy_(value_states)
            self.keys, self.values = bufs[0][..., : n + add, :], bufs[1][..., : n + add, :]
            return self.keys, self.values

        def reset(self) -> None:
            self._bufs = None
            super().reset()

    return SpareLayer


def spare_positions(length: int) -> int:
    """The positions a spare cache layer allocates when it must hold ``length``: a sixteenth more (at least 16),
    so a buffer is copied once per sixteenth of growth while a KV budget pays at most that for the room."""
    return length + max(16, length // 16)


def _views_of(bufs: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``keys``/``values`` are the leading positions of ``bufs`` (not tensors put there since)."""
    return all(x.dim() == 4 and x.data_ptr() == b.data_ptr() and x.stride() == b.stride() and x.shape[:-2] == b.shape[:-2]
               for x, b in ((keys, bufs[0]), (values, bufs[1])))


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (rollback after a rejection)."""
    current = cache_length(cache)
    if length < current:
        cache.crop(length - current)  # transformers 5: a negative count of positions to drop


def _filled_layers(cache: Any) -> list[tuple[int, Any]]:
    """``(index, layer)`` of each cache layer that holds keys (layers are filled lazily)."""
    return [(i, layer) for i, layer in enumerate(getattr(cache, "layers", ()))
            if getattr(layer, "keys", None) is not None and layer.keys.numel() > 0]


@torch.inference_mode()  # the cache's tensors are inference tensors: written in place below
def keep_cache_positions(cache: Any, keep_prefix: int, extra: list[int]) -> None:
    """Keep positions ``[0, keep_prefix)`` plus the absolute positions ``extra`` (a tree's accepted path, each
    at or past ``keep_prefix``)."""
    n = len(extra)
    if extra != list(range(keep_prefix, keep_prefix + n)):
        # move the path's few positions down to follow the prefix, in place: re-indexing the whole cache
        # copied all of it every round a tree's path left the first branch (milliseconds at 1k tokens)
        layers = [layer for _, layer in _filled_layers(cache)]
        index = torch.tensor(extra, device=layers[0].keys.device) if layers else None
        for layer in layers:
            layer.keys[..., keep_prefix : keep_prefix + n, :] = layer.keys.index_select(-2, index)
            layer.values[..., keep_prefix : keep_prefix + n, :] = layer.values.index_select(-2, index)
    crop_cache(cache, keep_prefix + n)


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a cache's key and value tensors (a spare layer's whole buffers, room included)."""
    total = 0
    for _, layer in _filled_layers(cache):
        bufs = getattr(layer, "_bufs", None)
        held = bufs if bufs is not None and _views_of(bufs, layer.keys, layer.values) else (layer.keys, layer.values)
        total += sum(t.numel() * t.element_size() for t in held)
    return total


def copy_cache_prefix(model: Any, cache: Any, length: int, spare: bool = False) -> Any:
    """A new cache (``spare``: see :func:`new_cache`) holding copies of the first ``length`` positions of
    ``cache``."""
    out = new_cache(model, spare=spare)
    if length <= 0:
        return out
    for idx, layer in _filled_layers(cache):
        keys, values = layer.keys[..., :length, :], layer.values[..., :length, :]
        if not spare:  # a spare layer copies what it is given into its own buffers
            keys, values = keys.clone(), values.clone()
        out.update(keys, values, idx)
    return out


@functools.cache
def cache_kwarg(cls: type) -> str:
    """transformers renamed the forward's ``past_key_values`` to ``cache`` in 5.x (the old name warns)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


@torch.inference_mode()
def forward(model: Any, input_ids: list[int], cache: Any, num_logits: int,
            attention_mask: torch.Tensor | None = None,
            position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One forward pass appending ``input_ids`` to ``cache``; returns the last ``num_logits`` logit rows."""
    ids = torch.tensor([input_ids], device=model.device)
    out = model(input_ids=ids, **{cache_kwarg(type(model)): cache}, use_cache=True,
                attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=num_logits)
    return out.logits[0]  # [num_logits, vocab]


def synchronize(device: torch.device) -> None:
    """Wait for the kernels queued on ``device``: CUDA and MPS run asynchronously, so a clock read after a
    forward would otherwise time its launch, not its work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure_verify_cost(model: Any, prompt_ids: Sequence[int], max_tokens: int, reps: int) -> dict[int, float]:
    """Median seconds of one forward over ``k`` new tokens (k = 1 … max_tokens) on a cached prompt.

    ``k`` counts every token in the pass, as the engine sends them: a round with γ draft tokens is a pass
    over k = γ + 1 tokens (the last committed token plus the draft), all of whose logits are kept. The
    cache is cropped back to the prompt after every pass; sizes are interleaved within each repetition so
    drift hits them alike.
    """
    cache = new_cache(model)
    forward(model, list(prompt_ids), cache, num_logits=1)
    base = cache_length(cache)
    filler = (list(prompt_ids) * (max_tokens // max(len(prompt_ids), 1) + 1))[:max_tokens]
    samples: dict[int, list[float]] = {k: [] for k in range(1, max_tokens + 1)}
    for rep in range(reps + 1):  # repetition 0 is a warm-up, not recorded
        for k in samples:
            t0 = time.perf_counter()
            forward(model, filler[:k], cache, k)
            synchronize(model.device)
            seconds = time.perf_counter() - t0
            crop_cache(cache, base)
            if rep:
                samples[k].append(seconds)
    return {k: statistics.median(v) for k, v in samples.items()}


WARM_UP_CONTEXT = 512  # tokens of context a server's start-up verify-cost curve is measured over


def warm_up_verify_cost(model: Any, vocab_size: int, max_tokens: int, max_len: int) -> dict[int, float]:
    """A verifier's start-up curve (:func:`measure_verify_cost`, one repetition) over an agent's context of
    :data:`WARM_UP_CONTEXT` tokens (fewer where ``max_len`` or the model's positions run out): the cost
    an agent's rounds pay. Over 32 tokens, where the cost climbs row by row (a Zen 5 core in bf16), the
    flat part, and so the draft cap it sets (:func:`flat_draft_tokens`), moved between 4 and 8 tokens from
    one start to the next. Over 512 its ratios repeat closely, but on such a CPU they sit near
    ``flat_pass_len``'s threshold at 5-6 tokens, so the cap can still come out as none or as 5."""
    room = min(max_len, getattr(getattr(model, "config", None), "max_position_embeddings", None) or max_len)
    ids = [t % vocab_size for t in range(1, max(min(WARM_UP_CONTEXT, room - max_tokens), 8) + 1)]
    return measure_verify_cost(model, ids, max_tokens, reps=1)


def flat_pass_len(curve: Mapping[int, float], flat: float = 1.15) -> int:
    """The most tokens one pass carries for at most ``flat`` times the cost of a 1-token pass (``curve``:
    seconds by tokens per pass, :func:`measure_verify_cost`). A CPU's curve can be flat up to a kernel's
    row block and step up past it (the 1.5B in bf16 on an AMX CPU: flat to 16 rows, then a step): a draft
    one node past the block pays for a second one. Noise only slows a sample down: a slow sample inside
    the flat part ends it early only if it is the last one there; a slow base makes it look longer."""
    base = curve.get(1, 0.0)
    if base <= 0:
        raise ValueError("the verify-cost curve needs a positive entry for a 1-token pass")
    return max(k for k, s in curve.items() if s <= flat * base)


def flat_draft_tokens(curve: Mapping[int, float]) -> int | None:
    """The most draft tokens a round carries below the curve's step (:func:`flat_pass_len`, less the pending
    token), or None where the flat part is 4 tokens or less: a curve that climbs from the start (AVX2's
    emulated bf16) leaves draft sizes to the γ policies, which weigh its cost per token."""
    flat = flat_pass_len(curve)
    return flat - 1 if flat > 4 else None


def logits_at(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """The target's next-token logits after ``ids`` (one fresh forward, in the model's dtype) as float32."""
    return forward(model, list(ids), new_cache(model), num_logits=1)[-1].float()


@torch.inference_mode()
def logit_path_noise(model: Any, prompt_ids: Sequence[int], generated: Sequence[int],
                     chunk: int | Sequence[int]) -> dict:
    """How far the same position's logits move when only the computation path changes.

    The logits predicting each of ``generated`` are computed several ways: (a) one forward over the whole
    sequence, (b) prompt prefill then one token per forward (plain decoding), (c) prompt prefill then
    ``chunk`` tokens per forward (a verify pass; several sizes: one path each). All are the target's exact
    greedy computation; in bf16 they round differently. Returns the largest and the median absolute
    difference, over positions and path pairs, of the logits of path (a)'s top-2 tokens.
    """
    prompt, gen = list(prompt_ids), list(generated)
    if not gen:
        return {"max_abs": float("nan"), "median_abs": float("nan"), "positions": 0}
    full = forward(model, prompt + gen, new_cache(model), num_logits=len(gen) + 1)[:-1].float()
    prefill = new_cache(model)
    first = forward(model, prompt, prefill, num_logits=1)
    paths = [full]
    for step in (1, *([chunk] if isinstance(chunk, int) else chunk)):
        cache, rows = copy_cache_prefix(model, prefill, len(prompt)), [first]  # the same prefill for every path
        for i in range(0, len(gen) - 1, step):
            piece = gen[i:i + step][: len(gen) - 1 - i]
            rows.append(forward(model, piece, cache, num_logits=len(piece)))
        paths.append(torch.cat(rows).float())  # [len(gen), vocab]
    top2 = torch.topk(full, 2, dim=-1).indices  # [len(gen), 2]
    picked = [p.gather(-1, top2) for p in paths]
    diffs = torch.cat([(picked[i] - picked[j]).abs().flatten()
                       for i in range(len(paths)) for j in range(i + 1, len(paths))])
    return {"max_abs": float(diffs.max()), "median_abs": float(diffs.median()), "positions": len(gen),
            "chunk": chunk}


def check_divergence(target: LoadedModel, prompt_id: str, ids: list[int], plain: list[int],
                     other: list[int], tie_ulps: float, noise: float) -> dict | None:
    """``None`` if ``other == plain``; else the first differing position and the target's margin there.

    The margin comes from one fresh forward over prompt + common prefix in the run's dtype; the verdict
    (a bf16 rounding tie, or a failure) from :func:`agentspec.equivalence.judge_divergence`.
    """
    pos = first_divergence(plain, other)
    if pos is None:
        return None
    logits = logits_at(target.model, ids + plain[:pos])
    decode = target.tokenizer.decode
    return {  # the keys in the order the benchmarks' result files show them
        "prompt_id": prompt_id, "position": pos,
        "plain_token": plain[pos] if pos < len(plain) else None,
        "method_token": other[pos] if pos < len(other) else None,
        "plain_text": decode(plain[pos:pos + 1]), "method_text": decode(other[pos:pos + 1]),
        **judge_divergence(logits, plain, other, pos, target.dtype == torch.bfloat16, tie_ulps, noise),
    }


@torch.inference_mode()
def forward_batch(model: Any, caches: Sequence[Any], inputs: Sequence[list[int]],
                  masks: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One forward pass over several sequences with their own caches; returns each one's logit rows.

    Item ``i`` has ``L_i`` cached positions and ``q_i = len(inputs[i])`` new tokens, with its own additive
    mask ``[1, 1, q_i, L_i + q_i]`` and ``position_ids [1, q_i]`` (as :func:`agentspec.verify.tree_attention`
    builds them). The new tokens are packed into ONE row of ``sum(q_i)`` tokens, so every linear layer —
    where the time goes — runs once for all items. Attention runs per item against that item's own cache
    (a varlen pass, as vLLM does): no cache is padded, concatenated or copied, and each item attends to
    exactly what it would alone. Afterwards each cache holds its ``L_i + q_i`` positions.
    """
    device = model.device
    rows = _PackedRows(list(caches), [len(x) for x in inputs], list(masks))
    ids = torch.tensor([[t for x in inputs for t in x]], dtype=torch.long, device=device)
    pos = torch.cat([p.reshape(1, -1) for p in positions], dim=1).to(device)
    placeholder = torch.zeros(1, 1, 1, 1, dtype=masks[0].dtype, device=device)  # a 4D mask is used as given
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = attention_name()
    try:
        out = model(input_ids=ids, **{cache_kwarg(type(model)): _packed_cache_class()(model, rows)},
                    use_cache=True, attention_mask=placeholder, position_ids=pos, logits_to_keep=ids.shape[1],
                    agentspec_rows=rows)
    finally:
        config._attn_implementation = saved
    return list(out.logits[0].split(rows.sizes))


@dataclasses.dataclass
class _PackedRows:
    """One packed pass: the items' caches, how many new tokens each has, their masks, and per layer the
    full (cached + new) keys and values each item's attention uses."""

    caches: list[Any]
    sizes: list[int]
    masks: list[torch.Tensor]
    full: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)


@functools.cache
def _packed_cache_class() -> type:
    from transformers import DynamicCache

    class PackedCache(DynamicCache):
        """Routes a packed row's new keys/values to each item's own cache (its normal append)."""

        def __init__(self, model: Any, rows: _PackedRows) -> None:
            super().__init__(config=model.config)
            self.rows = rows

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = key_states.split(self.rows.sizes, dim=-2), value_states.split(self.rows.sizes, dim=-2)
            self.rows.full[layer_idx] = [c.update(k, v, layer_idx)
                                         for c, k, v in zip(self.rows.caches, keys, values, strict=True)]
            return key_states, value_states

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

    return PackedCache
