"""The router's shadows: what the modes auto did not run would have done over the text it just committed.

After each auto segment (:func:`shadow_segment`): the router's shadowed modes (chain drafters it judges by
replays alone) replayed over the segment's tokens; and, over greedy prose another mode committed, the
rounds of the probed modes that draft it with a chain the client can run: edge's local model drafter (from
the greedy choices its catch-up noted) and the server's copy drafts. Their (E[A], γ̄) then follow the text
in hand instead of resting on the last probe, or on a warm-up call's prose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agentspec.client.events import SegmentStats
from agentspec.client.run import Run
from agentspec.drafters import make_drafter
from agentspec.drafters.base import DraftContext, Drafter, known_next
from agentspec.drafters.copy import CopyDrafter, SuffixIndex
from agentspec.drafters.replay import replay_chain, replay_known_next, shadow_replays
from agentspec.router import ModePolicy


def shadow_drafters(drafter: Any, server_drafter: str, index: SuffixIndex | None
                    ) -> tuple[dict[str, Drafter], Drafter | None]:
    """A client's shadows: the chain drafters of the modes the router judges by replays alone (edge's own
    shadow, where ``drafter`` has one and no tool tree wraps it, ``index`` None; the verifier's n-gram
    drafter for ``server_drafter="ngram"``), and, for the verifier's default, a chain of the copy drafts it
    makes in prose, over ``index`` (the past answers the client remembers, as the verifier does per key)."""
    shadow = getattr(drafter, "shadow", None)
    edge = shadow() if shadow is not None and index is None else None
    shadows: dict[str, Drafter] = {} if edge is None else {"edge": edge}
    if server_drafter == "ngram":
        shadows["server"] = make_drafter("ngram")
    return shadows, CopyDrafter(index=index) if server_drafter == "default" else None


def shadow_segment(run: Run, seg: SegmentStats, policy: ModePolicy, shadows: Mapping[str, Drafter] | None = None,
                   server_copy: Drafter | None = None, pipelined: bool = True) -> None:
    """After an auto segment ``seg`` of ``run``: ``shadows`` (mode → chain drafter) replayed over its tokens
    for the modes in ``policy.config.shadowed``; then, where it ran in another mode, edge's rounds over the
    text committed since edge's last replay (as far as the drafter's catch-up knows its choices) and the
    server's over the segment (``server_copy``: a chain of the copy drafts the verifier makes in prose, None
    when the server drafts otherwise). Greedy only (a sampled answer is not the greedy path a replay
    follows), and a mode's own segments speak for themselves. Kinds are kept apart: prose before any call
    counts as text; a segment that starts and ends inside a call's JSON counts for edge as tool, its own
    tokens only, with the spans its tool drafter's grammar forces ahead of the model's chain (a lower bound
    still: its copies and sibling leaves add); a segment that crosses from one into the other counts for
    neither, as a call opens in text. Edge's critical-path drafting is replayed too, inside JSON where a
    grammar drafts the spans, and over prose as its rounds would draft now (``pipelined``: drafting each
    round's successor while it is in flight, as the client does): the γ and the tokens ahead its draft length
    policy picks."""
    config = policy.config
    start = len(run.tokens) - seg.tokens
    policy.observe_replays(shadow_replays({m: d for m, d in (shadows or {}).items() if m in config.shadowed},
                                          run.tokens, len(run.prompt), start, config.gamma_max), kind=seg.kind)
    greedy = run.sampling.greedy
    prose = greedy and seg.kind == "text" and not run.calls and run.kind == "text"
    if (prose and seg.mode != "server" and server_copy is not None and "server" not in config.shadowed
            and seg.tokens >= 2):
        # server segments are capped as whole segments are: at the end of a segment's tokens
        replay = replay_chain(server_copy, run.tokens, len(run.prompt), start, config.gamma_max,
                              segment=config.segment_tokens)
        if replay.rounds:
            policy.observe_shadow("server", replay, kind=seg.kind)
    inside_json = greedy and seg.kind == "tool" and run.kind == "tool"
    if seg.mode == "edge" or not (prose or inside_json) or "edge" in config.shadowed:
        run.shadowed_to = len(run.tokens)
        return
    start = max(run.shadowed_to, len(run.prompt) if prose else start, 1)
    if start >= len(run.tokens):
        return
    choices, forced = known_next(run.drafter, run.tokens), None if prose else grammar_spans(run)
    replay = replay_known_next(choices, run.tokens, start, config.gamma_max, forced=forced)
    if replay.rounds:
        run.shadowed_to = start + replay.tokens
        # a call's JSON is drafted by a tree whose grammar spans cost no drafting: the model chain's alone
        # would overstate it, so it is replayed only with them
        shape = policy.edge.pipeline_shape(config.gamma_max, seg.kind, pipelined) if prose else None
        drafting = replay_known_next(choices, run.tokens, start, *shape) if shape is not None else (
            replay if forced is not None else None)
        policy.observe_shadow("edge", replay, kind=seg.kind, drafting=drafting)


def grammar_spans(run: Run) -> Callable[[int], list[int]] | None:
    """The spans the grammar of ``run``'s tool drafter forces after ``run.tokens[:p]``, as its rounds draft
    them (at most ``max_forced``), for edge's shadow inside a call (None: the drafter has no grammar).
    The grammar follows any tokens it is given: the next round's draft re-follows the committed ones."""
    grammar, most = getattr(run.drafter, "grammar", None), getattr(run.drafter, "max_forced", None)
    if grammar is None:
        return None

    def spans(p: int) -> list[int]:
        ctx = DraftContext(run.tokens[:p], len(run.prompt), run.sampling, tools=run.tools,
                           tool_choice=run.tool_choice, response_format=run.response_format)
        return grammar.forced(ctx)[:most]
    return spans
