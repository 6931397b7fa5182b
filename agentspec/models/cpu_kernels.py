"""CPU linear layers on oneDNN with weights packed once at load time (:class:`PackedLinear`), and the
memory they take (:func:`resident_weight_bytes`: ``state_dict`` sizes miss packed weights)."""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["PackedLinear", "is_packed", "pack_cpu_linears", "resident_weight_bytes"]

log = logging.getLogger(__name__)


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
