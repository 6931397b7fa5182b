"""Failover remembers: a verifier that failed is skipped (no failed connect per request) until its backoff
ends, then re-admitted; after a restart it serves again, and outputs stay identical to plain greedy."""

from __future__ import annotations

import pytest

from agentspec.client import SpecClient
from agentspec.client.health import VerifierHealth
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
ASK = [{"role": "user", "content": "count with me"}]


def test_a_dead_verifier_is_skipped_then_readmitted_after_a_restart(target):
    with LoopbackServer(target, config()) as b:
        a = LoopbackServer(target, config())
        a.__enter__()
        port = int(a.url.rsplit(":", 1)[1])
        client = SpecClient([a.url, b.url], mode="server-ar", retries=0)
        client.health = VerifierHealth(2, base_s=30.0)
        ref = client.generate(ASK, max_tokens=12)
        assert not ref.stats.fallbacks
        a.__exit__(None, None, None)  # A dies
        moved = client.generate(ASK, max_tokens=12)
        assert moved.tokens == ref.tokens and len(moved.stats.fallbacks) == 1  # failed over once, to B
        skipped = client.generate(ASK, max_tokens=12)
        assert skipped.tokens == ref.tokens and not skipped.stats.fallbacks  # A not even tried meanwhile
        with LoopbackServer(target, config(), port=port) as a2:  # A comes back on its address
            client.health = VerifierHealth(2, base_s=0.0)  # (its backoff is over)
            client.health.failed(0)
            back = client.generate(ASK, max_tokens=12)
            assert back.tokens == ref.tokens and not back.stats.fallbacks
            assert len(a2.engine.store._sessions) == 1  # it ran on the restarted A, the first in order


def test_failover_wraps_around_to_a_recovered_verifier():
    h = VerifierHealth(3, base_s=0.0)
    h.failed(0)
    assert h.after(2) == 0  # backwards: the first one recovered (its backoff is 0 here)
    h2 = VerifierHealth(3, base_s=10.0, max_s=30.0)
    h2.failed(0)
    h2.failed(1)
    assert h2.first() == 2 and h2.after(2) is None
    h2.failed(0)  # a second failure in a row doubles the backoff, up to max_s
    h2.failed(0)
    assert [h2._down[i][1] for i in (0, 1)] == [30.0, 10.0] and h2.soonest() == 2
    h2.ok(0)
    assert h2.first() == 0
