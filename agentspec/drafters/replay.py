"""Chain drafters replayed over known output: the router's shadow acceptance.

Under greedy decoding a chain drafter's real run takes exactly the replayed path, so the replay's numbers
(:class:`~agentspec.router.estimators.ChainReplay`) are what running it would have cost; the client hands
them to :meth:`agentspec.router.ModePolicy.observe_replays`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from agentspec.drafters.base import DraftContext, Drafter, common_prefix
from agentspec.router.estimators import ChainReplay


def replay_chain(drafter: Drafter | None, tokens: Sequence[int], prompt_len: int, start: int, gamma: int, *,
                 segment: int | None = None, max_new: int | None = None) -> ChainReplay:
    """Replay generating ``tokens[start:]`` after ``tokens[:start]`` with ``drafter`` (None: plain steps).

    Each round drafts ``γ_r = min(γ, max_new − done − 1, segment_left − 1)`` tokens (``max_new``/``segment``
    when given, as the client and server cap them), accepts the longest matching prefix and commits it
    plus one token; a segment ends its last round at its boundary, as server mode does."""
    if not 0 <= prompt_len <= start <= len(tokens):
        raise ValueError(f"need 0 <= prompt_len ({prompt_len}) <= start ({start}) <= len(tokens) ({len(tokens)})")
    out, done, total = ChainReplay(), 0, len(tokens) - start
    left = segment
    while done < total:
        caps = [gamma] + ([max_new - done - 1] if max_new else []) + ([left - 1] if segment else [])
        gamma_r = max(min(caps), 0)
        draft: tuple[int, ...] = ()
        if drafter is not None and gamma_r:
            t0 = time.perf_counter()
            proposal = drafter.propose(DraftContext(list(tokens[:start + done]), prompt_len), gamma_r)
            out.draft_s += time.perf_counter() - t0
            if proposal.is_tree:
                raise ValueError("replay_chain needs a chain drafter (it proposed a tree)")
            draft = tuple(proposal.tokens)
        accepted = 0
        right = tokens[start + done :]  # what the target emits from here
        while accepted < min(len(draft), total - done) and draft[accepted] == right[accepted]:
            accepted += 1
        emitted = min(accepted + 1, total - done, left if segment else total)
        done += emitted
        out.rounds += 1
        out.drafted += len(draft)
        out.fresh += len(draft)
        out.accepted += min(accepted, emitted)
        out.gammas.append(len(draft))
        if segment:
            left -= emitted
            if left == 0 or done == total:
                out.segments, left = out.segments + 1, segment
    out.tokens = total
    return out


def shadow_replays(shadows: Mapping[str, Drafter], tokens: Sequence[int], prompt_len: int, start: int,
                   gamma: int) -> dict[str, ChainReplay]:
    """Each shadow drafter (mode → drafter) replayed over a segment's tokens ``tokens[start:]``: edge
    rounds capped by γ only, server rounds also by the segment's tokens left. Nothing for fewer than two
    tokens (a segment that short says nothing about acceptance)."""
    if len(tokens) - start < 2:
        return {}
    return {mode: replay_chain(drafter, tokens, prompt_len, start, gamma,
                               segment=None if mode == "edge" else len(tokens) - start)
            for mode, drafter in shadows.items()}


def replay_known_next(next_tokens: Sequence[int], tokens: Sequence[int], start: int, gamma: int,
                      ahead: int | None = None, forced: Callable[[int], Sequence[int]] | None = None
                      ) -> ChainReplay:
    """A greedy chain drafter's rounds over ``tokens[start:]`` from its teacher-forced choices, with no
    drafting: ``next_tokens[i]`` is its greedy token after ``tokens[:i + 1]`` (-1: not known). Its chain
    follows the committed text while it matches, so a round accepts the run of positions where its choice is
    the committed token, up to its draft length, and commits one more. Only whole rounds count: the replay
    stops at the first that needs a choice not known, or runs past ``tokens``. ``draft_s`` stays 0.

    Every round drafts ``gamma`` on its critical path (``fresh``), unless ``ahead`` is given: then the
    rounds are pipelined as an edge client's are, and a round whose whole draft was taken and whose guess of
    the target's next token came true hands the next round ``ahead`` tokens drafted in flight (not fresh);
    any other round leaves the next to draft ``gamma`` afresh (0: a plain step, whose guess drafts ahead).

    ``forced``: a tool drafter's grammar (the tokens it forces after ``tokens[:p]``): each round drafts that
    span free ahead of the chain (in ``drafted``, not ``fresh``) and takes it while it matches the committed
    text; the chain's ``gamma`` follow it, taken only after the whole span. Not with ``ahead``: a tool
    drafter's rounds are trees, which are not drafted ahead."""
    if not 1 <= start <= len(tokens):
        raise ValueError(f"need 1 <= start ({start}) <= len(tokens) ({len(tokens)})")
    if gamma < 0 or (ahead is not None and ahead < 0):
        raise ValueError(f"draft lengths are counts of tokens: gamma {gamma}, ahead {ahead}")
    if ahead is not None and forced is not None:
        raise ValueError("forced spans are a tool drafter's, whose trees are not drafted ahead: not with ahead")
    out, p, draft, carried = ChainReplay(), start, gamma, False
    while draft > 0 or ahead is not None or forced is not None:
        span = list(forced(p)) if forced is not None else []
        accepted = common_prefix(span, list(tokens[p : p + len(span)]))
        limit = accepted + draft if accepted == len(span) else accepted  # a span the target left ends the round
        while accepted < limit and p + accepted < len(tokens):
            i = p - 1 + accepted
            if i >= len(next_tokens) or next_tokens[i] < 0:
                return out  # not known: a partial round would overstate the mismatch
            if next_tokens[i] != tokens[p + accepted]:
                break
            accepted += 1
        if p + accepted >= len(tokens):
            return out  # the round goes on past the text in hand
        out.rounds += 1
        out.drafted += len(span) + draft
        out.fresh += 0 if carried else draft
        out.accepted += accepted
        out.tokens += accepted + 1
        out.gammas.append(draft)
        guess = p - 1 + accepted  # the drafter's choice for the target's token this round commits
        if ahead is not None and (guess >= len(next_tokens) or next_tokens[guess] < 0):
            return out  # whether the next round was drafted ahead is not known
        carried = ahead is not None and accepted == draft and next_tokens[guess] == tokens[p + accepted]
        p += accepted + 1
        draft = ahead if carried and ahead is not None else gamma
    return out
