"""agentspec's tool-call drafting inside vLLM: a proposer for vLLM's ``custom_class`` speculative method.

Start vLLM with it (the agentspec package importable in vLLM's environment)::

    vllm serve DIR --speculative-config \\
        '{"method": "custom_class", "model": "agentspec.integrations.vllm.AgentSpecProposer",
          "num_speculative_tokens": 8}'

Every decoding step vLLM hands the proposer each running request's token history (prompt and output); it
answers with a draft chain per request, which vLLM's own rejection sampler verifies — so the output is
exactly vLLM's plain output, greedy or sampled (a deterministic draft is a point-mass proposal). The drafts
are agentspec's default drafting without a model: the grammar-forced spans of a tool call (``{"name": "``,
the function's name once its first tokens are written, keys, braces) from the request's tools, continued
by copies from the context and from a cross-request index of finished answers, cut to what the grammar
allows.

vLLM passes token histories, not requests: the tools come from the rendered prompt (the ``<tools>`` block
of Hermes/Qwen-style chat templates) and the answer starts after the prompt's last
``<|im_start|>assistant`` line. A request without either still gets copy drafts. State is per request
(keyed by its prompt), built on first sight and dropped when the request has not been seen for a few
steps; its answer then joins the cross-request index (``AGENTSPEC_VLLM_CROSS_REQUEST=0`` turns that off:
one index serves every client of the server, so one client's answers can speed up another's).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentspec.drafters.base import DraftContext
from agentspec.drafters.copy import CopyDrafter, SuffixIndex
from agentspec.drafters.grammar import GrammarDrafter, ll_tokenizer
from agentspec.drafters.tree import TreeDrafter

log = logging.getLogger("agentspec.vllm")

ASSISTANT_TURN = "<|im_start|>assistant\n"  # where a ChatML answer starts
TOOLS_OPEN, TOOLS_CLOSE = "<tools>\n", "\n</tools>"
HEAD = 64  # leading tokens a request is looked up by
RETIRE_AFTER = 8  # steps a request may go unscheduled before its state is dropped (and its answer indexed)


@dataclass
class _Request:
    drafter: TreeDrafter
    tools: list[dict[str, Any]] | None
    num_prompt_tokens: int
    prompt: list[int]
    tokens: list[int]  # the history last seen
    last_step: int
    head: str  # hash of the first HEAD tokens: where to look the request up


def tools_from_prompt(text: str) -> list[dict[str, Any]] | None:
    """The tools a Hermes/Qwen-style chat template rendered into the prompt (one JSON object per line inside
    ``<tools>…</tools>``), or None when the prompt has none. Lines that are not a tool's JSON are skipped."""
    start = text.rfind(TOOLS_OPEN)
    if start < 0:
        return None
    end = text.find(TOOLS_CLOSE, start + len(TOOLS_OPEN))
    if end < 0:
        return None
    tools = []
    for line in text[start + len(TOOLS_OPEN) : end].splitlines():
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict) and isinstance(tool.get("function", tool).get("name"), str):
            tools.append(tool if "function" in tool else {"type": "function", "function": tool})
    return tools or None


