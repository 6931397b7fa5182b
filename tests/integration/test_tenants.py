"""Fair eviction between API keys: one key flooding the server with sessions (by count or by KV bytes)
evicts its own sessions, never a quiet tenant's open session, which still gives its exact output."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import make_prompt, plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
PROMPT = make_prompt(2)


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"})


def _finish(c: httpx.Client, sid: str, base_len: int) -> list[int]:
    tokens: list[int] = []
    while True:
        r = c.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": base_len + len(tokens)})
        assert r.status_code == 200, r.text
        tokens += r.json()["tokens"]
        if r.json()["finished"]:
            return tokens


@pytest.mark.parametrize("limit", ["sessions", "kv_bytes"])
def test_a_flooding_key_evicts_its_own_sessions_only(target, limit):
    cfg = config(api_keys=("quiet", "loud"), max_sessions=4) if limit == "sessions" else \
        config(api_keys=("quiet", "loud"), max_sessions=64, kv_cache_memory=200_000)
    with LoopbackServer(target, cfg) as srv, _client(srv.url, "quiet") as b, _client(srv.url, "loud") as a:
        quiet = b.post("/v1/spec/sessions", json={"prompt_ids": PROMPT, "max_new_tokens": 16}).json()["session_id"]
        loud = []
        for i in range(12):
            r = a.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(10 + i, 60), "max_new_tokens": 4})
            assert r.status_code == 200, r.text
            loud.append(r.json()["session_id"])
        gone = [a.get(f"/v1/spec/sessions/{sid}").json().get("error", {}).get("code") for sid in loud[:4]]
        assert "session_evicted" in gone  # the flood cost the loud key its own oldest sessions
        assert b.get(f"/v1/spec/sessions/{quiet}").status_code == 200
        more = b.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(40, 60), "max_new_tokens": 4})
        assert more.status_code == 200, more.text  # room comes from the loud key, over its share
        assert b.get(f"/v1/spec/sessions/{quiet}").status_code == 200
        assert _finish(b, quiet, len(PROMPT)) == plain_greedy(target, PROMPT, 16)
        assert srv.engine.store.evictions > 0
