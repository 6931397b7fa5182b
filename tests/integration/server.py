"""A real agentspec-verifier on 127.0.0.1 (port 0) in a background thread, and a minimal edge-mode loop."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import httpx

from agentspec.drafters.base import DraftContext, Drafter
from agentspec.models import LoadedModel
from agentspec.types import SamplingParams
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.local import LocalVerifier


class LoopbackServer(LocalVerifier):
    """Start with ``with LoopbackServer(target, config) as srv:``; ``srv.url`` is the base URL."""

    def __init__(self, target: LoadedModel, config: ServerConfig | None = None,
                 draft_model: LoadedModel | None = None, warm: bool = True, port: int = 0) -> None:
        super().__init__(target, config or ServerConfig(served_model_name="tiny"), draft_model, warm, port=port)


@dataclass
class EdgeResult:
    tokens: list[int]
    finish_reason: str
    rounds: list[dict]


def edge_generate(client: httpx.Client, prompt: list[int], drafter: Drafter | None, k: int, max_new: int,
                  sampling: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> EdgeResult:
    """Open a session and run edge-mode rounds with a local drafter until the server says finished."""
    r = client.post("/v1/spec/sessions", json={"prompt_ids": prompt, "max_new_tokens": max_new}, headers=headers)
    r.raise_for_status()
    sid = r.json()["session_id"]
    tokens = list(prompt)
    params = SamplingParams(**{k: v for k, v in (sampling or {}).items() if k != "seed"})
    rounds: list[dict] = []
    generator = None
    if not params.greedy:
        import torch

        generator = torch.Generator().manual_seed((sampling or {}).get("seed") or 0)
    if drafter is not None:
        drafter.reset()
    while True:
        draft: dict[str, Any] = {"tokens": []}
        if drafter is not None and k > 0:
            ctx = DraftContext(tokens, len(prompt), params, generator)
            proposal = drafter.propose(ctx, k)
            draft = {"tokens": list(proposal.tokens)}
            if proposal.is_tree:
                draft["parents"] = list(proposal.parents)
            if proposal.draft_probs is not None:
                draft["q"] = [{"ids": list(d.ids), "probs": list(d.probs)} for d in proposal.draft_probs]
        body = {"base_len": len(tokens), "draft": draft, "sampling": sampling or {}}
        r = client.post(f"/v1/spec/sessions/{sid}/rounds", json=body, headers=headers)
        r.raise_for_status()
        reply = r.json()
        rounds.append(reply)
        tokens.extend(reply["tokens"])
        assert reply["committed_len"] == len(tokens)
        if reply["finished"]:
            return EdgeResult(tokens[len(prompt) :], reply["finish_reason"], rounds)


ALIAS = "agentspec-alias"  # a second name every test server answers to (per-call model override)


def config(**kw: Any) -> ServerConfig:
    return replace(ServerConfig(served_model_name="tiny", model_aliases=(ALIAS,)), **kw)