class ToolCallDrafting:
    """The proposer's engine, free of vLLM: token histories in, one draft chain (at most ``k`` tokens) per
    request out. ``cross_request``: index finished answers for copy drafting in later requests."""

    def __init__(self, tokenizer: Any, k: int, max_model_len: int | None = None, cross_request: bool = True,
                 max_requests: int = 1024) -> None:
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.tokenizer, self.k, self.max_model_len = tokenizer, k, max_model_len
        self.index = SuffixIndex() if cross_request else None
        self.max_requests = max_requests
        self._turn = list(tokenizer.encode(ASSISTANT_TURN, add_special_tokens=False))
        self._requests: OrderedDict[int, _Request] = OrderedDict()  # least recently seen first
        self._by_head: dict[str, list[int]] = {}
        self._next_id = 0
        self._grammars: dict[str, Any] = {}  # compiled per distinct tool set, shared by the requests
        ll_tokenizer(tokenizer)  # llguidance's tokenizer takes seconds to build: at start, not mid-batch
        self._step = 0
        self.stats = {"requests": 0, "with_tools": 0, "proposals": 0, "draft_tokens": 0, "forced_tokens": 0}

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Sequence[int],
                token_ids_cpu: Any) -> list[list[int]]:
        """vLLM's custom proposer call: row ``i`` of ``token_ids_cpu`` holds request ``i``'s history, its first
        ``num_tokens_no_spec[i]`` tokens committed; an empty ``sampled_token_ids[i]`` means no draft this
        step (the request is still prefilling, or was just resumed)."""
        self._step += 1
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n < 2 or (self.max_model_len is not None and n >= self.max_model_len):
                drafts.append([])
                continue
            drafts.append(self.draft([int(t) for t in token_ids_cpu[i, :n]], len(sampled)))
        self._retire()
        return drafts

    def draft(self, tokens: list[int], num_new: int = 1) -> list[int]:
        """One request's draft chain after its committed ``tokens`` (``num_new`` of them sampled last step)."""
        req = self._request(tokens, num_new)
        req.tokens, req.last_step = tokens, self._step
        ctx = DraftContext(tokens=tokens, num_prompt_tokens=req.num_prompt_tokens, tools=req.tools)
        proposal = req.drafter.propose(ctx, self.k)
        chain = _first_path(proposal.tokens, proposal.parent_list())[: self.k]
        self.stats["proposals"] += 1
        self.stats["draft_tokens"] += len(chain)
        self.stats["forced_tokens"] += min(proposal.num_forced, len(chain))
        return chain

    def _request(self, tokens: list[int], num_new: int) -> _Request:
        """The state of the request whose history is ``tokens``: found by its prompt (the same prompt served
        twice at once shares one state, which is only slower), else built."""
        start = _last_index(tokens, self._turn)
        num_prompt = start + len(self._turn) if start >= 0 else None
        head = hashlib.blake2b(repr(tokens[:HEAD]).encode(), digest_size=16).hexdigest()
        found = None
        for rid in self._by_head.get(head, ()):
            req = self._requests[rid]
            if (num_prompt is None or req.num_prompt_tokens == num_prompt) \
                    and req.num_prompt_tokens <= len(tokens) and tokens[: req.num_prompt_tokens] == req.prompt \
                    and (found is None or req.num_prompt_tokens > found[1].num_prompt_tokens):
                found = rid, req
        if found is not None:
            self._requests.move_to_end(found[0])
            return found[1]
        if num_prompt is None:  # first sight: all but the tokens sampled last step are the prompt
            num_prompt = len(tokens) - num_new
        tools = tools_from_prompt(self.tokenizer.decode(tokens[:num_prompt])) if start >= 0 else None
        grammar = GrammarDrafter(self.tokenizer, grammars=self._grammars) if tools else None
        drafter = TreeDrafter(grammar=grammar,
                              copy=CopyDrafter(index=self.index, max_candidates=1), max_forced=self.k)
        req = _Request(drafter, tools, num_prompt, tokens[:num_prompt], tokens, self._step, head)
        self._next_id += 1
        self._requests[self._next_id] = req
        self._by_head.setdefault(head, []).append(self._next_id)
        self.stats["requests"] += 1
        self.stats["with_tools"] += tools is not None
        return req

    def _retire(self) -> None:
        """Drop requests unseen for ``RETIRE_AFTER`` steps (finished, or preempted: a preempted one is rebuilt
        when it comes back) and beyond ``max_requests``; index their answers."""
        while self._requests:
            rid, req = next(iter(self._requests.items()))
            if self._step - req.last_step <= RETIRE_AFTER and len(self._requests) <= self.max_requests:
                break
            del self._requests[rid]
            same = self._by_head[req.head]
            same.remove(rid)
            if not same:
                del self._by_head[req.head]
            if self.index is not None:
                req.drafter.remember(DraftContext(tokens=req.tokens, num_prompt_tokens=req.num_prompt_tokens))


class AgentSpecProposer:
    """vLLM's ``custom_class`` proposer (``speculative_config.model`` =
    ``"agentspec.integrations.vllm.AgentSpecProposer"``): built by vLLM with its ``VllmConfig``."""

    def __init__(self, vllm_config: Any) -> None:
        from transformers import AutoTokenizer

        spec, model = vllm_config.speculative_config, vllm_config.model_config
        tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
        cross = os.environ.get("AGENTSPEC_VLLM_CROSS_REQUEST", "1") != "0"
        self.drafting = ToolCallDrafting(tokenizer, int(spec.num_speculative_tokens), model.max_model_len, cross)
        log.info("agentspec proposer: grammar + copy drafting, k=%d, cross-request index %s",
                 spec.num_speculative_tokens, "on" if cross else "off")

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                **_: Any) -> list[list[int]]:
        """Draft chains for the batch's requests, in the batch's order (``slot_mappings`` is not needed)."""
        return self.drafting.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: the drafts come from the grammar and the context."""


def _last_index(tokens: list[int], pattern: list[int]) -> int:
    """Start of the last occurrence of ``pattern`` in ``tokens``, or -1."""
    m = len(pattern)
    if not m:
        return -1
    for s in range(len(tokens) - m, -1, -1):
        if tokens[s] == pattern[0] and tokens[s : s + m] == pattern:
            return s
    return -1


def _first_path(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The chain from the root along each node's first child (nodes come after their parents)."""
    out, end = [], -1
    for j, (tok, parent) in enumerate(zip(tokens, parents, strict=True)):
        if parent == end:
            out.append(int(tok))
            end = j
    return out
