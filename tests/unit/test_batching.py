"""Batched verification across sessions == each round verified alone (ragged prefixes, chains and trees)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from agentspec import models
from agentspec.protocol import Sampling
from agentspec.types import DraftProposal, SparseDist
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.engine import VerifierEngine
from agentspec.verifier_server.kv_store import key_owner
from agentspec.verifier_server.scheduler import RoundItem
from agentspec.verify import tree_attention
from tests.helpers import EOS, make_prompt, plain_greedy


def _drafts(reference: list[int], round_: int) -> list[DraftProposal]:
    right = reference[round_ : round_ + 4]
    wrong = [(t + 5) % 90 + 2 for t in right]
    return [
        DraftProposal(tokens=tuple(right[:3])),  # all right
        DraftProposal(tokens=tuple(right[:1] + wrong[1:3])),  # right once
        DraftProposal(),  # no draft
        DraftProposal(tokens=(wrong[0], right[0], right[1]), parents=(-1, -1, 1)),  # tree, right on sibling 2
    ]


@pytest.mark.parametrize("batched", [False, True])
def test_batched_rounds_equal_plain_greedy(target, batched):
    """Four sessions with different prompt lengths and draft shapes; outputs must be plain greedy's."""
    engine = VerifierEngine(target, ServerConfig(max_batch_size=8))
    owner = key_owner(None)
    prompts = [make_prompt(s, 20 + 9 * s) for s in range(4)]
    refs = [plain_greedy(target, p, 24) for p in prompts]
    sessions = [asyncio.run(engine._create_and_prefill(owner, p, 24, frozenset({EOS})))[0] for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    batch_sizes = set()
    for _ in range(30):
        live = [i for i, s in enumerate(sessions) if not s.finished]
        if not live:
            break
        items = []
        for i in live:
            drafts = _drafts(refs[i] + [2] * 8, len(outs[i]))  # drafts may look past the end
            items.append(RoundItem(sessions[i], drafts[(i + len(outs[i])) % 4], Sampling()))
        groups = [items] if batched else [[it] for it in items]
        for group in groups:
            for it, o in zip(group, engine.execute(group, [None] * len(group)), strict=True):
                assert o.error is None, o.error
                outs[sessions.index(it.session)].extend(o.reply.tokens)
                batch_sizes.add(o.reply.timings.batch_size)
    assert outs == refs
    assert max(batch_sizes) > 1 if batched else batch_sizes == {1}


def test_forward_batch_matches_single_passes(target):
    model = target.model
    specs = [(make_prompt(0, 30), [5, 6, 7], [-1, 0]), (make_prompt(1, 12), [9], []),
             (make_prompt(2, 20), [3, 4, 5, 6], [-1, -1, 1]), ([], make_prompt(3, 8), None)]
    caches, inputs, masks, positions, refs = [], [], [], [], []
    for prefix, new, parents in specs:
        parents = parents if parents is not None else list(range(-1, len(new) - 2))
        pending = len(new) - len(parents)
        for store in (caches, refs):
            c = models.new_cache(model)
            if prefix:
                models.forward(model, prefix, c, 1)
            store.append(c)
        mask, pos = tree_attention(parents, len(prefix), pending, target.dtype, model.device)
        inputs.append(new)
        masks.append(mask)
        positions.append(pos)
    out = models.forward_batch(model, caches, inputs, masks, positions)
    for i, ref_cache in enumerate(refs):
        ref = models.forward(model, inputs[i], ref_cache, len(inputs[i]), masks[i], positions[i])
        torch.testing.assert_close(out[i], ref, atol=1e-4, rtol=1e-4)
        assert models.cache_length(caches[i]) == models.cache_length(ref_cache)
        for a, b in zip(caches[i].layers, ref_cache.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("over_limit", [False, True])
def test_freed_kv_goes_back_to_the_os_only_above_the_rss_soft_limit(target, over_limit):
    """Trimming after every 16 MB of churn made each next round page-fault its whole cache back in (~20 %
    slower decoding); below the soft limit (ready RSS + the KV cap) freed pages stay for reuse."""
    from agentspec.verifier_server.kv_store import KVStore, rss_bytes

    store = KVStore(target.model, max_sessions=4, capacity_bytes=1 << 30)
    store.trim_every_bytes = 1  # every round counts as enough churn
    rss = rss_bytes()
    if rss is None:
        pytest.skip("no /proc/self/statm on this platform: the store then trims as before")
    store.rss_soft_limit = 0 if over_limit else rss + (1 << 40)
    session, _ = store.create("k", make_prompt(3, length=12), 8, frozenset())
    for n in range(1, 4):
        models.forward(target.model, session.tokens[(n - 1) * 4 : n * 4], session.cache, 1)
        store.update_size(session)
    assert (store.trims > 0) == over_limit


class _Raises:
    """A server-mode drafter that fails (as the grammar engine does on an odd tools schema)."""

    name, drafts_forced = "raises", False

    def propose(self, ctx, k):
        raise ValueError("bad schema")

    def reset(self):
        pass


@pytest.mark.parametrize("fault", ["draft", "verify"])
def test_a_failed_round_fails_its_item_only_and_leaves_its_session_as_it_was(target, fault):
    """One item's drafting or verification raising: that item gets the error, the other items of the same
    batched pass are committed as if alone, and the failed session's KV cache is exactly as before, so its
    next round gives plain greedy's tokens."""
    engine = VerifierEngine(target, ServerConfig(max_batch_size=8))
    owner = key_owner(None)
    prompts = [make_prompt(s, 20 + 9 * s) for s in range(3)]
    refs = [plain_greedy(target, p, 12) for p in prompts]
    sessions = [asyncio.run(engine._create_and_prefill(owner, p, 12, frozenset({EOS})))[0] for p in prompts]
    bad = sessions[0]
    cached, tokens = bad.num_cached, list(bad.tokens)
    if fault == "draft":
        item = RoundItem(bad, DraftProposal(), Sampling(), _Raises(), 2)
    else:  # a sampled draft whose proposal misses its own token: verify raises after the pass appended KV
        draft = DraftProposal(tuple(refs[0][:3]), draft_probs=tuple(SparseDist.point(t + 1) for t in refs[0][:3]))
        item = RoundItem(bad, draft, Sampling(temperature=1.0))
    others = [RoundItem(s, DraftProposal(tuple(r[:2])), Sampling()) for s, r in zip(sessions[1:], refs[1:],
                                                                                   strict=True)]
    outcomes = engine.execute([item, *others], [None] * 3)
    assert outcomes[0].error is not None and outcomes[0].reply is None
    for o, r in zip(outcomes[1:], refs[1:], strict=True):
        assert o.error is None and o.reply.tokens == r[:3]
    assert bad.tokens == tokens and bad.num_cached == cached and models.cache_length(bad.cache) == cached
    out: list[int] = []
    while not bad.finished:
        (o,) = engine.execute([RoundItem(bad, DraftProposal(tokens=tuple(refs[0][len(out):len(out) + 4])),
                                         Sampling())], [None])
        out.extend(o.reply.tokens)
    assert out == refs[0]



def test_a_short_round_runs_between_a_long_prompts_prefill_chunks(target):
    """Head-of-line: each prefill chunk is its own model-thread job, so a round queued during a long prefill
    runs before the prefill's remaining chunks, and both sessions still give plain greedy's tokens."""
    engine = VerifierEngine(target, ServerConfig(prefill_chunk_tokens=8, max_model_len=1024))
    owner = key_owner(None)
    short, long_prompt = make_prompt(3, 20), make_prompt(4, 600)
    jobs: list[str] = []
    chunk, execute = engine._prefill_chunk, engine.execute

    def chunk_job(*a):
        jobs.append("chunk")
        return chunk(*a)

    def execute_job(*a):
        jobs.append("round")
        return execute(*a)

    async def scenario():
        s, _ = await engine._create_and_prefill(owner, short, 4, frozenset({EOS}))
        engine._prefill_chunk, engine.execute = chunk_job, execute_job
        prefill = asyncio.ensure_future(engine._create_and_prefill(owner, long_prompt, 4, frozenset({EOS})))
        while "chunk" not in jobs:
            await asyncio.sleep(0.001)
        reply = await engine.scheduler.submit(RoundItem(s, DraftProposal(), Sampling()))
        long_session, _ = await prefill
        return reply, long_session

    reply, long_session = asyncio.run(scenario())
    first_round = jobs.index("round")
    assert 0 < first_round < jobs.count("chunk")  # the round did not wait for all ~75 chunks
    assert jobs.count("chunk") == -(-(len(long_prompt) - 1) // 8)
    assert reply.tokens == plain_greedy(target, short, 1)
    assert long_session.num_cached == len(long_prompt) - 1
    (o,) = engine.execute([RoundItem(long_session, DraftProposal(), Sampling())], [None])
    assert o.reply.tokens == plain_greedy(target, long_prompt, 1)


def test_a_new_short_request_runs_all_its_steps_within_one_long_chunk(target):
    """Head-of-line for a request that starts during a long prefill: its session's creation, its own short
    prefill and its round are each a model job, and the long prefill's next chunk waits for all of them, so
    at most the chunk already running lies between its first step and its last (not one chunk per step)."""
    engine = VerifierEngine(target, ServerConfig(prefill_chunk_tokens=8, max_model_len=1024))
    owner = key_owner(None)
    short, long_prompt = make_prompt(5, 8), make_prompt(6, 600)  # short: a prefill of one chunk
    jobs: list[str] = []
    chunk, execute, create = engine._prefill_chunk, engine.execute, engine.store.create
    long_ids: set[str] = set()

    def chunk_job(session, ids):
        jobs.append("long" if session.id in long_ids else "short-prefill")
        return chunk(session, ids)

    def execute_job(*a):
        jobs.append("round")
        return execute(*a)

    def create_job(owner_, ids, *a):
        session, reused = create(owner_, ids, *a)
        if len(ids) == len(long_prompt):
            long_ids.add(session.id)
        else:
            jobs.append("create")
        return session, reused

    engine._prefill_chunk, engine.execute, engine.store.create = chunk_job, execute_job, create_job

    async def scenario():
        prefill = asyncio.ensure_future(engine._create_and_prefill(owner, long_prompt, 4, frozenset({EOS})))
        while jobs.count("long") < 3:
            await asyncio.sleep(0.001)
        s, _ = await engine._create_and_prefill(owner, short, 4, frozenset({EOS}))
        reply = await engine.scheduler.submit(RoundItem(s, DraftProposal(), Sampling()))
        long_session, _ = await prefill
        return reply, long_session

    reply, long_session = asyncio.run(scenario())
    mine = [i for i, j in enumerate(jobs) if j != "long"]
    assert [jobs[i] for i in mine] == ["create", "short-prefill", "round"], jobs
    assert jobs[mine[0]:mine[-1]].count("long") <= 1, jobs[mine[0] - 1:mine[-1] + 2]
    assert reply.tokens == plain_greedy(target, short, 1)
    assert long_session.num_cached == len(long_prompt) - 1


@pytest.mark.parametrize("stage", ["forward", "commit", "after_commit"])
def test_a_round_failing_halfway_leaves_the_session_exactly_as_it_was(target, stage, monkeypatch):
    """A sampled edge round with new_tokens failing in the pass or in its commit (after verification drew
    from the RNG and KV positions were appended): tokens, turn start, RNG state and KV length are as before,
    so the retried request gives what a session that never failed gives."""
    from agentspec.protocol import VerifyRound

    def fresh():
        engine = VerifierEngine(target, ServerConfig())
        s = asyncio.run(engine._create_and_prefill(key_owner(None), make_prompt(5, 30), 16, frozenset({EOS})))[0]
        return engine, s

    def request(s, new=()):
        return VerifyRound(base_len=len(s.tokens), new_tokens=list(new), sampling=Sampling(temperature=1.0, seed=11))

    (engine, s), (ref_engine, ref) = fresh(), fresh()
    assert asyncio.run(engine.verify_round(s, request(s))).tokens == \
        asyncio.run(ref_engine.verify_round(ref, request(ref))).tokens  # both generators made and drawn once
    before = (list(s.tokens), s.num_prompt_tokens, s.num_cached, s.generator.get_state().clone())
    from agentspec.verifier_server import engine as engine_module

    module, name = {"forward": (models, "forward"), "commit": (models, "keep_cache_positions"),
                    "after_commit": (engine_module, "commit_round")}[stage]  # the last: it wrote, then a fault
    real = getattr(module, name)

    def fail_once(*a, **k):
        monkeypatch.setattr(module, name, real)
        if stage != "commit":
            real(*a, **k)  # the pass appended KV / the commit wrote tokens, then the fault
        raise RuntimeError("injected fault")

    monkeypatch.setattr(module, name, fail_once)
    with pytest.raises(RuntimeError, match="injected"):
        asyncio.run(engine.verify_round(s, request(s, [7, 8, 9])))
    assert (list(s.tokens), s.num_prompt_tokens, s.num_cached) == before[:3]
    assert torch.equal(s.generator.get_state(), before[3]) and models.cache_length(s.cache) == s.num_cached
    assert asyncio.run(engine.verify_round(s, request(s, [7, 8, 9]))).tokens == \
        asyncio.run(ref_engine.verify_round(ref, request(ref, [7, 8, 9]))).tokens
