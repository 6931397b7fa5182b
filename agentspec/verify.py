"""Lossless verification: the accept/reject math, pure functions on tensors.

Flow of one round (the engine and the server do the I/O around it):

1. the target runs one forward pass over the committed-but-uncached tokens plus the draft nodes,
   with :func:`tree_attention` giving each node the prefix plus its own ancestors;
2. its logits at the last committed token (row 0, the *root*) and at every draft node (row i + 1) are
   turned into ``target_probs`` with :func:`sampling_probs` (or used directly as argmax for greedy);
3. :func:`verify_greedy` / :func:`verify_sampled` walk the draft from the root and return the accepted
   path plus the target's own next token (recovered or bonus).

A linear draft is the chain ``parents = [-1, 0, 1, ...]``; the same walk covers chains and trees.
Sampling follows Leviathan et al. 2023 (Alg. 1) and, for siblings, SpecInfer's multi-step speculative
sampling: try the children in turn, replacing the target distribution by the normalised residual
``max(0, target_probs - draft_probs)`` after each rejection. Every child carries the proposal it was
really drawn from (sparse: the drafter samples from a top-k-truncated distribution).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

import torch

from agentspec.types import SamplingParams, SparseDist, VerifyResult


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., vocab]`` into the distribution the target samples from (float32).

    Temperature, then top-k, then top-p (nucleus, keeping the smallest set with mass >= top_p).
    """
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop = mass_before >= params.top_p
        drop[..., 0] = False  # the most likely token always stays (a top_p below float32's range drops all)
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def process_logits(logits: torch.Tensor, params: SamplingParams, generated: Sequence[int],
                   draft_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
    """Apply ``logit_bias`` and the presence/frequency penalties to a round's logit rows (float32 copy).

    Row 0 follows the ``generated`` tokens, row ``i + 1`` follows them plus node i's root-to-node path, so
    each row is penalised by its own prefix's counts exactly as plain decoding would penalise it: the
    processed target is a function of the prefix and speculation stays lossless under it.
    """
    if not params.processes_logits:
        return logits
    out = logits.float().clone()
    for tok, bias in params.logit_bias:
        if tok < out.shape[-1]:
            out[:, tok] += bias
    pres, freq = params.presence_penalty, params.frequency_penalty
    if pres == 0.0 and freq == 0.0:
        return out
    base = Counter(int(t) for t in generated)
    if base:
        ids = torch.tensor(list(base), dtype=torch.long)
        counts = torch.tensor(list(base.values()), dtype=torch.float32)
        out[:, ids] -= pres + freq * counts  # every row's prefix holds the generated tokens
    paths: list[list[int]] = [[]]
    for i, p in enumerate(parents):  # topological order: a parent's path is known before its children
        paths.append([*paths[p + 1], int(draft_tokens[i])])
    for row, path in enumerate(paths):
        for tok, k in Counter(path).items():  # the extra occurrences the node's ancestors add
            out[row, tok] -= (pres if tok not in base else 0.0) + freq * k
    return out


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top_n: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each committed token, its log-probability at ``logits[row]`` and the ``top_n`` most likely
    alternatives there (the target's own log-softmax, before biases, penalties and temperature)."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[list(rows)].float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()
    if top_n:
        top = torch.topk(lp, top_n, dim=-1)
        alts = [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    else:
        alts = [[] for _ in tokens]
    return list(zip(chosen, alts, strict=True))


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """``children[i + 1]`` lists node i's children in order; ``children[0]`` are the root's."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p + 1].append(i)
    return children


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def tree_attention(parents: Sequence[int], num_cached: int, num_pending: int, dtype: torch.dtype,
                   device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive attention mask ``[1, 1, q, kv]`` and ``position_ids [1, q]`` for one verify pass.

    The query holds ``num_pending`` committed tokens not yet in the KV cache (causal among themselves)
    followed by the draft nodes; each node sees the cached prefix, all pending tokens and its ancestors.
    Positions are ``prefix length + depth``.
    """
    n = len(parents)
    q, kv = num_pending + n, num_cached + num_pending + n
    allowed = torch.zeros(q, kv, dtype=torch.bool)
    allowed[:, :num_cached] = True
    causal = torch.tril(torch.ones(num_pending, num_pending, dtype=torch.bool))
    allowed[:num_pending, num_cached : num_cached + num_pending] = causal
    allowed[num_pending:, num_cached : num_cached + num_pending] = True
    depth = [0] * n
    for i, p in enumerate(parents):
        row = num_pending + i
        allowed[row, num_cached + row] = True  # itself
        if p >= 0:
            depth[i] = depth[p] + 1
            allowed[row, num_cached + num_pending : kv] |= allowed[num_pending + p, num_cached + num_pending : kv]
    mask = torch.zeros(q, kv, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    prefix = num_cached + num_pending
    positions = list(range(num_cached, prefix)) + [prefix + d for d in depth]
    return mask[None, None].to(device), torch.tensor([positions], device=device)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over its last dimension, the first of equal maxima (a tie goes to the lower id).

    On the CPU, ``max(dim).indices`` gives the same ids at a fraction of ``argmax``'s cost (bf16 rows of a
    152k vocabulary: about a fifth; a tree round's 13 rows cost 7 ms through ``argmax``). Elsewhere
    ``max`` does not promise the first of equal maxima, so ``argmax`` stays."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1).indices
    return logits.argmax(dim=-1)


def verify_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int], parents: Sequence[int] | None = None,
                  stop_token_ids: Collection[int] = ()) -> VerifyResult:
    """Accept the longest draft path that equals the target's argmax, then append the target's argmax.

    ``target_logits``: ``[n + 1, vocab]``, row 0 at the root, row i + 1 after draft node i.
    """
    if target_logits.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"need {len(draft_tokens) + 1} logit rows for {len(draft_tokens)} draft tokens")
    target_argmax = greedy_ids(target_logits).tolist()  # [n + 1]; one device sync
    children = children_lists(parents if parents is not None else chain_parents(len(draft_tokens)))
    path: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        nxt = next((c for c in children[node + 1] if draft_tokens[c] == want), None)
        if nxt is None:
            return _result(path, draft_tokens, want, bonus=not children[node + 1])
        path.append(nxt)
        node = nxt
        if want in stop_token_ids:
            return _result(path, draft_tokens, None, bonus=False)


def verify_sampled(target_probs: torch.Tensor, draft_tokens: Sequence[int],
                   draft_probs: Sequence[SparseDist | None] | None, parents: Sequence[int] | None = None,
                   generator: torch.Generator | None = None, stop_token_ids: Collection[int] = ()) -> VerifyResult:
    """Speculative sampling: the result is distributed exactly as sampling from ``target_probs``.

    ``target_probs``: ``[n + 1, vocab]`` (from :func:`sampling_probs`), row 0 at the root.
    ``draft_probs[i]``: the proposal node i was sampled from (``None``: deterministic, a point mass).
    Siblings must have been drawn independently, each from its own ``draft_probs``.
    """
    n = len(draft_tokens)
    if target_probs.shape[0] != n + 1:
        raise ValueError(f"need {n + 1} probability rows for {n} draft tokens")
    target_probs = target_probs.float().cpu()  # small rows; keeps the walk free of device syncs
    children = children_lists(parents if parents is not None else chain_parents(n))
    path: list[int] = []
    node = -1
    while True:
        probs = target_probs[node + 1]
        accepted = None
        for child in children[node + 1]:
            token = draft_tokens[child]
            dist = draft_probs[child] if draft_probs is not None else None
            draft_ids, draft_p = _dense_parts(dist, token)
            draft_prob = float(draft_p[draft_ids.tolist().index(token)])
            if float(torch.rand((), generator=generator)) * draft_prob < float(probs[token]):
                accepted = child
                break
            residual = probs.clone()
            residual[draft_ids] -= draft_p
            residual.clamp_(min=0.0)
            total = float(residual.sum())
            # total == 0 means target == proposal, where rejection has probability 0; keep probs then.
            if total > 0.0:
                probs = residual / total
        if accepted is None:
            token = int(torch.multinomial(probs, 1, generator=generator))
            return _result(path, draft_tokens, token, bonus=not children[node + 1])
        path.append(accepted)
        node = accepted
        if draft_tokens[accepted] in stop_token_ids:
            return _result(path, draft_tokens, None, bonus=False)


def _dense_parts(dist: SparseDist | None, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    if dist is None:
        dist = SparseDist.point(token)
    if token not in dist.ids:
        raise ValueError(f"draft token {token} is outside the support of the distribution it was drawn from")
    return torch.tensor(dist.ids, dtype=torch.long), torch.tensor(dist.probs, dtype=torch.float32)


def _result(path: list[int], draft_tokens: Sequence[int], next_token: int | None, bonus: bool) -> VerifyResult:
    return VerifyResult(tuple(path), tuple(int(draft_tokens[i]) for i in path), next_token, bonus)


def path_depth(parents: Sequence[int], result: VerifyResult) -> int:
    """How many draft positions lay along the path the target took (accepted ones + one rejected, if any)."""
    last = result.accepted_nodes[-1] if result.accepted_nodes else -1
    has_child = any(p == last for p in parents)
    return result.num_accepted + (1 if has_child and result.next_token is not None else 0)
