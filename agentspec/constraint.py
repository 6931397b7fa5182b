"""Grammar-constrained decoding that stays lossless under speculation.

A :class:`Constraint` holds one answer's grammar (the tagged tool calls a required or named ``tool_choice``
demands, or the JSON value of a ``response_format``) as an llguidance matcher that follows the committed
tokens. In a round it masks every verified row — the root and each draft node, each by the grammar state
its own path reaches (consumed, then rolled back) — so the accept/reject walk runs on the *masked* target:
greedy output equals masked plain greedy and sampled output has the masked, renormalised law. Stop tokens
are allowed exactly where the grammar accepts. Where the mask allows a single token the answer takes it
without asking the target (:meth:`Constraint.forced_token`): masked plain decoding could pick nothing else.

The drafters use the same object: a draft node the grammar forbids is pruned before it is sent
(:meth:`Constraint.prune`), and a sampled drafter masks its own law (:meth:`Constraint.allowed_after`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from agentspec.drafters.base import common_prefix
from agentspec.drafters.grammar import ToolCallGrammar
from agentspec.toolcalls import wants_constraint
from agentspec.types import DraftProposal, SparseDist

__all__ = ["Constraint", "ConstraintError", "wants_constraint"]


class ConstraintError(ValueError):
    """The request's structure cannot be enforced (a schema the grammar engine refuses), or committed tokens
    break the grammar."""


class Constraint:
    """One answer's grammar over token ids; :meth:`sync` follows ``tokens[start:]`` (rolling back on change).

    ``parallel_tool_calls=False`` (and a named ``tool_choice``) allow one call only."""

    def __init__(self, tokenizer: Any, tools: Any, tool_choice: Any, response_format: Any,
                 stop_token_ids: Iterable[int], parallel_tool_calls: bool = True) -> None:
        try:
            grammar = ToolCallGrammar(tokenizer, tools, tool_choice, response_format)
        except ValueError as e:
            raise ConstraintError(f"this structure cannot be enforced: {e}") from e
        body = grammar.enforced(tool_choice, parallel_tool_calls)
        if body is None:
            raise ConstraintError("nothing to enforce: tool_choice needs tools, response_format a JSON type")
        compiled, error = grammar.compile(body)
        if error is not None:
            raise ConstraintError(f"the grammar engine cannot enforce this structure: {error}")
        self._matcher = grammar.new_matcher(compiled)
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar engine cannot enforce this structure: {self._matcher.get_error()}")
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.vocab_size = int(grammar.vocab_size)  # the mask's width; a wider model head's extra rows are -inf
        # llguidance allows its EOS where the grammar accepts; only the session's stop tokens may end it
        eos = grammar.eos_token_id
        self._foreign_eos = eos if eos is not None and eos not in self.stop_token_ids and eos < self.vocab_size \
            else None
        self._words = (self.vocab_size + 31) // 32
        self._consumed: list[int] = []  # answer tokens the matcher has consumed (stop tokens excluded)
        self._start = -1
        self._lock = threading.Lock()  # a server session's rounds and drafts may run on different threads
        self.jump_forward = True  # False: every token, forced or not, goes through a target pass

    # -- following the committed answer ---------------------------------------------------------------

    def sync(self, tokens: Sequence[int], start: int) -> None:
        """Make the matcher's state the one after ``tokens[start:]`` (the answer so far, its stop token
        left out); raises :class:`ConstraintError` if those tokens break the grammar."""
        with self._lock:
            bad = self._move_to([t for t in tokens[start:] if t not in self.stop_token_ids], start)
        if bad is not None:
            raise ConstraintError(f"committed answer token {bad[1]} (position {bad[0]}) breaks the grammar")

    def _move_to(self, answer: list[int], start: int) -> tuple[int, int] | None:
        """Roll back to the common prefix with ``answer`` and consume the rest; on a token the grammar
        forbids, stop before it and return (its position, it)."""
        if start != self._start:
            self._matcher.reset()
            self._consumed, self._start = [], start
        keep = common_prefix(self._consumed, answer)
        if keep < len(self._consumed):
            self._matcher.rollback(len(self._consumed) - keep)
            del self._consumed[keep:]
        extra = answer[keep:]
        ok = int(self._matcher.validate_tokens(extra)) if extra else 0
        for tok in extra[:ok]:
            self._matcher.consume_token(tok)
        self._consumed.extend(extra[:ok])
        return None if ok == len(extra) else (keep + ok, extra[ok])

    # -- masks ----------------------------------------------------------------------------------------

    def _row(self, out: torch.Tensor, i: int) -> None:
        """Row ``i`` of the int32 bitmask ``out``: the tokens allowed in the matcher's current state."""
        v = out[i]
        self._matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def _bits(self, packed: torch.Tensor, accepting: list[bool]) -> torch.Tensor:
        """Unpacked ``[rows, vocab]`` bool masks; stop tokens allowed exactly where the grammar accepts, and
        a row that allows nothing (a dead end) allows the stop tokens, so the answer can always end."""
        bits = np.unpackbits(packed.numpy().view(np.uint8), bitorder="little").reshape(packed.shape[0], -1)
        allowed = torch.from_numpy(bits[:, : self.vocab_size].astype(bool))
        if self._foreign_eos is not None:
            allowed[:, self._foreign_eos] = False
        stops = [t for t in self.stop_token_ids if t < self.vocab_size]
        if stops:
            allowed[:, stops] = torch.tensor(accepting)[:, None]
        dead = ~allowed.any(dim=-1)
        if dead.any():  # the grammar has ended (or cannot go on): the answer ends — by a stop token, else by
            # llguidance's EOS; a session with neither goes on unconstrained rather than with no token at all
            ends = stops or ([self._foreign_eos] if self._foreign_eos is not None else [])
            rows = dead.nonzero()[:, 0]
            if ends:
                allowed[rows[:, None], torch.tensor(ends)] = True
            else:
                allowed[rows] = True
        return allowed

    def masks(self, draft_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """``[n + 1, vocab]`` bool: row 0 after the synced answer, row ``i + 1`` after draft node i's path.

        A node the grammar forbids at its parent keeps an all-true row for itself and its subtree: the
        target can never accept it (its own token is masked at the parent), so those rows are never used."""
        n = len(draft_tokens)
        packed = torch.zeros((n + 1, self._words), dtype=torch.int32)
        accepting = [False] * (n + 1)
        dead = [False] * (n + 1)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        for i, p in enumerate(parents):
            children[p + 1].append(i)
        with self._lock:
            try:
                self._walk(packed, accepting, dead, draft_tokens, parents, children)
            except BaseException:
                self._start = -1  # the matcher may hold part of a path: the next sync starts afresh
                raise
        allowed = self._bits(packed, accepting)
        for row, is_dead in enumerate(dead):
            if is_dead:
                allowed[row] = True
        return allowed

    def _walk(self, packed: torch.Tensor, accepting: list[bool], dead: list[bool], draft_tokens: Sequence[int],
              parents: Sequence[int], children: list[list[int]]) -> None:
        """:meth:`masks`' depth-first walk (under the lock): consume a node, fill its row, visit its subtree,
        roll back."""
        self._row(packed, 0)
        accepting[0] = bool(self._matcher.is_accepting())
        stack: list[tuple[int, bool]] = [(c, False) for c in reversed(children[0])]
        while stack:
            node, leaving = stack.pop()
            if leaving:
                self._matcher.rollback(1)
                continue
            tok, parent = int(draft_tokens[node]), int(parents[node])
            # a token outside the parent's mask would put the matcher in its error state: check first
            if (tok in self.stop_token_ids or tok >= self.vocab_size or tok == self._foreign_eos
                    or not _bit(packed, parent + 1, tok)):
                for d in _subtree(children, node):
                    dead[d + 1] = True
                continue
            if not self._matcher.consume_token(tok) or self._matcher.is_error():
                raise ConstraintError(f"the grammar engine failed: {self._matcher.get_error()}")
            self._row(packed, node + 1)
            accepting[node + 1] = bool(self._matcher.is_accepting())
            stack.append((node, True))
            stack.extend((c, False) for c in reversed(children[node + 1]))

    def apply(self, logits: torch.Tensor, draft_tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """``logits`` (``[n + 1, vocab']``) with every token the grammar forbids at -inf (float32 copy)."""
        allowed = self.masks(draft_tokens, parents).to(logits.device)
        out = logits.float().clone()
        width = min(out.shape[-1], allowed.shape[-1])
        out[:, :width].masked_fill_(~allowed[:, :width], float("-inf"))
        out[:, width:] = float("-inf")  # padding rows of a head wider than the vocabulary
        return out

    def forced_token(self) -> int | None:
        """The one token the grammar allows next, if it allows exactly one and it is no stop token."""
        if self._matcher.is_stopped() or self._matcher.is_accepting():
            return None
        packed = torch.zeros((1, self._words), dtype=torch.int32)
        with self._lock:
            self._row(packed, 0)
        words = packed[0].numpy().view(np.uint32)
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1 or int(words[nonzero[0]]) & (int(words[nonzero[0]]) - 1):
            return None
        tok = int(nonzero[0]) * 32 + int(words[nonzero[0]]).bit_length() - 1
        return None if tok in self.stop_token_ids or tok >= self.vocab_size or tok == self._foreign_eos else tok

    def take_forced(self, tokens: list[int], start: int, room: int) -> list[int]:
        """Append to ``tokens`` (synced) the run of single-choice tokens the grammar forces, at most ``room``."""
        taken: list[int] = []
        while len(taken) < room:
            tok = self.forced_token()
            if tok is None:
                break
            tokens.append(tok)
            taken.append(tok)
            self.sync(tokens, start)
        return taken

    # -- drafts ---------------------------------------------------------------------------------------

    def allowed_after(self, tokens: Sequence[int]) -> torch.Tensor | None:
        """The bool mask ``[vocab]`` after ``tokens`` (the synced answer's tokens and a draft path after
        them), or None if the grammar forbids the path: a drafter masks its own law with it, so its sampled
        drafts stay valid and their q exact. The next :meth:`sync` moves back to the committed answer."""
        if self._start < 0:
            raise ConstraintError("sync the constraint with the committed tokens first")
        answer = list(tokens[self._start :])
        if any(t in self.stop_token_ids for t in answer):
            return None
        packed = torch.zeros((1, self._words), dtype=torch.int32)
        with self._lock:
            if self._move_to(answer, self._start) is not None:
                return None
            self._row(packed, 0)
            accepting = bool(self._matcher.is_accepting())
        return self._bits(packed, [accepting])[0]

    def prune(self, proposal: DraftProposal) -> DraftProposal:
        """``proposal`` without the nodes the grammar forbids (and their subtrees).

        Only deterministic nodes are pruned by value (a point-mass proposal the target would reject anyway);
        a sampled node's law must be masked where it is drawn (:meth:`allowed_after`) — one found invalid
        anyway is kept, since cutting it by its own value would change its law (the masked target rejects it)."""
        if not len(proposal):
            return proposal
        parents = proposal.parent_list()
        rows = self.masks(proposal.tokens, parents)
        keep: list[int] = []
        alive = [True] * len(parents)
        for i, p in enumerate(parents):
            tok = proposal.tokens[i]
            ok = (p < 0 or alive[p]) and tok < rows.shape[1] and bool(rows[p + 1, tok])
            if not ok and p >= 0 and not alive[p]:
                alive[i] = False
                continue
            q = proposal.draft_probs[i] if proposal.draft_probs is not None else None
            if not ok and q is not None and len(q.ids) > 1:
                ok = True  # sampled: cutting it by its own value would change its law; the server rejects it
            alive[i] = ok
            if ok:
                keep.append(i)
        if len(keep) == len(parents):
            return proposal
        return _select(proposal, keep)


def _bit(packed: torch.Tensor, row: int, tok: int) -> bool:
    return bool((int(packed[row, tok // 32]) >> (tok % 32)) & 1)


def _subtree(children: list[list[int]], node: int) -> list[int]:
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        todo.extend(children[n + 1])
    return out


def _select(proposal: DraftProposal, keep: list[int]) -> DraftProposal:
    """The nodes ``keep`` of ``proposal`` (closed under parents), renumbered; the forced lead shrinks to the
    kept prefix of it."""
    index = {old: new for new, old in enumerate(keep)}
    parents = proposal.parent_list()
    new_parents = tuple(index[parents[i]] if parents[i] >= 0 else -1 for i in keep)
    chain = all(p == j - 1 for j, p in enumerate(new_parents))
    forced = 0
    while forced < len(keep) and keep[forced] == forced and forced < proposal.num_forced:
        forced += 1
    probs: tuple[SparseDist | None, ...] | None = None
    if proposal.draft_probs is not None:
        probs = tuple(proposal.draft_probs[i] for i in keep)
    return DraftProposal(tuple(proposal.tokens[i] for i in keep), None if chain else new_parents, probs,
                         proposal.source, forced)
