"""Export a model agentspec can load (an offline alias, a ``.gguf`` file, a checkpoint directory) as a plain
transformers checkpoint directory: what vLLM, SGLang or any other engine loads as a target or a draft model.

vLLM cannot read the offline GGUFs through transformers' GGUF path in order to save them (``save_pretrained``
refuses a gguf-quantised model); agentspec's loader dequantises into a plain model of the same architecture,
which saves like any other. The weights are the dequantised GGUF values, bit for bit in float32.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentspec.models.loading import load_model

EXPORT_INFO = "agentspec_export.json"  # what was exported, from what, in which dtype


def export_checkpoint(source: str, out: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write ``source``'s weights (``dtype``), config, tokenizer and chat template to the directory ``out``.

    ``source``: an offline alias or a ``.gguf`` file. A checkpoint directory (a drafter ``agentspec train``
    wrote, say) is refused: it already is what an engine loads (its head is full-size; an engine ignores the
    reduced-vocabulary file beside it). Refuses a non-empty ``out`` unless ``overwrite``."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if Path(source).is_dir():
        raise ValueError(f"{source} is already a checkpoint directory: give it to the engine as it is")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(f"{path} is not empty; pass overwrite=True (--overwrite) to replace its files")
    loaded = load_model(source, device="cpu", dtype=dtype, pack_linears=False)
    model = loaded.model
    path.mkdir(parents=True, exist_ok=True)
    model.config.name_or_path = str(path)
    model.save_pretrained(path)
    loaded.tokenizer.save_pretrained(path)
    info = {"source": source, "dtype": dtype, "architecture": type(model).__name__,
            "vocab_size": int(model.config.vocab_size)}
    (path / EXPORT_INFO).write_text(json.dumps(info, indent=1) + "\n")
    return path
