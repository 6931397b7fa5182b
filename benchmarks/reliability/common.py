"""What the reliability checks share: tiny random models built from configs (never downloaded), real
verifiers on loopback (in-process :class:`LocalVerifier`, or ``agentspec-verifier`` subprocesses where a
check kills or measures one), plain-greedy references, small HTTP helpers and machine information."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import torch

from agentspec.models import LoadedModel
from agentspec.verifier_server.config import ServerConfig

VOCAB = 97  # the char tokenizer: <s>, </s>, printable ASCII
EOS = 1
CHAT_TEMPLATE = (
    "{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] if m['content'] is string else '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CLIENT_CPU, SERVER_CPU = 0, 1  # where separate client and server processes are pinned (if the CPUs exist)


def log(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": EOS, **{chr(c): i + 2 for i, c in enumerate(range(32, 127))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_model(seed: int, layers: int = 2, hidden: int = 64, max_len: int = 1024) -> LoadedModel:
    """A random-weight Llama-shaped float32 model on the CPU; same arguments, same weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
        bos_token_id=0, eos_token_id=EOS, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # sharpen the random model so greedy outputs vary rather than repeat one token
        model.lm_head.weight.mul_(8.0)
    model.eval()
    return LoadedModel(model, char_tokenizer(), f"tiny-{seed}", torch.device("cpu"), torch.float32)


def plain_greedy(target: LoadedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate (stops after EOS)."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def make_prompt(seed: int, length: int = 40) -> list[int]:
    """Random printable tokens with some repetition, so n-gram lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(2, VOCAB, (length // 2,), generator=g).tolist()
    return base + base[: length - len(base)]


def server_config(**kw: Any) -> ServerConfig:
    return replace(ServerConfig(served_model_name="tiny", log_stats_interval_s=0.0), **kw)


def local(target: LoadedModel, **kw: Any):
    """An in-process verifier (uvicorn thread on 127.0.0.1, any free port) serving ``target``."""
    from agentspec.verifier_server.local import LocalVerifier

    return LocalVerifier(target, server_config(**kw))


def client(url: str, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, timeout=timeout, headers=headers)


def finish_rounds(c: httpx.Client, sid: str, base_len: int, drafts: list[int] | None = None, k: int = 0
                  ) -> list[int]:
    """Greedy rounds until the session finishes; ``drafts``: tokens to propose (k at a time, from the
    position reached), so rounds carry drafts that are partly right."""
    tokens: list[int] = []
    while True:
        draft = (drafts or [])[len(tokens): len(tokens) + k]
        r = c.post(f"/v1/spec/sessions/{sid}/rounds",
                   json={"base_len": base_len + len(tokens), "draft": {"tokens": draft}})
        if r.status_code != 200:
            raise RuntimeError(f"round: {r.status_code} {r.text[:200]}")
        tokens += r.json()["tokens"]
        if r.json()["finished"]:
            return tokens


def open_session(c: httpx.Client, prompt: list[int], max_new: int) -> str:
    r = c.post("/v1/spec/sessions", json={"prompt_ids": prompt, "max_new_tokens": max_new})
    if r.status_code != 200:
        raise RuntimeError(f"open session: {r.status_code} {r.text[:200]}")
    return r.json()["session_id"]


def stream_generate(c: httpx.Client, prompt: list[int], max_new: int, mode: str = "server") -> list[int]:
    """Open a session and stream ``/generate`` to the end; raises on any error line."""
    sid = open_session(c, prompt, max_new)
    tokens: list[int] = []
    with c.stream("POST", f"/v1/spec/sessions/{sid}/generate",
                  json={"base_len": len(prompt), "mode": mode, "max_new_tokens": max_new}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"generate: {r.status_code} {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line:
                continue
            msg = json.loads(line)
            if "error" in msg:
                raise RuntimeError(f"generate error line: {msg['error']}")
            tokens += msg["tokens"]
    c.delete(f"/v1/spec/sessions/{sid}")
    return tokens


def chat(c: httpx.Client, messages: list[dict], max_tokens: int, stream: bool, **extra: Any) -> str:
    """One chat completion's text (streamed: the SSE deltas joined); raises on any error."""
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": stream, **extra}
    if not stream:
        r = c.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"chat: {r.status_code} {r.text[:200]}")
        return r.json()["choices"][0]["message"]["content"] or ""
    parts: list[str] = []
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"chat stream: {r.status_code} {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if "error" in msg:
                raise RuntimeError(f"chat stream error: {msg['error']}")
            for choice in msg.get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


# ---- verifier subprocesses -------------------------------------------------------------------------


def save_model(target: LoadedModel, root: Path) -> Path:
    """``target`` as a local model directory ``agentspec-verifier`` can serve."""
    path = root / target.name
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(pid: int, cpu: int) -> str:
    """Pin ``pid`` to ``cpu`` when this machine has it; says what was done."""
    if not hasattr(os, "sched_setaffinity") or cpu >= (os.cpu_count() or 1):
        return f"not pinned (no cpu {cpu})"
    try:
        os.sched_setaffinity(pid, {cpu})
        return f"cpu {cpu}"
    except OSError as e:
        return f"not pinned ({e})"


class VerifierProcess:
    """An ``agentspec-verifier`` subprocess on 127.0.0.1:``port``, pinned to ``SERVER_CPU``."""

    def __init__(self, model_dir: Path, port: int | None = None, args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, fd_limit: int | None = None) -> None:
        """``fd_limit``: the process's open-file limit, soft and hard (None: this process's)."""
        self.model_dir, self.port, self.args, self.fd_limit = model_dir, port or free_port(), args, fd_limit
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.pinned = "not started"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="verifier-", suffix=".log", delete=False)  # noqa: SIM115 (kept open: the process writes to it)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait: bool = True) -> VerifierProcess:
        exe = shutil.which("agentspec-verifier", path=str(Path(sys.executable).parent)) or "agentspec-verifier"
        cmd = [exe, str(self.model_dir), "--port", str(self.port), "--dtype", "float32", "--device", "cpu",
               "--served-model-name", "tiny", "--log-stats-interval", "0", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     preexec_fn=None if self.fd_limit is None else self._limit_fds)
        self.pinned = pin(self.proc.pid, SERVER_CPU)
        if wait:
            self.wait_ready()
        return self

    def _limit_fds(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.fd_limit, self.fd_limit))

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"verifier exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"verifier on {self.port} not ready: {self.tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-800:]


# ---- machine -----------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16")}}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]
