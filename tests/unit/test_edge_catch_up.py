"""The client's catch-up of its local model drafter while a server segment streams: in chunks, within the
segment's expected time, so the segment's end never waits for a long prefill; the rest follows later."""

from __future__ import annotations

from agentspec.client.edge import CATCHUP_CHUNK, EdgeDrafting
from agentspec.client.run import Run
from agentspec.drafters import ModelDrafter
from agentspec.drafters.base import DraftContext
from agentspec.types import SamplingParams
from tests.helpers import make_prompt


def _run(drafter: ModelDrafter, tokens: list[int]) -> Run:
    run = Run([{"role": "user", "content": "x"}], None, 16, SamplingParams(), (), "auto", drafter)
    run.tokens = list(tokens)
    return run


def test_catch_up_stops_at_the_segments_budget_and_resumes_later(target):
    tokens = [t for s in range(8) for t in make_prompt(s)]  # 320 tokens: three chunks
    assert len(tokens) > 2 * CATCHUP_CHUNK + 1
    edge = EdgeDrafting(4, None, None, preview=False)
    drafter = ModelDrafter(target)
    run = _run(drafter, tokens)
    edge.catch_up(run, 0.0)  # no time to spare (or none measured yet): one chunk
    assert drafter.catchup_tokens(tokens) == len(tokens) - CATCHUP_CHUNK
    edge.catch_up(run, None)
    assert drafter.catchup_tokens(tokens) == len(tokens) - 2 * CATCHUP_CHUNK
    edge.catch_up(run, 60.0)  # time enough: the rest
    assert drafter.catchup_tokens(tokens) == 0 and drafter.take_catchup() == (0, 0.0)
    cold = ModelDrafter(target)  # drafts as a drafter that never caught up
    ctx = DraftContext(tokens, len(tokens))
    assert drafter.propose(ctx, 6).tokens == cold.propose(ctx, 6).tokens


def test_catch_up_with_nothing_behind_does_nothing(target):
    tokens = make_prompt(0, length=8)  # shorter than a prefill worth making off the critical path
    drafter = ModelDrafter(target)
    EdgeDrafting(4, None, None, preview=False).catch_up(_run(drafter, tokens), 60.0)
    assert drafter.catchup_tokens(tokens) == 0 and drafter._cached == []
