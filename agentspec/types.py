"""Plain data passed between agentspec's parts: sampling settings, drafts, verification results, statistics.

Everything here is a small dataclass with no heavy imports, so the wire protocol, the client and the
server can share it without pulling in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How the target picks tokens. ``temperature == 0`` means greedy.

    The same processing defines the target distribution that speculative decoding reproduces exactly:
    ``logit_bias`` (token id → added to its logit) and the OpenAI presence/frequency penalties (over the
    tokens generated so far, so each draft position gets its own prefix's), then temperature, top-k, top-p.
    ``logprobs``: also return each chosen token's log-probability and that many top alternatives (the
    target's own log-softmax, before any processing), ``None`` for none.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted((int(k), float(v)) for k, v in
                                                              self.logit_bias.items())))
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs (top alternatives per token) must be in [0, 20], got {self.logprobs!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits are changed before temperature (biases or penalties)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SparseDist:
    """A distribution with small support: the drafter's top-k-truncated proposal (ids and their probs)."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.probs) or not self.ids:
            raise ValueError("SparseDist needs equally long, non-empty ids and probs")

    @classmethod
    def point(cls, token: int) -> SparseDist:
        """The proposal of a deterministic drafter: all mass on one token."""
        return cls((token,), (1.0,))


def check_parents(parents: Sequence[int], num_tokens: int) -> None:
    """A draft tree's parent list: one entry per token, each -1 (the root) or an earlier node (topological
    order, so no cycles); raises ``ValueError`` saying what is wrong."""
    if len(parents) != num_tokens:
        raise ValueError(f"parents has {len(parents)} entries for {num_tokens} draft tokens")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: each parent must be -1 (the root) or an earlier node "
                             "(topological order, so no cycles)")


# what the target took of an edge round's draft, for the router (agentspec.client.run.Run.taken): the free
# positions of its main path (γ), reached and accepted along the target's path; and its main path's survival
Taken = tuple[tuple[int, int, int], tuple[int, int]]


