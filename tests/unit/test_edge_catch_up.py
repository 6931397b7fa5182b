"""The client's catch-up of its local model drafter while a request is in flight (a session open, a server
segment's next line): in chunks that stop once the reply is in, each sized to about a server round, so what
follows a reply never waits for a long prefill; the rest follows during later requests."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from agentspec.client.edge import CATCHUP_CHUNK, EdgeDrafting
from agentspec.client.ops import Call, Pools, WhileDrafting
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import CATCHUP_MIN, DraftContext
from tests.helpers import VOCAB, make_prompt


def _after(calls: int):
    """An ``arrived`` that turns true on its ``calls + 1``-th question."""
    asked = []

    def arrived() -> bool:
        asked.append(1)
        return len(asked) > calls
    return arrived


def test_catch_up_stops_when_the_reply_arrives_and_resumes_later(target):
    tokens = [t for s in range(8) for t in make_prompt(s)]  # 320 tokens
    edge = EdgeDrafting(4, None, None, preview=False)
    drafter = ModelDrafter(target)
    edge.catch_up(drafter, tokens, None, _after(2))  # no round measured yet: the shortest chunks, two of them
    assert drafter.catchup_tokens(tokens) == len(tokens) - 2 * CATCHUP_MIN
    edge.catch_up(drafter, tokens, None, _after(0))  # the reply was already in: nothing
    assert drafter.catchup_tokens(tokens) == len(tokens) - 2 * CATCHUP_MIN
    edge.catch_up(drafter, tokens, 60.0, _after(10**6))  # a reply far off: the rest, in longer chunks
    assert drafter.catchup_tokens(tokens) == 0 and drafter.take_catchup() == (0, 0.0)
    assert max(edge.chunk_s) > CATCHUP_MIN
    cold = ModelDrafter(target)  # drafts as a drafter that never caught up
    ctx = DraftContext(tokens, len(tokens))
    assert drafter.propose(ctx, 6).tokens == cold.propose(ctx, 6).tokens


def test_catch_up_with_nothing_behind_does_nothing(target):
    tokens = make_prompt(0, length=8)  # shorter than a prefill worth making off the critical path
    drafter = ModelDrafter(target)
    EdgeDrafting(4, None, None, preview=False).catch_up(drafter, tokens, 60.0, _after(10**6))
    assert drafter.catchup_tokens(tokens) == 0 and drafter._cached == []


@pytest.mark.parametrize(("measured", "chunk_s", "tokens"), [
    ({}, 0.5, CATCHUP_MIN),  # nothing measured: the shortest
    ({CATCHUP_MIN: 0.1}, None, CATCHUP_MIN),  # no round measured
    ({CATCHUP_MIN: 0.3}, 0.25, 0),  # even the shortest outlasts a round: no catch-up
    ({}, 0.0, 0),  # the segment's last round: no time to catch up in
    ({CATCHUP_MIN: 0.1}, 0.25, 2 * CATCHUP_MIN),  # twice the shortest is bounded by 0.2: tried
    ({CATCHUP_MIN: 0.1, 2 * CATCHUP_MIN: 0.15}, 0.25, 2 * CATCHUP_MIN),  # the next bound, 0.3, does not fit
    ({CATCHUP_MIN: 0.1, 2 * CATCHUP_MIN: 0.12, 4 * CATCHUP_MIN: 0.2}, 0.25, 4 * CATCHUP_MIN),
    ({CATCHUP_MIN: 0.01, 32: 0.01, 64: 0.01, 128: 0.01}, 60.0, CATCHUP_CHUNK),  # never beyond the longest
    # a cold first chunk (1.8 s) measured once: the longer chunks measured since bound it
    ({CATCHUP_MIN: 1.846, 32: 0.113, 64: 0.145, 128: 0.294}, 0.3, CATCHUP_CHUNK),
    ({CATCHUP_MIN: 1.846, 32: 0.113, 64: 0.145, 128: 0.294}, 0.2, 4 * CATCHUP_MIN),
    ({CATCHUP_MIN: 1.846, 32: 0.113}, 0.1, 0),
    ({2 * CATCHUP_MIN: 0.1}, 0.3, 4 * CATCHUP_MIN),  # only a longer size measured: it bounds the shorter
])
def test_chunks_grow_only_as_far_as_measured_times_allow(measured, chunk_s, tokens):
    edge = EdgeDrafting(4, None, None, preview=False)
    edge.chunk_s = dict(measured)
    assert edge._chunk_tokens(chunk_s) == tokens


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_while_drafting_until_reply_tells_the_draft_when_the_reply_is_in(use_async):
    """The drafting side of ``WhileDrafting(until_reply=True)`` gets a callable that turns true once the
    request's reply is in, on the drafting thread too (sync: the caller's; async: the drafting pool's)."""
    def slow_reply():
        time.sleep(0.1)
        return "reply"

    def draft(tag: str, arrived) -> tuple[str, int, bool]:
        polls = 0
        while not arrived() and polls < 10_000:
            polls += 1
            time.sleep(0.001)
        return tag, polls, arrived()

    op = WhileDrafting(Call(slow_reply, slow_reply), Call(draft, None, ("d",)), until_reply=True)
    pools = Pools()
    try:
        reply, (tag, polls, arrived) = asyncio.run(op.arun(pools)) if use_async else op.run(pools)
    finally:
        for pool in pools.values():
            pool.shutdown()
    assert reply == "reply" and tag == "d" and arrived
    assert 10 <= polls < 10_000  # it waited for the reply, and saw it come


