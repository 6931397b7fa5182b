"""Helpers the benchmarks share: BFCL prompts, HF ``generate`` glue, timing primitives, the closed form.

Flow of a benchmark built on these:

1. :func:`bfcl_prompts` picks a fixed, deterministic set of BFCL v4 tool-calling questions (from the
   data files shipped inside the ``bfcl_eval`` wheel) and :func:`render` turns one into token ids with the
   target's chat template (tools passed as ``tools=``, or as JSON in a system message when the template
   ignores them);
2. :func:`pretouch` and a warm-up generation fault in fresh memory before anything is timed;
3. :func:`prefill_seconds`, :func:`verify_cost_curve` and :class:`ForwardCounter` measure what the
   closed-form model needs; :func:`top2_margin` and :func:`bf16_ulp` judge bf16 divergences;
4. :func:`agentspec.router.predicted_speedup` evaluates design.md's arithmetic on the measured α and costs.

Nothing here downloads anything: models come from :func:`agentspec.models.load_model`'s offline aliases.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentspec import models
from agentspec.equivalence import bf16_ulp, top2_margin  # noqa: F401 (re-exported: they judge divergences)
from agentspec.models import check_divergence, logit_path_noise, logits_at  # noqa: F401 (re-exported)
from agentspec.toolcalls import render_chat
from agentspec.training.data import bfcl_data_dir, load_bfcl, normalise_schema, to_openai_tools  # noqa: F401 (re-exported)
from agentspec.types import SpecStats

TARGETS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "live_simple")
WARMUP_PROMPT = ("simple_python", 1)  # never picked by bfcl_prompts while a category gives <= half its file

def log(*parts: Any) -> None:
    """Progress line on stdout, flushed so a long run can be followed (``tee``, ``tail -f``)."""
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


# ---- BFCL prompts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One BFCL question: chat messages plus tools in OpenAI format."""

    id: str
    category: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]


def prompt_from_record(record: dict, category: str) -> Prompt:
    """A single-turn BFCL record as a :class:`Prompt` (the turns' messages are concatenated)."""
    messages = tuple(dict(m) for turn in record["question"] for m in turn)
    return Prompt(record["id"], category, messages, to_openai_tools(record["function"]))


def spread_indices(total: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(total)``, starting at 0 (deterministic)."""
    count = min(count, total)
    return [(i * total) // count for i in range(count)]


def bfcl_prompts(n: int, categories: Sequence[str] = BFCL_CATEGORIES) -> list[Prompt]:
    """``n`` prompts split as evenly as possible over ``categories``, spread evenly within each file.

    Categories earlier in the list get the remainder. The order is category-major.
    """
    prompts: list[Prompt] = []
    for c, category in enumerate(categories):
        share = n // len(categories) + (1 if c < n % len(categories) else 0)
        records = load_bfcl(category)
        prompts.extend(prompt_from_record(records[i], category) for i in spread_indices(len(records), share))
    return prompts


def warmup_prompt(exclude: Iterable[Prompt] = ()) -> Prompt:
    """A short prompt outside the measured set (``exclude``), for untimed warm-up generations."""
    category, index = WARMUP_PROMPT
    prompt = prompt_from_record(load_bfcl(category)[index], category)
    if any(p.id == prompt.id for p in exclude):
        raise ValueError(f"warm-up prompt {prompt.id} is in the measured set; ask for fewer prompts")
    return prompt


def render(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of the prompt with the generation prompt appended, special tokens added exactly once.

    The template already writes every special token, so the text is encoded with
    ``add_special_tokens=False`` (a second BOS would otherwise be prepended by some tokenizers).
    """
    ids = render_chat(tokenizer, [dict(m) for m in prompt.messages], list(prompt.tools))
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
        raise AssertionError(f"prompt {prompt.id} starts with two BOS tokens")
    return ids


# ---- HF generate glue ------------------------------------------------------------------------------


def hf_generation_config(target: models.LoadedModel, max_new_tokens: int, **extra: Any) -> Any:
    """Greedy config stopping on exactly the engine's stop ids (``LoadedModel.eos_token_ids``)."""
    from transformers import GenerationConfig

    eos = list(target.eos_token_ids)
    pad = target.tokenizer.pad_token_id
    return GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=eos[0] if pad is None else pad, **extra)


class FirstTokenTimer:
    """A transformers streamer that notes when the first generated tokens arrive, and how many.

    ``generate`` puts the prompt first, then the tokens of each step (several per step under prompt
    lookup), so the second ``put`` marks the end of the call's own prefill step.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.calls = 0
        self.first_s: float | None = None
        self.first_tokens = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_s = time.perf_counter() - self.start
            self.first_tokens = int(value.numel())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_generate(target: models.LoadedModel, prompt_ids: Sequence[int], config: Any,
                streamer: FirstTokenTimer | None = None, cache: Any = None) -> list[int]:
    """``model.generate`` on one prompt; returns the new token ids only. ``cache``: a cache already
    holding the prompt but its last token (generate then runs only the rest)."""
    ids = torch.tensor([list(prompt_ids)], device=target.device)
    extra = {} if cache is None else {"past_key_values": cache}
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                streamer=streamer, **extra)
    return out[0, ids.shape[1]:].tolist()


# ---- timing primitives -----------------------------------------------------------------------------


class ForwardCounter:
    """Counts forward calls of a module (a pre-hook), e.g. target passes per generation."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.count += 1

    def take(self) -> int:
        """The count since the last ``take``; resets it."""
        n, self.count = self.count, 0
        return n

    def close(self) -> None:
        self._handle.remove()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), wall seconds)``."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def prefill_seconds(model: Any, prompt_ids: Sequence[int]) -> float:
    """Wall time of one forward over the prompt alone, into a fresh cache (last logit row only)."""
    cache = models.new_cache(model)
    return timed(lambda: models.forward(model, list(prompt_ids), cache, num_logits=1))[1]


@torch.inference_mode()
def prefill_cache(model: Any, prompt_ids: Sequence[int]) -> tuple[Any, float]:
    """A cache holding all prompt tokens but the last (which each method's first step feeds), and the
    wall time it took; methods take copies (:func:`agentspec.models.copy_cache_prefix`)."""
    cache = models.new_cache(model)
    seconds = timed(lambda: models.forward(model, list(prompt_ids[:-1]), cache, num_logits=1))[1]
    return cache, seconds


def verify_cost_curve(model: Any, prompt_ids: Sequence[int], max_tokens: int, reps: int) -> dict[int, float]:
    """See :func:`agentspec.models.measure_verify_cost`."""
    return models.measure_verify_cost(model, prompt_ids, max_tokens, reps)


@torch.inference_mode()
def pretouch(model: Any, length: int) -> None:
    """Fault in weights and activation buffers: read every parameter, then one forward of ``length``."""
    for p in model.parameters():
        float(p.detach().float().abs().sum())
    cache = models.new_cache(model)
    models.forward(model, [0] * length, cache, num_logits=1)


def pooled_stats(stats: Iterable[SpecStats]) -> dict[str, Any]:
    """Statistics of many generations pooled as if one (sums of counts and times, then ratios)."""
    rounds, accepted_at, drafted_at = [], [], []
    for s in stats:
        rounds.extend(s.rounds)
        for mine, theirs in ((accepted_at, s.accepted_at), (drafted_at, s.drafted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
    pooled = SpecStats(rounds=rounds, accepted_at=accepted_at, drafted_at=drafted_at)
    out = pooled.to_dict()
    out["gammas"] = [r.drafted for r in rounds]
    out["t_d"] = pooled.draft_s / pooled.drafted if pooled.drafted else 0.0
    return out


# ---- provenance ------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, threads, memory, library versions, date, commit."""
    import transformers

    cpu, flags = platform.processor(), []
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), cpu)
        have = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = None
    try:
        git = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], capture_output=True, text=True,
                             timeout=10, cwd=Path(__file__).parent)
        commit = git.stdout.strip() if git.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "python": platform.python_version(), "cpu": cpu, "cpu_flags": flags,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "memory_gib": round(mem_gib, 1) if mem_gib else None, "torch": torch.__version__,
        "transformers": transformers.__version__, "git_commit": commit,
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
