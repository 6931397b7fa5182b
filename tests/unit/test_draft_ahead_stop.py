"""A draft made ahead stops before a step that would end after the round's reply is expected.

The clock is a fake one the test moves, so the rule is checked exactly, not by timing sleeps.
"""

from __future__ import annotations

import pytest

from agentspec.client import edge as edge_module
from agentspec.client.edge import EdgeDrafting


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(edge_module.time, "perf_counter", fake.perf_counter)
    return fake


@pytest.mark.parametrize("flight_s", [None, 10.0])
def test_the_reply_stops_it_and_nothing_else_before_the_deadline(clock: _Clock, flight_s: float | None) -> None:
    """Without a measured flight only the reply stops it; with one far off, the reply still does."""
    edge = EdgeDrafting(6, True, None, False)
    arrived = [False]
    stop = edge._before_reply(lambda: arrived[0], flight_s)
    clock.now += 0.05
    assert not stop()
    arrived[0] = True
    assert stop()


def test_a_step_that_would_outlast_the_expected_reply_is_not_started(clock: _Clock) -> None:
    edge = EdgeDrafting(6, True, None, False)
    stop = edge._before_reply(lambda: False, 0.30)
    steps = 0
    while not stop():
        clock.now += 0.08  # a drafting step
        steps += 1
        assert steps < 10
    assert steps == 3  # at 0.24 s a fourth step would end at 0.32 s, after the reply (0.30 s)


def test_the_expected_flight_follows_measured_rounds() -> None:
    edge = EdgeDrafting(6, True, None, False)
    edge.landed(0.30)
    for _ in range(30):
        edge.landed(0.40)
    assert edge.flight_s == pytest.approx(0.40, abs=1e-3)
