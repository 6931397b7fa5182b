"""Short CUDA (or MPS/CPU) check of the speculative engine: plain vs n-gram vs layer-skip drafter.

No weights can be fetched on a lent GPU machine, so the target is a Qwen2-0.5B-shaped model with
random weights (fixed seed) whose greedy output is repetitive — enough to exercise drafting, the tree
and cache paths, bf16 on the device and the plain-vs-speculative identity. It prints one JSON summary.
Speed-ups on real weights are in benchmarks/speedup.py.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.local import SpecEngine
from agentspec.models import LoadedModel, layer_skip_drafter, resolve_device, resolve_dtype
from agentspec.types import SamplingParams


def build_target(device: torch.device, dtype: torch.dtype, small: bool) -> LoadedModel:
    from transformers import AutoModelForCausalLM, Qwen2Config

    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1000) if small else dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936)
    torch.manual_seed(0)
    config = Qwen2Config(**dims, max_position_embeddings=4096, tie_word_embeddings=True, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return LoadedModel(model, None, "qwen2-0.5b-shape-random", device, dtype)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="tiny dims, for a CPU smoke run")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target = build_target(device, dtype, args.small)
    vocab = target.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = []
    for _ in range(args.prompts):
        base = torch.randint(0, vocab, (64,), generator=g).tolist()
        prompts.append(base * 3)  # repetition: something for prompt lookup to copy
    methods = {
        "plain": SpecEngine(target, None, stop_token_ids=()),
        "ngram": SpecEngine(target, NgramDrafter(max_ngram=3), num_draft_tokens=8, stop_token_ids=()),
        "layer_skip": SpecEngine(target, ModelDrafter(layer_skip_drafter(target, 2)), num_draft_tokens=4,
                                 stop_token_ids=()),
        "layer_skip_tree": SpecEngine(target, ModelDrafter(layer_skip_drafter(target, 2), tree_width=2),
                                      num_draft_tokens=4, stop_token_ids=()),
    }
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for engine in methods.values():  # warm-up
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))
    totals = {name: [0.0, 0, 0] for name in methods}  # seconds, tokens, rounds
    identical = True
    for prompt in prompts:
        reference = None
        for name, engine in methods.items():
            sync(device)
            t0 = time.perf_counter()
            result = engine.generate(prompt, params)
            sync(device)
            totals[name][0] += time.perf_counter() - t0
            totals[name][1] += len(result.tokens)
            totals[name][2] += result.stats.num_rounds
            reference = reference or result.tokens
            identical &= result.tokens == reference
    plain_rate = totals["plain"][1] / totals["plain"][0]
    summary = {
        "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "identical_to_plain": identical,
        "methods": {name: {"tokens_per_s": round(tok / s, 1), "speedup_vs_plain": round(tok / s / plain_rate, 2),
                           "tokens_per_target_pass": round(tok / rounds, 2)}
                    for name, (s, tok, rounds) in totals.items()},
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
