"""Where a verify pass's rows part from one-token decoding, bit for bit, on this CPU, and what closing it costs.

Greedy speculative output equals plain greedy output exactly when each row of a verify pass computes the
same bits as the one-token step that would have produced it. bf16 runs of ``benchmarks.agent`` part at top-2
ties instead (the methods' transcripts then differ in length, which is most of the scatter in its auto /
best figures). ``python -m benchmarks.row_bits`` measures, with the 1.5B target (bf16, one thread):

1. **linears**: each distinct linear of the target (layer 0's and the LM head, real weights, inputs taken
   from a real forward) on ``m`` rows: are row ``i``'s bits those of the same row in a 17-row call, for
   ``m`` = 1 … 16, in bf16 and in fp32 (the bf16 weights upcast);
2. **attention**: agentspec's CPU attention on a pass of ``q`` rows under a causal mask against the one-token
   step of each row (``q`` = 2, 4, 8, 13; key lengths 40 … 2,100), as it runs, and with every call's key
   extent padded to a multiple of ``PAD`` under the mask (the CPU flash kernel's key block: each row then
   meets the same blocks, masked keys adding exact zeros);
3. **logits**: a 48-token greedy continuation decoded one token a step and re-run in chunks of 2, 4, 8, 13:
   the positions whose logits differ at all, with stock linears and with one-row calls padded to two rows;
4. **cost**: a one-token step of the target at 600 and 1,500 tokens of context, stock and with one-row
   linear calls padded to two rows (median of 8).

Writes ``benchmarks/results/row_bits.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.common import log

TARGET = "qwen2.5-coder-1.5b-instruct"
PAD = 512
ROWS = 17


def _two_row(orig: Any) -> Any:
    """``PackedLinear.forward`` with a one-row call run as a two-row one (the row repeated)."""
    def forward(self: Any, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] != 1:
            return orig(self, x)
        return orig(self, flat.expand(2, -1))[:1].reshape(*x.shape[:-1], self.out_features)
    return forward


def linear_rows(model: Any, prompt: list[int]) -> dict[str, Any]:
    """Per distinct linear: the row counts whose rows differ from a 17-row call's, bf16 and fp32."""
    from agentspec.models.cpu_kernels import PackedLinear
    from agentspec.models.kv import forward, new_cache

    names = [n for n, m in model.named_modules() if isinstance(m, PackedLinear)
             and (n.startswith("model.layers.0.") or n == "lm_head")]
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Any:
        def hook(module: Any, args: tuple[torch.Tensor, ...]) -> None:  # returns None: the call runs as it was
            inputs.setdefault(name, args[0].reshape(-1, args[0].shape[-1])[-ROWS:].clone())
        return hook

    hooks = [model.get_submodule(n).register_forward_pre_hook(keep(n)) for n in names]
    forward(model, prompt, new_cache(model), num_logits=ROWS)
    for h in hooks:
        h.remove()
    out: dict[str, Any] = {}
    for n in names:
        module = model.get_submodule(n)
        x = inputs[n]
        upcast = PackedLinear(torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                              dtype=torch.float32))
        upcast.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
        for dtype, lin in (("bf16", module), ("fp32", upcast)):
            xs = x.to(lin.dtype)
            ref = lin(xs)
            out.setdefault(n, {})[dtype] = [m for m in range(1, ROWS) if not torch.equal(lin(xs[:m]), ref[:m])]
        log(f"linear {n} ({module.out_features}x{module.in_features}): row counts differing {out[n]}")
    return out


