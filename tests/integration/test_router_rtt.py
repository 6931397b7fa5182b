"""The router on injected network delay (a delaying TCP proxy on loopback; tc netem is not available here):
edge drafting wins at no delay, server-side modes at a long round trip — and the output never changes."""

from __future__ import annotations

import pytest

from agentspec.client import SpecClient
from agentspec.drafters.base import DraftContext
from agentspec.types import DraftProposal
from benchmarks.delay_proxy import DelayProxy
from tests.helpers import plain_greedy, tiny_model
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "route me"}]
MAX = 48


class OracleDrafter:
    """A free, always-right drafter (it knows the reference): the cleanest case for edge drafting."""

    name = "oracle"

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def reset(self) -> None:
        pass

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        done = len(ctx.tokens) - ctx.num_prompt_tokens
        return DraftProposal(tokens=tuple(self.reference[done : done + k]), source=self.name)


@pytest.fixture(scope="module")
def slow_target():
    """Big enough that a target pass costs more than a loopback HTTP round trip."""
    return tiny_model(seed=11, layers=6, hidden=256)


@pytest.fixture(scope="module")
def setup(slow_target):
    prompt = slow_target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    reference = plain_greedy(slow_target, list(prompt), MAX)
    # No server-side drafter (server mode decodes plainly): with an always-right edge drafter the two sides are
    # then far apart at both ends, so the router's choice is unambiguous on a loaded 2-core machine too.
    with LoopbackServer(slow_target, config(default_num_draft_tokens=0)) as srv:
        yield srv, reference


def _modes(client: SpecClient, requests: int, reference: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(requests):
        final = client.generate(MESSAGES, max_tokens=MAX)
        assert final.tokens == reference  # lossless whatever the route
        for seg in final.stats.segments:
            counts[seg.mode] = counts.get(seg.mode, 0) + 1
    return counts


def test_edge_at_no_delay_server_at_long_rtt(setup):
    srv, reference = setup
    port = int(srv.url.rsplit(":", 1)[1])
    for one_way, expect_edge in ((0.0, True), (0.1, False)):
        with DelayProxy("127.0.0.1", port, one_way_delay_s=one_way) as proxy:
            client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=OracleDrafter(reference), mode="auto",
                                segment_tokens=24, num_draft_tokens=4)
            _modes(client, 2, reference)  # every mode gets measured
            counts = _modes(client, 3, reference)
            client.close()
        edge_share = counts.get("edge", 0) / sum(counts.values())
        assert (edge_share > 0.5) == expect_edge, (one_way, counts, client.policy.seconds_per_token)


def test_delay_proxy_adds_the_round_trip(setup):
    import time

    import httpx

    srv, _ = setup
    port = int(srv.url.rsplit(":", 1)[1])
    with DelayProxy("127.0.0.1", port, one_way_delay_s=0.05) as proxy, \
            httpx.Client(base_url=f"http://127.0.0.1:{proxy.port}") as c:
        c.get("/health")
        t0 = time.perf_counter()
        assert c.get("/health").status_code == 200
        assert 0.1 <= time.perf_counter() - t0 < 0.5


def test_a_session_opens_rendering_and_grammar_are_server_time_not_the_links(setup):
    """The router takes the round trip from session opens too (their wall time less the server's): the server's
    time must hold all it did for the open (the chat template with tools, a ``tool_choice`` grammar, the
    prefill), or a first open's grammar build reads as a slow link and the faster opens after it as none."""
    import httpx

    srv, _ = setup
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}}]
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        reply = c.post("/v1/spec/sessions", json={"messages": MESSAGES, "tools": tools, "tool_choice": "required",
                                                  "max_new_tokens": 8})
    info = reply.json()
    assert reply.status_code == 200 and info["constrained"], info
    assert info["server_ms"] > info["prefill_ms"] > 0