def test_a_new_call_counts_as_behind_until_its_prompt_is_known(target):
    """Before its session opens a call's prompt is unknown to the client, and its new messages are new to a
    model drafter: the router is told it is CATCHUP_MIN behind (so an edge probe waits a segment); once the
    prompt is known, what the drafter really lacks; a drafter without a cache is never behind."""
    from agentspec.client.run import Run
    from agentspec.drafters import NgramDrafter
    from agentspec.types import SamplingParams

    edge = EdgeDrafting(4, None, None, preview=False)
    tokens = [t for s in range(2) for t in make_prompt(s)]
    for drafter, before in ((ModelDrafter(target), CATCHUP_MIN), (NgramDrafter(), 0)):
        run = Run([{"role": "user", "content": "x"}], None, 16, SamplingParams(), (), "auto", drafter)
        assert edge.behind(run) == before
        run.prompt, run.tokens = list(tokens), list(tokens)
        assert edge.behind(run) == (len(tokens) if before else 0)


def test_the_drafter_prefills_the_prompt_it_expects_while_the_session_opens(target):
    """While a session opens the server prefills the call's prompt; the client's drafter prefills the prompt
    the client renders from the same messages (in edge mode too, where the client would only wait). A
    prompt it cannot render falls back to the last session's; a known prompt is used as it is."""
    from agentspec.client.run import Run
    from agentspec.toolcalls import render_chat
    from agentspec.types import SamplingParams

    messages = [{"role": "user", "content": "what is the weather in Lisbon and in Oslo today?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    told: list[tuple[int, float]] = []
    edge = EdgeDrafting(4, None, target.tokenizer, preview=False, observe_catchup=lambda n, s: told.append((n, s)))
    edge.last_prompt = [5, 6, 7]
    runs = {mode: Run(messages, tools, 16, SamplingParams(), (), mode, ModelDrafter(target))
            for mode in ("edge", "auto", "server")}
    assert edge.expected_prompt(runs["edge"]) == render_chat(target.tokenizer, messages, tools)
    assert edge.catches_up(runs["edge"], opening=True) and not edge.catches_up(runs["edge"])
    assert edge.catches_up(runs["auto"], opening=True) and edge.catches_up(runs["auto"])
    assert not edge.catches_up(runs["server"], opening=True)
    assert not EdgeDrafting(4, False, target.tokenizer, preview=False).catches_up(runs["edge"], opening=True)
    refusing = copy.deepcopy(target.tokenizer)
    refusing.chat_template = "{{ raise_exception('this template renders nothing') }}"
    fallback = EdgeDrafting(4, None, refusing, preview=False)
    fallback.last_prompt = [5, 6, 7]
    assert fallback.expected_prompt(runs["edge"]) == [5, 6, 7]
    assert EdgeDrafting(4, None, None, preview=False).expected_prompt(runs["edge"]) == []  # no tokenizer
    runs["edge"].prompt = runs["edge"].tokens = [9, 9, 9, 4]
    assert edge.expected_prompt(runs["edge"]) == [9, 9, 9, 4]

    drafter, opened = runs["edge"].drafter, []
    runs["edge"].prompt = runs["edge"].tokens = []
    expected = edge.expected_prompt(runs["edge"])
    steps = edge.in_flight(runs["edge"], Call(lambda: opened.append(1) or "reply", None, ()), expected,
                           opening=True, edge_next=True)
    item = next(steps)  # the open goes out with the drafter's prefill beside it
    assert isinstance(item, WhileDrafting) and item.until_reply
    spent = item.draft.fn(*item.draft.args, lambda: False)  # a slow server: the whole prompt is prefilled
    assert spent > 0 and drafter.catchup_tokens(expected) == 0
    # an edge segment follows (its first draft would catch up anyway): chunks grow, unbounded by a round
    assert len(expected) > 3 * CATCHUP_MIN and max(n for n, _ in told) > CATCHUP_MIN
    auto = copy.deepcopy(edge)  # its chunk times measured; no round measured: a server segment's chunks stay short
    steps = auto.in_flight(runs["auto"], Call(lambda: "reply", None, ()), expected, opening=True, edge_next=False)
    assert next(steps).draft.args[2] is None and auto._chunk_tokens(None) == CATCHUP_MIN
    # each chunk teaches the router the prefill's rate: all but the last token, as the drafter feeds it later
    assert sum(n for n, _ in told) == len(expected) - 1 and all(s > 0 for _, s in told)
    with pytest.raises(StopIteration) as done:
        steps.send(("reply", spent))
    assert done.value.value == "reply"


def _round_in_flight(target, tokens: list[int]):
    """A 2-token round's draft after ``tokens`` by a fresh model drafter, and the run and segment it is in."""
    from agentspec.client.events import SegmentStats
    from agentspec.client.run import Run
    from agentspec.types import DraftProposal, SamplingParams

    drafter = ModelDrafter(target)  # the round's draft is its own: it has read the prompt
    prop = DraftProposal(tokens=tuple(drafter.propose(DraftContext(tokens, len(tokens)), 2).tokens))
    run = Run([{"role": "user", "content": "x"}], None, 64, SamplingParams(), (), "edge", drafter)
    run.prompt, run.tokens = list(tokens), list(tokens)
    return prop, run, SegmentStats("edge", 0, 0, 0, 0, 0.0, 0.0, 0.0, {}, "text")


def test_a_draft_ahead_stops_when_its_rounds_reply_is_in(target):
    """Drafting the next round while one is in flight ends once the reply is in (after the step under way):
    drafting on would delay the next request. A draft cut short is the same draft's prefix; one with only the
    guess (no token after it) is not kept."""
    tokens = make_prompt(0)
    aheads = {}
    for polls in (0, 3, 10**6):  # the reply: in before the first question, after three, never
        prop, run, seg = _round_in_flight(target, tokens)
        EdgeDrafting(6, True, None, preview=False).draft_ahead(run, seg, prop, None, _after(polls))
        aheads[polls] = run.ahead
    assert aheads[0] is None  # the guess alone: nothing to draft with
    full = aheads[10**6]
    assert full[0] == (*tokens, *prop.tokens, full[0][-1]) and len(full[1]) == 6  # the guess, then 6 drafts
    assert aheads[3][0] == full[0] and aheads[3][1].tokens == full[1].tokens[:3]


def test_a_rounds_own_expected_flight_stops_its_draft_ahead(target):
    """The deadline a draft ahead stops before is the round's own expected flight when the caller has one
    (the edge cost line at the pass's size): a plain step's round is shorter than the mean round, and a
    deadline at the mean had its draft ahead overrun the reply by half a drafting step on average."""
    tokens = make_prompt(2)
    aheads = {}
    for flight in (None, 1e-9):
        prop, run, seg = _round_in_flight(target, tokens)
        edge = EdgeDrafting(6, True, None, preview=False)
        edge.landed(60.0)  # the mean round: a minute
        edge.draft_ahead(run, seg, prop, flight, _after(10**6))
        aheads[flight] = run.ahead
    assert len(aheads[None][1]) == 6  # by the mean, a minute left: the guess and 6 drafts
    assert aheads[1e-9] is None  # this round's reply is due: the guess, then no step that would outlast it


def test_a_draft_ahead_cut_short_is_drafted_on_to_the_rounds_length(target):
    """A draft ahead that stopped at the reply is a head start: when its hypothesis holds, the next round
    drafts on from it up to γ, and sends what a fresh draft of γ would have been."""
    from agentspec.router import ModePolicy

    tokens = make_prompt(1)
    prop, run, seg = _round_in_flight(target, tokens)
    edge = EdgeDrafting(6, True, None, preview=False)
    edge.draft_ahead(run, seg, prop, None, _after(1))  # the guess and one draft
    assert len(run.ahead[1]) == 1
    run.tokens = list(run.ahead[0])  # the hypothesis held
    sent = edge.round(run, seg, ModePolicy()).prop  # nothing measured: γ = 6
    fresh = ModelDrafter(target).propose(DraftContext(run.tokens, len(tokens)), 6)
    assert seg.pipelined == 1 and sent.tokens == fresh.tokens and len(sent) == 6
    assert seg.entry_s is None  # its first round had a draft made ahead


class _SlowSetUp(ModelDrafter):
    """A model drafter whose per-request set-up (as a grammar's compilation) takes ``setup_s``."""

    setup_s = 0.3

    def prepare(self, ctx: DraftContext) -> None:
        time.sleep(self.setup_s)


def test_a_drafters_set_up_is_not_counted_as_drafting(target):
    from agentspec.client.run import Run
    from agentspec.types import SamplingParams

    run = Run([{"role": "user", "content": "hi"}], None, 32, SamplingParams(), [], "edge", _SlowSetUp(target))
    run.prompt = run.tokens = make_prompt(0, length=8)
    edge = EdgeDrafting(4, None, None, preview=False)
    t0 = time.perf_counter()
    prop, draft_s, _ = edge._propose(run, 4)
    assert len(prop) == 4 and time.perf_counter() - t0 >= _SlowSetUp.setup_s
    assert draft_s < _SlowSetUp.setup_s and edge.round_draft_s == draft_s


def test_a_round_that_drafts_nothing_still_drafts_the_next_one_ahead(target):
    """At γ = 0 (the policy judged drafting not to pay) the drafter drafts ahead while the round is in flight:
    the next round uses that draft, at no drafting cost, when its guess was the target's token; when it was
    not, the next round drafts as it would have anyway. A drafter still behind (a new prompt) catches up
    first, in chunks that stop at the reply; not where the next round could draft nothing."""
    from agentspec.client.events import SegmentStats
    from agentspec.client.run import Run
    from agentspec.router import ModePolicy
    from agentspec.types import DraftProposal, SamplingParams

    tokens = make_prompt(2)
    edge = EdgeDrafting(4, True, None, preview=False)
    for came_true in (True, False):
        run = Run([{"role": "user", "content": "x"}], None, 64, SamplingParams(), (), "edge", ModelDrafter(target))
        run.prompt, run.tokens = list(tokens), list(tokens)
        seg = SegmentStats("edge", 0, 0, 0, 0, 0.0, 0.0, 0.0, {}, "text")
        nothing = DraftProposal()
        assert run.drafter.catchup_tokens(tokens) and edge.pipelines(run, nothing)  # a new prompt: behind
        edge.draft_ahead(run, seg, nothing, None, _after(1))  # the reply came during the catch-up's first chunk
        assert run.ahead is None and 0 < run.drafter.catchup_tokens(tokens) < len(tokens)
        edge.draft_ahead(run, seg, nothing, None, _after(10**6))  # caught up in flight, then drafted ahead
        guess = run.ahead[0][-1]
        assert run.ahead[0] == (*tokens, guess) and len(run.ahead[1]) == 4
        run.tokens = [*tokens, guess if came_true else (guess + 1) % VOCAB]  # the round's one token
        _, draft_s, _, _, sent = edge.round(run, seg, ModePolicy())
        fresh = ModelDrafter(target).propose(DraftContext(run.tokens, len(tokens)), 4)
        assert sent.tokens == fresh.tokens
        assert seg.pipelined == int(came_true) and (draft_s == 0.0) is came_true
    assert not EdgeDrafting(4, False, None, preview=False).pipelines(run, nothing)  # pipelining off: never
    run.drafter.catch_up(run.tokens)
    assert edge.pipelines(run, nothing)
    run.max_tokens = run.generated + 2  # the round's token, then one more: the next round can draft nothing
    assert not edge.pipelines(run, nothing)


def test_the_expected_prompt_takes_the_servers_tokens_where_the_templates_differ():
    """The client renders with the drafter's chat template, the server with the target's; Qwen2.5-Coder
    0.5B's and 1.5B's differ by two characters in the system turn's tool instructions. The drafter's guess
    at the next prompt takes the last session's tokens (the server's rendering) through what both share, and
    the client's rendering after (the new messages): the catch-up prefills what the server will send."""
    from agentspec.client.edge import resync

    shared, tools, new = list(range(1, 11)), list(range(20, 30)), list(range(30, 40))
    last = [*shared, 50, 51, *tools]  # the server's rendering of the last call's prompt
    render = [*shared, 60, *tools, *new]  # the client's rendering of this call's messages
    assert resync(render, last) == [*last, *new]
    assert resync(render, []) == render  # no earlier session
    assert resync([*shared, 70, 71], last) == [*shared, 70, 71]  # nothing shared after the parting
    assert resync([*last, *new], last) == [*last, *new]  # the same template: nothing to change
