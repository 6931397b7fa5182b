"""The KV store at its session cap: an agent's next step still reuses its last step's KV.

An agent's step N + 1 repeats step N's prompt and adds the answer and tool result; the verifier reuses the
closed session of step N as the prefix. When the store is full (``max_sessions``), making room must evict
some other idle session, never that donor: otherwise every step of a busy server prefills from scratch."""

from __future__ import annotations

import asyncio

from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.kv_store import key_owner
from tests.helpers import EOS, make_prompt


def test_the_prefix_donor_survives_eviction_at_the_session_cap(target):
    engine = VerifierEngine(target, ServerConfig(max_sessions=3, api_keys=("agent", "other")))
    store, agent, other = engine.store, key_owner("agent"), key_owner("other")

    def open_closed(owner: str, ids: list[int]):
        session, reused = asyncio.run(engine._create_and_prefill(owner, ids, 8, frozenset({EOS})))
        store.close(session.id, owner)
        return session, reused

    for seed in (1, 2):  # another tenant's closed, stale prefixes
        open_closed(other, make_prompt(seed, 30))
    step1 = make_prompt(3, 40)
    first, _ = open_closed(agent, step1)
    assert store.num_open() == 0 and len(store._sessions) == 3  # at the cap: the next session evicts one
    second, reused = open_closed(agent, step1 + make_prompt(4, 12))
    # all of step 1 but its last token was cached (that one is run again for its logits)
    assert reused == len(step1) - 1, "the agent's previous step was evicted instead of another idle session"
    assert first.id in store._sessions and second.id in store._sessions
    assert sum(s.owner == other for s in store._sessions.values()) == 1