def attention_rows(dtype: torch.dtype, pad: int | None) -> dict[str, int]:
    """Rows of causal passes whose attention differs from their one-token step (synthetic 1.5B-shaped heads)."""
    from agentspec.models.attention import _grouped_rows

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 12, 2, 128

    def extent(n: int) -> int:
        return n if pad is None else -(-n // pad) * pad

    def mask(allowed: list[int], width: int) -> torch.Tensor:
        m = torch.full((len(allowed), width), torch.finfo(dtype).min, dtype=dtype)
        for i, a in enumerate(allowed):
            m[i, :a] = 0
        return m[None, None]

    differing = total = 0
    for length in (40, 100, 128, 129, 200, 256, 257, 300, 511, 512, 513, 600, 1000, 1024, 1025, 1500, 2100):
        for q in (2, 4, 8, 13):
            width = extent(length)
            key, value = (torch.randn(1, kv_heads, width, dim, generator=gen, dtype=dtype) for _ in range(2))
            query = torch.randn(1, heads, q, dim, generator=gen, dtype=dtype)
            seen = [length - q + i + 1 for i in range(q)]
            full = _grouped_rows(query, key, value, mask(seen, width), 0.0, None)
            for i, n in enumerate(seen):
                w = extent(n)  # a step's own extent: its keys, then whatever the buffer holds (masked)
                step_mask = None if pad is None else mask([n], w)
                step = _grouped_rows(query[:, :, i : i + 1], key[:, :, :w], value[:, :, :w], step_mask, 0.0, None)
                differing += not torch.equal(step[0, 0], full[0, i])
                total += 1
    return {"rows": total, "differing": differing}


def logit_positions(model: Any, prompt: list[int]) -> dict[str, list[int]]:
    """Per chunk size: the positions of a 48-token greedy continuation whose logits differ from one-token steps."""
    from agentspec.models.kv import copy_cache_prefix, forward, new_cache

    cache = new_cache(model, spare=True)
    first = forward(model, prompt, cache, 1)
    prefill = copy_cache_prefix(model, cache, len(prompt), spare=True)
    gen, rows = [int(first[-1].argmax())], [first]
    for _ in range(47):
        rows.append(forward(model, gen[-1:], cache, 1))
        gen.append(int(rows[-1][-1].argmax()))
    steps = torch.cat(rows).float()  # the predictions of gen[0] … gen[47]
    out = {}
    for chunk in (2, 4, 8, 13):
        c, got = copy_cache_prefix(model, prefill, len(prompt), spare=True), [first]
        for i in range(0, len(gen) - 1, chunk):
            piece = gen[i : i + chunk][: len(gen) - 1 - i]
            got.append(forward(model, piece, c, len(piece)))
        diff = (torch.cat(got).float() != steps).any(-1)
        out[str(chunk)] = [int(i) for i in diff.nonzero().flatten()]
    return out


def step_ms(model: Any, context: int, reps: int = 8) -> float:
    """Median milliseconds of a one-token step after ``context`` tokens."""
    from agentspec.models.kv import forward, new_cache

    cache = new_cache(model, spare=True)
    forward(model, [(i * 7919) % 150000 for i in range(context)], cache, 1)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        forward(model, [1000 + i], cache, 1)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/row_bits")
    args = ap.parse_args(argv)
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    from agentspec import models
    from agentspec.models.cpu_kernels import PackedLinear

    target = models.load_model(TARGET, device="cpu", dtype="bfloat16")
    model = target.model
    text = "def mean(xs):\n    return sum(xs) / (len(xs) - 1)\n\nThe mean function returns the wrong value. Fix it. "
    prompt = target.tokenizer(text * 4)["input_ids"]
    with torch.inference_mode():
        linears = linear_rows(model, prompt)
        attention = {f"{d}_{'padded' if p else 'as_run'}": attention_rows(getattr(torch, t), p)
                     for d, t in (("bf16", "bfloat16"), ("fp32", "float32")) for p in (None, PAD)}
        log(f"attention rows differing from their step: {attention}")
        stock = {"logits": logit_positions(model, prompt), "step_ms": {c: step_ms(model, c) for c in (600, 1500)}}
        orig = PackedLinear.forward
        PackedLinear.forward = _two_row(orig)
        try:
            padded = {"logits": logit_positions(model, prompt), "step_ms": {c: step_ms(model, c) for c in (600, 1500)}}
        finally:
            PackedLinear.forward = orig
    for name, r in (("stock linears", stock), ("one-row calls as two rows", padded)):
        log(f"{name}: positions differing by chunk {r['logits']}; step ms {r['step_ms']}")
    one_row = sorted({n for n, r in linears.items() if 1 in r["bf16"]})
    acceptance = {
        "bf16_linears_whose_one_row_call_differs": one_row,
        "bf16_linears_differing_at_2_to_16_rows": sorted({n for n, r in linears.items() if set(r["bf16"]) - {1}}),
        "fp32_linears_whose_one_row_call_differs": sorted({n for n, r in linears.items() if 1 in r["fp32"]}),
        "attention_rows_differing": {k: f"{v['differing']}/{v['rows']}" for k, v in attention.items()},
        "logit_positions_differing_of_48": {"stock": {k: len(v) for k, v in stock["logits"].items()},
                                            "one_row_as_two": {k: len(v) for k, v in padded["logits"].items()}},
        "step_ms_stock": {c: round(v, 1) for c, v in stock["step_ms"].items()},
        "step_ms_one_row_as_two": {c: round(v, 1) for c, v in padded["step_ms"].items()},
    }
    result = {"acceptance": acceptance, "linears": linears, "attention": attention,
              "logits": {"stock": stock["logits"], "one_row_as_two": padded["logits"]},
              "setup": {"target": TARGET, "dtype": "bfloat16 (fp32: the linears' weights upcast)",
                        "prompt_tokens": len(prompt), "attention_pad": PAD, "threads": 1, "core": 0,
                        "machine": common.machine_info()}}
    Path(args.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(acceptance, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
