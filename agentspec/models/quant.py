"""Weight-only int8/int4 linears for a CPU *drafter* (:func:`quantize_linears`).

Why a drafter and never a target: a drafter's precision changes only which tokens it proposes, and the
target verifies every one of them, so output stays the target's own token for token. What it buys is
bytes: a drafting step at batch 1 reads every weight once and is bound by memory bandwidth, so a 0.5B
drafter in bf16 costs ~45 % of a 1.5B target's pass; with 4-bit weights (the precision its GGUF shipped
in) it reads a quarter of the bytes. The kernels are torch's own weight-only ones
(``aten._weight_int8pack_mm``, ``aten._weight_int4pack_mm_for_cpu``): activations stay in the model's dtype.

Those kernels pay per input row (they dequantise as they go), so a prefill through them is slow: a drafter's
catch-up over a tool's result costs several times its dense prefill. Each :class:`QuantLinear` therefore
keeps its dense linear too (packed for oneDNN where it can be) and runs inputs of :data:`DENSE_ROWS` rows
or more through it: steps read the quantised bytes, prefills run at dense speed. ``dense_rows=None``
drops the dense copies (the smallest footprint, slow prefills).
"""

from __future__ import annotations

import logging

import torch

from agentspec.models.cpu_kernels import PackedLinear, release_freed_memory

__all__ = ["DENSE_ROWS", "QUANT_SCHEMES", "QuantLinear", "quantize_linears", "is_quantized"]

log = logging.getLogger(__name__)

QUANT_SCHEMES = ("int8", "int4")
# inputs with this many rows or more run a QuantLinear's dense copy: a weight-only kernel's time grows
# with the rows (a 0.5B's int4 pass over 5 tokens costs about its packed bf16 one), a packed dense pass's barely
DENSE_ROWS = 6


class QuantLinear(torch.nn.Module):
    """An inference-only linear with int8 (per output channel) or int4 (per group of ``group_size`` inputs,
    asymmetric) weights, on torch's CPU weight-only kernels. Built from a dense weight by round to nearest.

    ``dense``: the linear it was built from, kept to run inputs of ``dense_rows`` rows or more (prefills);
    None keeps none and runs every input on the quantised weights."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str, group_size: int = 32,
                 dense: torch.nn.Module | None = None, dense_rows: int = DENSE_ROWS) -> None:
        super().__init__()
        if dense is not None and dense_rows < 2:
            raise ValueError(f"dense_rows must be >= 2 (one-row steps are what the quantised weights are for), "
                             f"got {dense_rows}")
        self.dense, self.dense_rows = dense, dense_rows
        if scheme not in QUANT_SCHEMES:
            raise ValueError(f"unknown quantisation {scheme!r}: use one of {', '.join(QUANT_SCHEMES)}")
        self.out_features, self.in_features = weight.shape
        self.scheme, self.dtype = scheme, weight.dtype
        self.group_size = group_size if scheme == "int4" else self.in_features
        if scheme == "int4" and (group_size < 2 or self.in_features % group_size):
            raise ValueError(f"int4 needs the input width ({self.in_features}) to be a multiple of the group size "
                             f"({group_size})")
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        w = weight.detach().float()
        if scheme == "int8":
            scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
            self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
            self.register_buffer("scales", scale.to(self.dtype))
        else:  # the packing wants whole tiles of 16 output rows: pad with zero rows, sliced off in forward
            w = torch.nn.functional.pad(w, (0, 0, 0, -self.out_features % 16))
            groups = w.reshape(w.shape[0], -1, group_size)
            low, high = groups.amin(dim=2), groups.amax(dim=2)
            scale = ((high - low) / 15).clamp(min=1e-8)
            q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            # the kernel's law: w = (q - 8) * scale + zero, so zero = low + 8 * scale
            params = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.reshape(w.shape[0], self.in_features), 1))
            self.register_buffer("scales", params.to(self.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None and x.numel() >= self.dense_rows * self.in_features:
            return self.dense(x.to(self.dtype)).to(x.dtype)
        # a drafter's step runs ~170 of these: no conversion or slice where there is nothing to do
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if self.scheme == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales)
            if out.shape[1] != self.out_features:
                out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + (self.bias if self.bias.dtype == out.dtype else self.bias.to(out.dtype))
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _apply(self, fn, recurse: bool = True) -> QuantLinear:  # noqa: ANN001 (torch's signature)
        """Moving a quantised linear off the CPU or to another dtype is refused: its kernels are CPU ones."""
        probe = fn(torch.empty(0, dtype=self.dtype))
        if probe.device.type != "cpu" or probe.dtype != self.dtype:
            raise RuntimeError(f"a {self.scheme} QuantLinear lives on the CPU in {self.dtype}; load the model "
                               f"with quantize=None to move it to {probe.device} / {probe.dtype}")
        return self

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.scheme == "int4" else ""
        dense = f", dense from {self.dense_rows} rows" if self.dense is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}{dense}"


def _dense(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """A linear's (weight, bias), whether stock or packed; None for anything else."""
    if type(module) is torch.nn.Linear or isinstance(module, PackedLinear):
        return module.weight, module.bias
    return None