@dataclass(frozen=True)
class DraftProposal:
    """Draft tokens: a chain or a tree, in topological order.

    ``parents[i]`` is the index of node i's parent, ``-1`` for a child of the last committed token.
    ``parents is None`` means a linear chain. ``draft_probs[i]`` is the (sparse) distribution node i's
    token was *really* sampled from; ``None`` (per node or for the whole draft) means the drafter was
    deterministic (a point mass), which is what n-gram, grammar and greedy model drafts are.
    ``num_forced`` leading chain nodes are grammar-forced (drafted whatever γ the policy chose).
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] | None = None
    draft_probs: tuple[SparseDist | None, ...] | None = None
    source: str = ""
    num_forced: int = 0

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if self.parents is not None:
            check_parents(self.parents, n)
        if not 0 <= self.num_forced <= n:
            raise ValueError(f"num_forced must be in [0, {n}], got {self.num_forced}")
        if self.draft_probs is not None and len(self.draft_probs) != n:
            raise ValueError(f"draft_probs has {len(self.draft_probs)} entries for {n} draft tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def parent_list(self) -> list[int]:
        """Parent indices, also for a linear chain."""
        return list(self.parents) if self.parents is not None else list(range(-1, len(self.tokens) - 1))

    def head(self, n: int) -> DraftProposal:
        """The first ``n`` nodes (topological order keeps every kept node's parent)."""
        if n >= len(self.tokens):
            return self
        parents = self.parents[:n] if self.parents is not None else None
        probs = self.draft_probs[:n] if self.draft_probs is not None else None
        return DraftProposal(self.tokens[:n], parents, probs, self.source, min(self.num_forced, n))

    def within(self, n: int) -> DraftProposal:
        """At most ``n`` nodes for a pass that can carry no more: the main path first (:meth:`spine`), then
        the other nodes in topological order while their parent is kept and room is left. A drafter's tree
        lists each chain token's sibling leaves right after it, so :meth:`head` would trade the chain's depth
        for leaves the target takes far less often (a 12-node tree cut to 5 kept 3 chain tokens). Each
        kept node keeps the first of its children (in order): a sampled tree's siblings stay a prefix of
        its draws, as its verification needs."""
        if n >= len(self.tokens) or self.parents is None:
            return self.head(n)
        keep = set(self.spine()[: max(n, 0)])
        for i, p in enumerate(self.parents):
            if len(keep) >= n:
                break
            if i not in keep and (p < 0 or p in keep):
                keep.add(i)
        kept = sorted(keep)
        index = {old: new for new, old in enumerate(kept)}
        parents = tuple(index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept)
        probs = None if self.draft_probs is None else tuple(self.draft_probs[i] for i in kept)
        return DraftProposal(tuple(self.tokens[i] for i in kept), parents, probs, self.source,
                             min(self.num_forced, len(kept)))

    def spine(self) -> list[int]:
        """The nodes of the main path: the first root, then each node's first child (a chain drafter's own
        picks, its siblings after them; a merged tree's first candidate). A chain is all spine."""
        if self.parents is None:
            return list(range(len(self.tokens)))
        first: dict[int, int] = {}
        for i, p in enumerate(self.parents):
            first.setdefault(p, i)
        nodes, node = [], first.get(-1)
        while node is not None:
            nodes.append(node)
            node = first.get(node)
        return nodes

    def depth_along(self, tokens: Sequence[int], accepted: int) -> int:
        """How many draft positions lay along the path the target took, from the tokens a round committed
        (its ``accepted`` draft tokens, then the target's own next token, if any): the accepted ones, plus
        the one rejected where the last accepted node (or the root) had children. The client's view of
        :func:`agentspec.verify.path_depth`: a sibling leaf, or a spine the target took to its end, ends
        the path without a rejection past it."""
        children: dict[int, dict[int, int]] = {}
        for i, p in enumerate(self.parent_list()):
            children.setdefault(p, {}).setdefault(self.tokens[i], i)
        node = -1
        for tok in tokens[:accepted]:
            if tok not in children.get(node, {}):  # not this draft's path (never for the round it verified)
                return min(accepted + 1, len(self))
            node = children[node][tok]
        return accepted + (1 if node in children and len(tokens) > accepted else 0)

    def spine_acceptance(self, tokens: Sequence[int], guess: int | None = None) -> tuple[int, int]:
        """(reached, accepted) free positions of the main path (:meth:`spine`), and of ``guess`` after it (the
        target's next token as a draft made ahead assumed it), along the tokens a round committed. A round
        whose draft ahead is used must get all of them: a sibling leaf taken counts as a miss here."""
        path = [*self.spine_tokens(), *(() if guess is None else (guess,))]
        k = 0
        while k < min(len(path), len(tokens)) and tokens[k] == path[k]:
            k += 1
        reached = k + 1 if k < len(path) and len(tokens) > k else k
        f = self.num_forced
        return (0, 0) if k < f else (reached - f, k - f)

    def free_acceptance(self, reached: int, accepted: int) -> tuple[int, int, int]:
        """(drafted, reached, accepted) of the round's *free* draft tokens, for the γ policy's estimates
        (``reached``: :meth:`depth_along`). Forced tokens are not the policy's choice and are accepted
        almost surely; counting them would inflate α. When the target rejects a forced token the free
        tokens were never reached."""
        f = self.num_forced
        if accepted < f:
            return len(self) - f, 0, 0
        return len(self) - f, max(reached - f, 0), accepted - f

    def spine_tokens(self) -> list[int]:
        """The tokens of :meth:`spine`'s nodes."""
        return [self.tokens[i] for i in self.spine()]

    def cut(self, start: int, stop: int) -> DraftProposal:
        """The subtree under spine node ``start - 1`` (the whole draft for 0), to depth ``stop - 1``: spine
        nodes ``start:stop`` and their siblings' subtrees as deep; the grammar-forced lead shifts along."""
        spine = self.spine()
        forced = min(max(self.num_forced - start, 0), max(stop - start, 0))
        if self.parents is None:
            probs = None if self.draft_probs is None else self.draft_probs[start:stop]
            return DraftProposal(self.tokens[start:stop], None, probs, self.source, forced)
        if start > len(spine):
            return DraftProposal(source=self.source)
        top = spine[start - 1] if start > 0 else -1
        depth: list[int] = []
        index: dict[int, int] = {top: -1}
        kept: list[int] = []
        parents: list[int] = []
        for i, p in enumerate(self.parents):
            depth.append(0 if p < 0 else depth[p] + 1)
            if p in index and depth[i] < stop:
                index[i] = len(kept)
                kept.append(i)
                parents.append(index[p])
        probs = None if self.draft_probs is None else tuple(self.draft_probs[i] for i in kept)
        tree = any(q != j - 1 for j, q in enumerate(parents))
        return DraftProposal(tuple(self.tokens[i] for i in kept), tuple(parents) if tree else None, probs,
                             self.source, forced)

    def depth(self) -> int:
        """Length of the longest root-to-leaf path."""
        depths: list[int] = []
        for p in self.parent_list():
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification round.

    ``accepted_nodes`` are draft node indices on the accepted root-to-node path, ``accepted_tokens`` their
    tokens. ``next_token`` is the target's own token after them: *recovered* after a rejection, *bonus*
    after the draft path was accepted to a leaf. It is ``None`` only when an accepted draft token was a
    stop token (nothing may follow it).
    """

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    next_token: int | None
    bonus: bool

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)

    @property
    def output_tokens(self) -> tuple[int, ...]:
        """Tokens this round commits: the accepted ones plus the recovered/bonus token."""
        tail = () if self.next_token is None else (self.next_token,)
        return self.accepted_tokens + tail


@dataclass
class RoundStats:
    """What one speculative round did and cost."""

    drafted: int
    accepted: int
    emitted: int
    draft_s: float
    verify_s: float
    tree_nodes: int = 0
    source: str = ""


def _total(name: str) -> property:
    """A read-only sum of one :class:`RoundStats` field over ``self.rounds``."""
    return property(lambda self: sum(getattr(r, name) for r in self.rounds))


@dataclass
class SpecStats:
    """Aggregate statistics of a generation, built from its rounds."""

    rounds: list[RoundStats] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)  # [pos] rounds whose draft was accepted past pos
    drafted_at: list[int] = field(default_factory=list)  # [pos] rounds that drafted (a path reaching) pos

    def add(self, r: RoundStats, path_len_drafted: int) -> None:
        """Record a round; ``path_len_drafted`` is the depth of the draft along the path the target took."""
        self.rounds.append(r)
        need = max(path_len_drafted, r.accepted)
        for lst in (self.accepted_at, self.drafted_at):
            lst.extend([0] * (need - len(lst)))
        for pos in range(path_len_drafted):
            self.drafted_at[pos] += 1
        for pos in range(r.accepted):
            self.accepted_at[pos] += 1

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    drafted = _total("drafted")
    accepted = _total("accepted")
    emitted = _total("emitted")
    draft_s = _total("draft_s")
    verify_s = _total("verify_s")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target pass, counting the recovered/bonus token (vLLM's convention)."""
        return self.emitted / self.num_rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """P(draft token at position i accepted | a draft reached position i along the target's path)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]

    @property
    def alpha(self) -> float:
        """Per-token acceptance, the maximum-likelihood α of a geometric acceptance model.

        Each drafted position on the target's path is a trial; trials stop at the first rejection.
        """
        trials = sum(self.drafted_at)
        return sum(self.accepted_at) / trials if trials else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.num_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "mean_accepted_length": self.mean_accepted_length,
            "alpha": self.alpha,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }
