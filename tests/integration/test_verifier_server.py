"""agentspec-verifier over real HTTP on loopback, with tiny models: losslessness, batching, auth, limits."""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from agentspec.drafters import ModelDrafter, NgramDrafter
from tests.helpers import make_prompt, plain_greedy
from tests.integration.server import LoopbackServer, config, edge_generate

pytestmark = pytest.mark.integration
MAX_NEW = 32


@pytest.fixture(scope="module")
def server(target):
    with LoopbackServer(target, config(batch_window_s=0.005)) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def references(target):
    return {s: plain_greedy(target, make_prompt(s), MAX_NEW) for s in range(4)}


def test_health_and_metrics(client):
    assert client.get("/health").json()["status"] == "ok"
    r = client.get("/metrics")
    assert r.status_code == 200 and "agentspec:spec_decode_num_drafts" in r.text
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


@pytest.mark.parametrize("kind", ["none", "self", "wrong", "ngram", "tree"])
def test_edge_rounds_equal_plain_greedy(client, target, wrong_drafter_model, references, kind):
    drafter = {"none": None, "self": ModelDrafter(target), "wrong": ModelDrafter(wrong_drafter_model),
               "ngram": NgramDrafter(max_ngram=3), "tree": ModelDrafter(wrong_drafter_model, tree_width=3)}[kind]
    out = edge_generate(client, make_prompt(0), drafter, k=4, max_new=MAX_NEW)
    assert out.tokens == references[0]
    assert out.finish_reason == "length"
    if kind == "self":
        assert all(r["accepted"] == r["drafted"] for r in out.rounds[:-1])


@pytest.mark.parametrize("mode", ["server", "server-ar"])
def test_server_modes_equal_plain_greedy(client, references, mode):
    prompt = make_prompt(1)
    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt}).json()["session_id"]
    with client.stream("POST", f"/v1/spec/sessions/{sid}/generate",
                       json={"base_len": len(prompt), "mode": mode, "max_new_tokens": MAX_NEW}) as r:
        assert r.status_code == 200
        import json
        replies = [json.loads(line) for line in r.iter_lines() if line]
    tokens = [t for rep in replies for t in rep["tokens"]]
    assert tokens == references[1]
    assert replies[-1]["finished"] and replies[-1]["finish_reason"] == "length"
    if mode == "server-ar":
        assert all(rep["drafted"] == 0 for rep in replies)


@pytest.mark.parametrize("mode", ["server", "server-ar"])
def test_a_round_budget_ends_the_request_and_the_next_goes_on_losslessly(client, references, mode):
    """``max_rounds`` ends a generate request after that many rounds (a router's probe), as its token limit
    would: finished, the session open; the next request continues from the committed tokens, and the whole
    is plain greedy's."""
    import json

    prompt = make_prompt(1)
    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt}).json()["session_id"]
    tokens: list[int] = []
    budgets = []
    while len(tokens) < MAX_NEW:
        body = {"base_len": len(prompt) + len(tokens), "mode": mode, "max_new_tokens": MAX_NEW - len(tokens),
                "max_rounds": 2}
        with client.stream("POST", f"/v1/spec/sessions/{sid}/generate", json=body) as r:
            assert r.status_code == 200
            replies = [json.loads(line) for line in r.iter_lines() if line]
        assert len(replies) <= 2 and replies[-1]["finished"] and replies[-1]["finish_reason"] == "length"
        assert not any(rep["session_finished"] for rep in replies)  # the session's own limit is far off
        budgets.append(len(replies))
        tokens += [t for rep in replies for t in rep["tokens"]]
    assert tokens == references[1]
    assert budgets.count(2) >= len(budgets) - 1  # every request but the last ran out of rounds, not tokens


def _server_mode(client: httpx.Client, prompt: list[int], **extra) -> httpx.Response | list[dict]:
    import json

    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt}).json()["session_id"]
    body = {"base_len": len(prompt), "mode": "server", "max_new_tokens": MAX_NEW, **extra}
    with client.stream("POST", f"/v1/spec/sessions/{sid}/generate", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r
        return [json.loads(line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("drafter", ["default", "model", "ngram"])
def test_server_mode_drafter_choice_is_lossless(target, wrong_drafter_model, references, drafter):
    """A server with --draft-model: the combined drafter and the model alone both give plain greedy."""
    with LoopbackServer(target, config(), draft_model=wrong_drafter_model) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        replies = _server_mode(c, make_prompt(1), drafter=drafter, num_draft_tokens=3)
    assert [t for rep in replies for t in rep["tokens"]] == references[1]
    assert sum(rep["drafted"] for rep in replies) > 0


def test_model_drafter_without_draft_model_is_a_clear_400(client):
    r = _server_mode(client, make_prompt(1), drafter="model")
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "drafter" and "--draft-model" in err["message"]
    assert _server_mode(client, make_prompt(1), drafter="mystery").status_code == 400


def test_concurrent_clients_match_alone_and_get_batched(server, target, references):
    """Eight clients at once: each gets exactly its solo output; some rounds shared a batched pass."""

    def one(seed: int) -> tuple[list[int], list[dict]]:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            out = edge_generate(c, make_prompt(seed % 4), ModelDrafter(target) if seed % 2 else NgramDrafter(),
                                k=3, max_new=MAX_NEW)
            return out.tokens, out.rounds

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for seed, (tokens, _) in enumerate(results):
        assert tokens == references[seed % 4]
    assert max(r["timings"]["batch_size"] for _, rounds in results for r in rounds) > 1


def test_stop_token_ends_the_session(client, target):
    prompt = make_prompt(2)
    ref = plain_greedy(target, prompt, MAX_NEW)
    stop = ref[10]
    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt, "stop_token_ids": [stop]}).json()["session_id"]
    tokens = []
    while True:
        rep = client.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt) + len(tokens)}).json()
        tokens += rep["tokens"]
        if rep["finished"]:
            break
    assert tokens == ref[: ref.index(stop) + 1] and rep["finish_reason"] == "stop"
    r = client.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt) + len(tokens)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "session_finished"


def test_base_len_mismatch_says_resend(client):
    prompt = make_prompt(3)
    sid = client.post("/v1/spec/sessions", json={"prompt_ids": prompt}).json()["session_id"]
    r = client.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt) + 5})
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "base_len_mismatch" and err["committed_len"] == len(prompt)
    assert client.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt)}).status_code == 200


def test_prefix_reuse_gives_same_output(client, target, references):
    prompt = make_prompt(0)
    first = client.post("/v1/spec/sessions", json={"prompt_ids": prompt}).json()
    assert first["reused_tokens"] == 0 or first["reused_tokens"] < len(prompt)
    client.delete(f"/v1/spec/sessions/{first['session_id']}")
    longer = prompt + references[0][:8]
    info = client.post("/v1/spec/sessions", json={"prompt_ids": longer, "max_new_tokens": 16}).json()
    assert info["reused_tokens"] >= len(prompt) - 1
    tokens = []
    while True:
        rep = client.post(f"/v1/spec/sessions/{info['session_id']}/rounds",
                          json={"base_len": len(longer) + len(tokens)}).json()
        tokens += rep["tokens"]
        if rep["finished"]:
            break
    assert tokens == plain_greedy(target, longer, 16)


def test_messages_are_rendered_server_side(client, target):
    msgs = [{"role": "user", "content": "hi there"}]
    info = client.post("/v1/spec/sessions", json={"messages": msgs}).json()
    expected = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
    assert info["prompt_ids"] == list(expected)


def test_auth_keys_and_session_ownership(target):
    with LoopbackServer(target, config(api_keys=("key-a", "key-b"))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        prompt = make_prompt(0)
        assert c.get("/health").status_code == 200  # no auth
        assert c.get("/metrics").status_code == 200  # no auth
        r = c.post("/v1/spec/sessions", json={"prompt_ids": prompt})
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = c.post("/v1/spec/sessions", json={"prompt_ids": prompt}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        sid = c.post("/v1/spec/sessions", json={"prompt_ids": prompt}, headers=a).json()["session_id"]
        r = c.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt)}, headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert c.post(f"/v1/spec/sessions/{sid}/rounds", json={"base_len": len(prompt)}, headers=a).status_code == 200
        # key b never reuses key a's cached prefix
        assert c.post("/v1/spec/sessions", json={"prompt_ids": prompt}, headers=b).json()["reused_tokens"] == 0


def test_eviction_under_kv_cap_and_resend(target, references):
    one_session = 2 * 2 * 2 * 16 * 4 * 72  # layers * (k, v) * kv heads * head dim * fp32 bytes * ~72 positions
    with LoopbackServer(target, config(kv_cache_memory=int(one_session * 2.5))) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        sids = [c.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(s, 64)}).json()["session_id"]
                for s in range(4)]
        assert srv.engine.store.used_bytes <= int(one_session * 2.5)
        r = c.post(f"/v1/spec/sessions/{sids[0]}/rounds", json={"base_len": 64})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_evicted"
        assert srv.engine.store.evictions >= 1
        # the newest session still works, and resending the evicted prefix gives the exact output
        assert c.post(f"/v1/spec/sessions/{sids[-1]}/rounds", json={"base_len": 64}).status_code == 200
        out = edge_generate(c, make_prompt(0, 64), None, 0, 8)
        assert out.tokens == plain_greedy(target, make_prompt(0, 64), 8)


def test_max_sessions_evicts_idle_lru(target):
    with LoopbackServer(target, config(max_sessions=2)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        sids = [c.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(s)}).json()["session_id"]
                for s in range(3)]
        assert c.get(f"/v1/spec/sessions/{sids[0]}").status_code == 404
        assert c.get(f"/v1/spec/sessions/{sids[2]}").status_code == 200


def test_sampled_edge_rounds_follow_the_target_distribution(client, target, wrong_drafter_model):
    """Sampled drafts with their sparse q, verified over HTTP: the first token's law is the target's."""
    import torch

    from agentspec.types import SamplingParams
    from agentspec.verify import sampling_probs

    prompt = make_prompt(2, 16)
    sampling = {"temperature": 1.5, "top_k": 3}
    with torch.inference_mode():
        logits = target.model(torch.tensor([prompt])).logits[0, -1]
    p = sampling_probs(logits, SamplingParams(**sampling))
    drafter = ModelDrafter(wrong_drafter_model)
    counts: dict[int, int] = {}
    n = 600
    for seed in range(n):
        out = edge_generate(client, prompt, drafter, k=2, max_new=1, sampling={**sampling, "seed": seed})
        counts[out.tokens[0]] = counts.get(out.tokens[0], 0) + 1
    assert set(counts) <= set(torch.nonzero(p).flatten().tolist())
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - float(p[t])) for t in range(p.shape[0]))
    assert tv < 0.07, (tv, counts, p[p > 0])
    assert any(r["drafted"] for r in out.rounds)


def test_chunked_prefill_and_room_made_before_prefill(target, references):
    """Prompts prefilled 7 tokens at a time give the same output; a new session's KV room is freed
    (LRU eviction) before its prefill, so the KV bytes never pass the cap, even mid-prefill."""
    one_session = 2 * 2 * 2 * 16 * 4 * 72  # layers * (k, v) * kv heads * head dim * fp32 bytes * ~72 positions
    cap = int(one_session * 2.5)
    with LoopbackServer(target, config(kv_cache_memory=cap, prefill_chunk_tokens=7)) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        store, peak = srv.engine.store, []
        assert store.bytes_per_token == 2 * 2 * 2 * 16 * 4  # measured at warm-up
        hook = target.model.register_forward_pre_hook(
            lambda *_: peak.append(sum(s.nbytes if s.cache is None else _nbytes(s.cache)
                                       for s in list(store._sessions.values()))))
        try:
            for s in range(4):
                c.post("/v1/spec/sessions", json={"prompt_ids": make_prompt(s, 64)}).raise_for_status()
        finally:
            hook.remove()
        assert store.evictions >= 1 and peak and max(peak) <= cap
        out = edge_generate(c, make_prompt(1), None, 0, MAX_NEW)
        assert out.tokens == references[1]


def _nbytes(cache) -> int:
    from agentspec import models

    return models.cache_nbytes(cache)


def test_a_draft_model_that_adds_nothing_sits_out_across_sessions(target, wrong_drafter_model, references):
    """The default tree with a --draft-model that never adds a token beyond the copies: every session still
    decodes plain greedy, and the API key's one gate, judged over all its sessions (an agent's steps), turns
    the model off; a second key starts from its own, fresh gate. The gate judges only rounds the model drafted
    in, and the server's draft-length policy soon drafts a wrong model only in its probes, every so many
    rounds: as many sessions as the gate needs to see ``warmup`` of them (two to four sessions' worth)."""
    with LoopbackServer(target, config(), draft_model=wrong_drafter_model) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        gates = srv.engine.model_gates
        for s in range(12):
            reference = references[s] if s in references else plain_greedy(target, make_prompt(s), MAX_NEW)
            replies = _server_mode(c, make_prompt(s), drafter="default")
            assert [t for rep in replies for t in rep["tokens"]] == reference
            (gate,) = gates._gates.values()
            if gate.samples >= gate.warmup:
                break
        assert gate.samples >= gate.warmup and not gate.pays
        assert gate.w1 < gate.w0 + 0.25  # the rare token a random model gets right is not worth its time
        assert gates.get("another owner").samples == 0