def quantize_linears(model: torch.nn.Module, scheme: str, group_size: int = 32,
                     dense_rows: int | None = DENSE_ROWS) -> int:
    """Replace every linear of a CPU ``model`` (its output head included, tied or not) by a
    :class:`QuantLinear` in ``scheme`` (``int8`` or ``int4``); returns how many were replaced.

    ``dense_rows``: each keeps its dense linear for inputs of that many rows or more (packed for oneDNN
    when it can be; a head tied to the embeddings keeps sharing them, at no extra bytes), so prefills run
    at dense speed; None drops the dense weights (the smallest footprint).

    For drafters only (see the module docstring): a target's output must not depend on a rounding. A head
    tied to the input embeddings gets a quantised copy of its own (a quarter or half of the embedding's
    bytes); the embeddings stay as they are. A linear whose input width the int4 group size does not divide
    stays dense (logged). Raises ``ValueError`` for an unknown scheme and ``RuntimeError`` off the CPU.
    """
    if scheme not in QUANT_SCHEMES:
        raise ValueError(f"unknown quantisation {scheme!r}: use one of {', '.join(QUANT_SCHEMES)}")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise RuntimeError(f"{scheme} weight-only linears run on the CPU only; load the drafter with "
                           f"quantize=None on other devices")
    if dense_rows is not None and dense_rows < 2:
        raise ValueError(f"dense_rows must be None or >= 2, got {dense_rows}")
    tied = {id(p) for p in model.get_input_embeddings().parameters()} if hasattr(model, "get_input_embeddings") \
        else set()
    sites = [(module, name) for module in model.modules() if not isinstance(module, QuantLinear)
             for name, child in module.named_children() if _dense(child) is not None]
    count = 0
    for module, name in sites:
        child = getattr(module, name)
        weight, bias = _dense(child)
        if scheme == "int4" and weight.shape[1] % group_size:
            log.info("keeping %s dense: its input width %d is not a multiple of %d", name, weight.shape[1],
                     group_size)
            continue
        dense = None
        if dense_rows is not None:
            dense = child if isinstance(child, PackedLinear) or id(child.weight) in tied else _packed(child)
        setattr(module, name, QuantLinear(weight, bias, scheme, group_size, dense, dense_rows or DENSE_ROWS))
        count += 1
    config = getattr(model, "config", None)
    if getattr(config, "tie_word_embeddings", False) and count:
        config.tie_word_embeddings = False  # the head is its own (quantised) matrix now
    release_freed_memory()
    return count


def _packed(linear: torch.nn.Module) -> torch.nn.Module:
    """``linear`` packed for oneDNN, or as it is where this CPU has no kernel for its dtype."""
    try:
        return PackedLinear(linear)
    except RuntimeError:
        return linear


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether :func:`quantize_linears` replaced any of ``model``'s linears."""
    return any(isinstance(m, QuantLinear) for m in model.modules())
