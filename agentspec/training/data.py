"""Training prompts: OpenAI-style chat JSONL with tools, BFCL (from the ``bfcl-eval`` wheel), SpecClient logs.

Every source becomes :class:`ChatExample` (an id, a category, messages, tools); :func:`split` holds some out
by a stable hash of the id or by category, written into the report so evaluation never sees training
prompts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# BFCL writes Python/Java type names; chat templates and JSON Schema expect these (as BFCL's own
# OpenAI handler maps them). Only string values of a "type" key are touched, never property names.
_SCHEMA_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "bool": "boolean",
                 "any": "string"}


@dataclass(frozen=True)
class ChatExample:
    """One prompt to distil on: chat messages (OpenAI format) and the tools offered."""

    id: str
    category: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] = field(default=())


def bfcl_data_dir() -> Path:
    """The data directory inside the installed ``bfcl_eval`` wheel (``pip install --no-deps bfcl-eval``)."""
    import importlib.util

    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("BFCL data needs `pip install --no-deps bfcl-eval==2026.3.23`")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def load_bfcl(category: str) -> list[dict]:
    """All records of one category (a JSON-lines file ``BFCL_v4_<category>.json``)."""
    path = bfcl_data_dir() / f"BFCL_v4_{category}.json"
    if not path.exists():
        raise ValueError(f"no BFCL category {category!r} (looked for {path})")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def normalise_schema(obj: Any) -> Any:
    """Copy of a BFCL schema with ``"type": "dict"`` → ``"object"`` (and float/tuple/…), recursively."""
    if isinstance(obj, dict):
        return {k: (_SCHEMA_TYPES.get(v, v) if k == "type" and isinstance(v, str) else normalise_schema(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalise_schema(v) for v in obj]
    return obj


def to_openai_tools(functions: Iterable[dict]) -> tuple[dict, ...]:
    """BFCL function docs → ``[{"type": "function", "function": {...}}]`` with normalised schemas."""
    return tuple({"type": "function", "function": normalise_schema(f)} for f in functions)


def bfcl_examples(categories: Sequence[str]) -> list[ChatExample]:
    """Every single-turn record of the given BFCL categories (the turns' messages concatenated)."""
    out = []
    for category in categories:
        for record in load_bfcl(category):
            messages = tuple(dict(m) for turn in record["question"] for m in turn)
            out.append(ChatExample(record["id"], category, messages, to_openai_tools(record["function"])))
    return out


def jsonl_examples(path: str | Path) -> list[ChatExample]:
    """Chat JSONL: one ``{"messages": [...], "tools": [...], "id"?: ..., "category"?: ...}`` per line.

    SpecClient's opt-in request logs (``SpecClient(log_path=...)``) have this shape (plus the output)."""
    path = Path(path)
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{i + 1}: not JSON: {e}") from None
            messages = rec.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError(f"{path}:{i + 1}: needs a non-empty 'messages' list")
            # the prompt is every message up to the last user/tool turn: a logged answer is not a prompt
            while messages and messages[-1].get("role") == "assistant":
                messages = messages[:-1]
            if not messages:
                raise ValueError(f"{path}:{i + 1}: no prompt messages before the assistant's answer")
            out.append(ChatExample(str(rec.get("id", f"{path.stem}-{i}")), str(rec.get("category", path.stem)),
                                   tuple(messages), tuple(rec.get("tools") or ())))
    return out


def load_examples(spec: str) -> list[ChatExample]:
    """``spec``: comma-separated sources, each ``bfcl:<cat>[+<cat>…]`` or a JSONL path; ``bfcl:a,b`` also
    works when every comma-separated part after it names a BFCL category."""
    out: list[ChatExample] = []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    bfcl: list[str] | None = None
    for part in parts:
        if part.startswith("bfcl:"):
            bfcl = [c for c in part[5:].split("+") if c]
            out += bfcl_examples(bfcl)
        elif bfcl is not None and not Path(part).exists():
            out += bfcl_examples([part])  # "bfcl:simple_python,multiple": the next category
        else:
            out += jsonl_examples(part)
    ids = [e.id for e in out]
    if len(set(ids)) != len(ids):
        raise ValueError("example ids must be unique across the data sources")
    return out


def _in_heldout(example_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(example_id.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split(examples: Sequence[ChatExample], by: str = "id", fraction: float = 0.2,
          heldout_categories: Sequence[str] = ()) -> tuple[list[ChatExample], list[ChatExample]]:
    """(train, held-out): by a stable hash of each id, or whole categories held out."""
    if by == "id":
        held = [_in_heldout(e.id, fraction) for e in examples]
    elif by == "category":
        held = [e.category in set(heldout_categories) for e in examples]
    else:
        raise ValueError(f"split must be 'id' or 'category', got {by!r}")
    train = [e for e, h in zip(examples, held, strict=True) if not h]
    heldout = [e for e, h in zip(examples, held, strict=True) if h]
    if not train or not heldout:
        raise ValueError(f"the {by} split left {len(train)} training and {len(heldout)} held-out prompts")
    return train, heldout


def spread(examples: Sequence[ChatExample], n: int) -> list[ChatExample]:
    """At most ``n`` examples spread evenly over the list (deterministic)."""
    if n >= len(examples):
        return list(examples)
    return [examples[(i * len(examples)) // n] for i in range(n)]
