"""CPU linear layers on oneDNN with weights packed once at load time (:class:`PackedLinear`), the
memory they take (:func:`resident_weight_bytes`: ``state_dict`` sizes miss packed weights), and giving the
memory that load freed back to the OS (:func:`release_freed_memory`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections import Counter
from typing import Any

import torch

__all__ = ["PackedLinear", "is_packed", "pack_cpu_linears", "release_freed_memory", "resident_weight_bytes"]

log = logging.getLogger(__name__)

try:
    _LIBC: Any = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
except OSError:  # not glibc (or no libc to load): there is nothing to trim
    _LIBC = None


class PackedLinear(torch.nn.Module):
    """An inference-only ``nn.Linear`` on oneDNN with its weight pre-packed once, at load time.

    Stock ``F.linear`` on CPU (MKL) re-packs the weight on every call with more than one input row, so
    on a 2-core AVX2 machine a 2-token forward of Qwen2.5-0.5B costs ~2x a 1-token one; with the weight
    packed once it costs ~1.05-1.2x (``benchmarks/results/cpu_linear.md``): exactly the multi-token verify
    pass speculation lives on. From two rows up (2-17 measured) a row's result does not depend on how many
    rows share the call; a one-row call may round differently (oneDNN's one-row kernel: on a Zen 4 core
    every fp32 linear of the 1.5B and its bf16 LM head and gate, ``benchmarks/results/row_bits.json``).

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
        dense.load_state_dict(self.state_dict())  # copies the weight (unpacked) and the bias
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


def release_freed_memory() -> None:
    """Collect garbage, then hand the heap pages glibc keeps after ``free`` back to the OS (``malloc_trim``).

    Why loading needs it: once a large block has been freed, glibc raises its mmap threshold (up to
    32 MiB), so weight-sized tensors allocated later come from the heap, and freed heap pages stay
    resident until trimmed. Without a trim, the dense weights replaced by packed ones (and a GGUF's
    dequantisation buffers) stay in RSS next to the weights in use: a second copy in all but name.
    A no-op where the C library has no ``malloc_trim``.
    """
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def pack_cpu_linears(model: torch.nn.Module, *, pack_tied: bool = False) -> int:
    """Replace every ``nn.Linear`` of a CPU model by a :class:`PackedLinear`; returns how many were packed.

    Inference only (the packed weights take no gradients). Linears not on the CPU are left alone, and so is
    a linear whose weight is tied to another parameter (an LM head sharing the input embeddings) unless
    ``pack_tied``: the packed layout cannot be shared, so packing it would keep a second full copy of
    that matrix resident. Each dense weight is dropped as soon as its packed copy exists, and freed memory
    is returned to the OS as packing goes, so the load peak stays near one copy of the weights.
    """
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return 0
    # where each parameter's data starts (not its storage: a checkpoint mapped from disk may back many);
    # a comprehension, so that no loop variable keeps the last weight alive through the packing
    pointers = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    # (parent, name) pairs, not the linears themselves: a list holding the old modules would keep every
    # dense weight alive until the end, next to its packed copy
    sites = [(module, name) for module in model.modules() for name, child in module.named_children()
             if type(child) is torch.nn.Linear and child.weight.device.type == "cpu"]
    count = freed = 0
    for module, name in sites:
        child = getattr(module, name)
        if not pack_tied and pointers[child.weight.data_ptr()] > 1:
            log.info("not packing %s: its weight is tied to another parameter", name)
            continue
        try:
            packed = PackedLinear(child)
        except RuntimeError as e:  # no oneDNN kernel for this dtype: keep stock linears
            log.info("not packing linears (%s): %s", child.weight.dtype, str(e).splitlines()[0])
            break
        freed += child.weight.numel() * child.weight.element_size()
        setattr(module, name, packed)
        del child
        count += 1
        if freed >= 1 << 28:  # trim every 256 MiB: bounds the peak without a trim per layer
            release_freed_memory()
            freed = 0
    release_freed_memory()
    return count


def is_packed(model: torch.nn.Module) -> bool:
    """Whether :func:`pack_cpu_linears` packed any of ``model``'s linears."""
    return any(isinstance(m, PackedLinear) for m in model.modules())
