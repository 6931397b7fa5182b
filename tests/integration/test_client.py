"""SpecClient against real loopback verifiers: every mode equals plain greedy, async twin, failover."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest
import torch

from agentspec import models
from agentspec.client import FinalEvent, SpecClient, TextEvent
from agentspec.drafters import ModelDrafter, NgramDrafter
from agentspec.router import DraftLengthPolicy, ModeConfig, ModePolicy
from agentspec.transport import HTTPTransport, VerifierUnavailable
from benchmarks.delay_proxy import DelayProxy
from tests.helpers import EOS, plain_greedy
from tests.integration.server import LoopbackServer, config

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "tell me about tools"}]
MAX = 40


@pytest.fixture(scope="module")
def server(target):
    with LoopbackServer(target, config(), draft_model=target) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(target):
    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    return plain_greedy(target, list(prompt), MAX)


@pytest.mark.parametrize("mode", ["edge", "server", "server-ar", "auto"])
def test_every_mode_equals_plain_greedy(server, target, reference, mode):
    client = SpecClient(server.url, drafter=ModelDrafter(target), tokenizer=target.tokenizer, mode=mode,
                        segment_tokens=8)
    events = list(client.stream(MESSAGES, max_tokens=MAX))
    final = events[-1]
    assert isinstance(final, FinalEvent)
    assert final.tokens == reference
    eos_free = [t for t in reference if t != 1]
    assert final.text == target.tokenizer.decode(eos_free, skip_special_tokens=True)
    assert "".join(e.text for e in events if isinstance(e, TextEvent)) == final.text
    modes = {s.mode for s in final.stats.segments}
    if mode == "auto":
        assert len(modes) >= 2 and modes <= {"edge", "server", "server-ar"}  # switched mid-request, lossless
    else:
        assert modes == {mode}
    client.close()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantised_drafter_is_lossless_at_the_edge_and_on_the_server(target, reference, scheme):
    """The target's own int4/int8 copy drafts (close, not equal: some drafts are rejected); the output is
    plain greedy's either way, drafted on the client (edge) or next to the target (server)."""
    model = copy.deepcopy(target.model).cpu()
    assert models.quantize_linears(model, scheme) > 0
    drafter = replace(target, model=model, device=torch.device("cpu"), name=f"{target.name}-{scheme}")
    with LoopbackServer(target, config(), draft_model=drafter) as srv:
        for mode in ("edge", "server"):
            client = SpecClient(srv.url, drafter=ModelDrafter(drafter), tokenizer=target.tokenizer, mode=mode,
                                segment_tokens=8)
            final = client.generate(MESSAGES, max_tokens=MAX)
            client.close()
            assert final.tokens == reference, mode
            rounds = sum(s.rounds for s in final.stats.segments)
            assert rounds < len(reference), mode  # the quantised drafter's tokens were accepted


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "sync"])
def test_sibling_leaves_at_the_edge_are_lossless(target, reference, pipeline):
    """An int4 copy of the target drafts a chain with a sibling leaf at each position (tree_width=2): rounds
    with trees, drafted ahead on their spine's hypothesis or not (over a 20 ms round trip, so a draft ahead
    has time before the reply), through the real server; plain greedy's output either way."""
    model = copy.deepcopy(target.model).cpu()
    models.quantize_linears(model, "int4")
    drafter = replace(target, model=model, device=torch.device("cpu"), name=f"{target.name}-int4")
    with (LoopbackServer(target, config()) as srv,
          DelayProxy("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), one_way_delay_s=0.01) as proxy):
        client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=ModelDrafter(drafter, tree_width=2),
                            tokenizer=target.tokenizer, mode="edge", segment_tokens=8, pipeline=pipeline)
        final = client.generate(MESSAGES, max_tokens=MAX)
        client.close()
    assert final.tokens == reference
    assert sum(s.rounds for s in final.stats.segments) < len(reference)
    assert (sum(s.pipelined for s in final.stats.segments) > 0) is pipeline
    # a request starts cold; pipelined, a later segment finds the draft its last round made ahead
    cold = [s.entry_s is not None for s in final.stats.segments]
    assert cold[0] and all(cold) is not pipeline


def test_edge_trees_teach_the_router_acceptance_only_where_they_drafted(server, target, reference):
    """The target drafts for itself with a sibling leaf at each position (tree_width=2): the target takes
    every spine whole. The γ policy's per-position acceptance must then see no rejection at all; counting
    each tree's nodes as its depth recorded one past every spine, and held γ at the depth it last had."""
    policy = ModePolicy()
    client = SpecClient(server.url, drafter=ModelDrafter(target, tree_width=2), tokenizer=target.tokenizer,
                        mode="edge", segment_tokens=8, policy=policy)
    final = client.generate(MESSAGES, max_tokens=MAX)
    client.close()
    assert final.tokens == reference
    seen = policy.edge.acceptance
    assert seen.reached and seen.accepted == seen.reached, (seen.reached, seen.accepted)


def test_auto_probes_run_short_segments_and_stay_lossless(server, target, reference):
    """A probe re-measures a mode on ``probe_tokens`` tokens, not a whole segment (a losing probe is cheap);
    other segments run the client's length; the output is plain greedy's."""
    policy = ModePolicy(ModeConfig(probe_every=1, probe_tokens=3))
    client = SpecClient(server.url, drafter=ModelDrafter(target), tokenizer=target.tokenizer, mode="auto",
                        segment_tokens=8, policy=policy)
    final = client.generate(MESSAGES, max_tokens=MAX)
    assert final.tokens == reference
    segments = final.stats.segments
    probes = [s for s in segments if s.probe]
    # a server-side segment stops at its limit; an edge one after the round that reaches it (γ + 1 at most)
    caps = {m: 3 + (client.num_draft_tokens if m == "edge" else 0) for m in ("edge", "server", "server-ar")}
    assert probes and all(s.tokens <= caps[s.mode] for s in probes), [(s.mode, s.tokens, s.probe) for s in segments]
    assert any(s.tokens >= 8 for s in segments if not s.probe)  # the rest: whole 8-token segments
    # the drafter prefills the prompt while the session opens, or else before its first edge draft (timed
    # apart from drafting): whichever did, the router learns the prefill's rate from it
    first_edge = next(s for s in segments if s.mode == "edge")
    assert policy.t_catchup is not None
    assert final.stats.to_dict()["catchup_s"] >= first_edge.catchup_s
    fixed = SpecClient(server.url, drafter=ModelDrafter(target), tokenizer=target.tokenizer, mode="edge",
                       segment_tokens=8, policy=policy)  # a fixed mode never probes, whatever the policy says
    assert not any(s.probe for s in fixed.generate(MESSAGES, max_tokens=MAX).stats.segments)
    client.close()
    fixed.close()


class ScriptedProbes(ModePolicy):
    """A router that runs ``script``'s (mode, due probe?) segments in turn, then edge, and records each
    segment's round budget as the client asks for it."""

    def __init__(self, config: ModeConfig, script: list[tuple[str, bool]]) -> None:
        super().__init__(config)
        self.script, self.caps = list(script), []

    def choose(self, kind="text", exclude=frozenset(), catchup_tokens=0, cold=False):
        mode, due = self.script.pop(0) if self.script else ("edge", False)
        self.probing, self.scheduled = (mode, True) if due else (None, False)
        return mode

    def segment_rounds(self, mode=None, opening=False) -> int | None:
        self.caps.append(super().segment_rounds(mode, opening))
        return self.caps[-1]


def test_due_probes_stop_after_their_rounds_and_stay_lossless(server, target, wrong_drafter_model, reference):
    """A due probe runs at most ``probe_rounds`` rounds, edge's (client-side) and server's (the verifier
    ends its request) alike: a mode that commits a token a round has lost after a few; the other segments
    are not cut; the output is plain greedy's."""
    script = [("server", True), ("edge", True), ("server-ar", True), ("server", False), ("edge", True)]
    policy = ScriptedProbes(ModeConfig(probe_tokens=8, probe_rounds=2), script)
    client = SpecClient(server.url, drafter=ModelDrafter(wrong_drafter_model), tokenizer=target.tokenizer,
                        mode="auto", segment_tokens=8, policy=policy)
    final = client.generate(MESSAGES, max_tokens=MAX)
    client.close()
    assert final.tokens == reference
    segments = final.stats.segments
    assert [s.mode for s in segments][:5] == [m for m, _ in script] and len(policy.caps) == len(segments)
    assert policy.caps[:5] == [2, 2, 2, None, 2]
    assert [s.rounds for s in segments[:3]] == [2, 2, 2] and segments[4].rounds == 2
    assert segments[2].tokens == 2  # server-ar: a token a round
    assert segments[3].rounds > 2 or segments[3].tokens == 8  # not cut: its 8 tokens


def test_a_server_segment_opening_the_message_stops_after_opening_rounds(server, target, wrong_drafter_model,
                                                                         reference):
    """Auto's server segment that opens a message runs at most ``opening_rounds`` rounds (the verifier ends
    its request), its next server segment is not cut, and the output is plain greedy's."""
    policy = ScriptedProbes(ModeConfig(opening_rounds=2), [("server", False), ("server", False)])
    client = SpecClient(server.url, drafter=ModelDrafter(wrong_drafter_model), tokenizer=target.tokenizer,
                        mode="auto", segment_tokens=24, policy=policy)
    final = client.generate(MESSAGES, max_tokens=MAX)
    client.close()
    assert final.tokens == reference
    first, second = final.stats.segments[:2]
    # 24 tokens are more than two rounds can commit, even where the verifier's copies take every draft (it
    # remembers earlier tests' answers): the rounds cap, not the tokens', ended the first segment
    assert policy.caps[:2] == [2, None] and first.rounds == 2 and first.tokens < 24
    assert second.mode == "server" and (second.rounds > 2 or second.tokens == 24)


class ScriptedModes(ModePolicy):
    """A router that runs the modes of ``script`` in turn (then edge) and records the catch-up it was told."""

    def __init__(self, script: list[str]) -> None:
        super().__init__(ModeConfig())
        self.script, self.told = list(script), []

    def choose(self, kind="text", exclude=frozenset(), catchup_tokens=0, cold=False):
        self.told.append(catchup_tokens)
        return self.script.pop(0) if self.script else "edge"


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_the_edge_drafter_catches_up_while_server_segments_stream(server, target, reference, use_async):
    """Auto over a 40 ms round trip, three 8-token server segments, then edge: the local model drafter
    prefills the prompt and the server's tokens while it waits for the server's lines, so the edge segment
    starts caught up (no prefill on its critical path, none charged by the router); with pipelining off it
    prefills all of them there. Both outputs are plain greedy's."""
    out = {}
    with DelayProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1]), one_way_delay_s=0.02) as proxy:
        for pipeline in (None, False):
            policy = ScriptedModes(["server"] * 3)
            client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=ModelDrafter(target),
                                tokenizer=target.tokenizer, mode="auto", segment_tokens=8, policy=policy,
                                pipeline=pipeline)
            final = (await client.agenerate(MESSAGES, max_tokens=MAX) if use_async
                     else client.generate(MESSAGES, max_tokens=MAX))
            client.close()
            assert final.tokens == reference
            assert [s.mode for s in final.stats.segments][:4] == ["server"] * 3 + ["edge"]
            out[pipeline] = final.stats.segments[3].catchup_s, policy.told[3]
    assert out[None] == (0.0, 0)
    assert out[False][0] > 0 and out[False][1] >= 3 * 8  # the prompt and three segments' tokens


@pytest.mark.parametrize("drafter_kind", ["right", "wrong"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
async def test_pipelined_edge_equals_plain_greedy(server, target, wrong_drafter_model, reference, drafter_kind,
                                                  use_async):
    """Edge mode drafting each round while the one before is in flight (over a 20 ms round trip, so the
    draft ahead, which stops once the reply is in, has time to draft): with the target as its own drafter
    every draft made ahead is used; with a wrong drafter most are discarded. The output is plain greedy's
    either way, and switching pipelining off uses none."""
    model = target if drafter_kind == "right" else wrong_drafter_model
    finals = {}
    with DelayProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1]), one_way_delay_s=0.01) as proxy:
        for pipeline in (True, False):
            client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=ModelDrafter(model), mode="edge",
                                num_draft_tokens=3, pipeline=pipeline)  # on however fast the tiny drafter is
            finals[pipeline] = (await client.agenerate(MESSAGES, max_tokens=MAX) if use_async
                                else client.generate(MESSAGES, max_tokens=MAX))
            client.close()
            assert finals[pipeline].tokens == reference
    on, off = (finals[x].stats.to_dict() for x in (True, False))
    assert off["pipelined_rounds"] == 0 and off["draft_ahead_s"] == 0
    assert on["draft_ahead_s"] > 0
    if drafter_kind == "right":  # every round after the first was drafted in flight, but for the last one
        # or two (no draft ahead once the round in flight may reach max_tokens)
        assert on["pipelined_rounds"] >= sum(s.rounds for s in finals[True].stats.segments) - 3
    else:
        assert on["pipelined_rounds"] < sum(s.rounds for s in finals[True].stats.segments) // 2


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_pipelined_edge_with_the_tool_drafter_equals_plain_greedy(server, target):
    """With tools the client drafts through its tree (grammar + copy + the model): the round after one in
    flight is drafted ahead too (over a 20 ms round trip, time to draft), used only when its hypothesis
    holds, and the output is plain greedy's (``server-ar`` with the same tools) with pipelining on, off or
    by default (on where drafting takes long enough: timing decides, so only the output is checked)."""
    plain = SpecClient(server.url, tokenizer=target.tokenizer, mode="server-ar")
    reference = plain.generate(MESSAGES, TOOLS, max_tokens=MAX).tokens
    plain.close()
    with DelayProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1]), one_way_delay_s=0.01) as proxy:
        for pipeline in (True, False, None):
            client = SpecClient(f"http://127.0.0.1:{proxy.port}", drafter=ModelDrafter(target),
                                tokenizer=target.tokenizer, mode="edge", num_draft_tokens=3, pipeline=pipeline)
            assert client.tool_drafter is not None
            final = client.generate(MESSAGES, TOOLS, max_tokens=MAX)
            client.close()
            assert final.tokens == reference
            if pipeline is not None:
                assert (final.stats.to_dict()["pipelined_rounds"] > 0) is pipeline


def test_pipelined_sampled_edge_matches_the_target_law(server, target):
    """Sampled edge mode with drafts made in flight (the drafter is the target with a perturbed head, so
    q != p, and a draft ahead is used only after the target happened to emit the drafter's guess): the law
    of the 4 tokens is the target's (temperature 1.5, top-k 2: at most 16 sequences, exact law from at
    most 15 forward passes)."""
    import copy

    import torch

    from agentspec.types import SamplingParams
    from agentspec.verify import sampling_probs
    from tests.unit.test_sampling_distribution import tv_distance

    prompt = target.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    params = SamplingParams(temperature=1.5, top_k=2)
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(4):
            grown = {}
            for seq, pr in exact.items():
                if seq and seq[-1] == EOS:  # finished early
                    grown[seq] = pr
                    continue
                logits = target.model(torch.tensor([list(prompt) + list(seq)])).logits[0, -1]
                probs = sampling_probs(logits, params)
                for x in torch.nonzero(probs).flatten().tolist():
                    grown[(*seq, x)] = pr * float(probs[x])
            exact = grown
    close = copy.deepcopy(target.model)
    with torch.no_grad():
        head = close.get_output_embeddings().weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * head.std() * 0.2)
    always_draft = ModePolicy(edge=DraftLengthPolicy(probe_every=1))  # γ = 0 at most one round in a row
    client = SpecClient(server.url, drafter=ModelDrafter(close), mode="edge", num_draft_tokens=1, policy=always_draft,
                        pipeline=True)
    samples, pipelined = [], 0
    for seed in range(800):
        final = client.generate(MESSAGES, max_tokens=4, sampling=SamplingParams(temperature=1.5, top_k=2, seed=seed))
        samples.append(tuple(final.tokens))
        pipelined += final.stats.to_dict()["pipelined_rounds"]
    client.close()
    assert set(samples) <= set(exact)
    assert pipelined > 50  # drafts made ahead were really verified
    tv_small, tv_large = tv_distance(samples[:100], exact), tv_distance(samples, exact)
    assert tv_large < 0.08, tv_large  # sampling noise alone: ~0.05 for 16 cells at n = 800
    assert tv_large < tv_small


class _Slow:
    """A real drafter that also takes ``seconds`` a proposal, as a larger model on a slower device does."""

    def __init__(self, inner, seconds: float) -> None:
        self.inner, self.seconds, self.name = inner, seconds, inner.name

    def propose(self, ctx, k):
        time.sleep(self.seconds)
        return self.inner.propose(ctx, k)


def test_pipelining_by_default_only_when_drafting_costs_more_than_a_handoff(server, target, reference):
    """``pipeline=None``: an n-gram lookup (well under PIPELINE_MIN_DRAFT_S) drafts after each reply; a
    drafter taking 5 ms a proposal drafts ahead. Plain greedy output either way. Over a 40 ms round trip:
    a draft made ahead stops at the reply, so on a bare loopback a tiny model's round could be back before
    a 5 ms proposal has two tokens, and whether any round pipelined would turn on the machine's timing."""
    with DelayProxy("127.0.0.1", int(server.url.rsplit(":", 1)[1]), one_way_delay_s=0.02) as proxy:
        url = f"http://127.0.0.1:{proxy.port}"
        fast = SpecClient(url, drafter=NgramDrafter(), mode="edge")
        slow = SpecClient(url, drafter=_Slow(ModelDrafter(target), 0.005), mode="edge")
        for client, pipelined in ((fast, False), (slow, True)):
            final = client.generate(MESSAGES, max_tokens=MAX)
            client.close()
            assert final.tokens == reference
            assert (final.stats.to_dict()["pipelined_rounds"] > 0) is pipelined


async def test_async_twin_matches(server, target, reference):
    client = SpecClient(server.url, drafter=NgramDrafter(), tokenizer=target.tokenizer, mode="edge")
    final = await client.agenerate(MESSAGES, max_tokens=MAX)
    assert final.tokens == reference


def test_failover_to_second_verifier_keeps_every_token(target, reference):
    """The first verifier dies mid-request; the second continues from the committed tokens."""
    with LoopbackServer(target, config()) as a, LoopbackServer(target, config()) as b:
        client = SpecClient([a.url, b.url], drafter=ModelDrafter(target), mode="edge", segment_tokens=4, retries=1,
                            timeout=5)
        events = []
        for ev in client.stream(MESSAGES, max_tokens=MAX):
            events.append(ev)
            if len(events) == 2:  # after the first verified text: kill verifier a
                a.server.should_exit = True
                a.thread.join(timeout=10)
        final = events[-1]
        assert final.tokens == reference
        assert final.stats.fallbacks and "VerifierUnavailable" in final.stats.fallbacks[0]


def test_a_connection_closed_while_idle_is_sent_again_not_failed(target, reference):
    """The server closes an idle kept-alive connection (keep-alive 1 s) and the client only learns it by
    using it: the proxy's 0.5 s one-way delay holds the server's FIN back, so the next request, sent 0.75 s
    after the last answer, goes out on a connection that is already closed. With ``retries=0`` it is sent
    again on a fresh connection once, both for a plain POST and for a stream, and nothing is lost."""
    with (LoopbackServer(target, replace(config(), keep_alive_s=1.0)) as srv,
          DelayProxy("127.0.0.1", int(srv.url.rsplit(":", 1)[1]), one_way_delay_s=0.5) as proxy):
        t = HTTPTransport(f"http://127.0.0.1:{proxy.port}", retries=0, timeout=10)
        opened = t.post("/v1/spec/sessions", {"messages": MESSAGES, "max_new_tokens": 4}).body
        time.sleep(0.75)  # the server closes at +0.5 s; its FIN reaches the client at +1.0 s
        again = t.post("/v1/spec/sessions", {"prompt_ids": opened["prompt_ids"], "max_new_tokens": 4}).body
        time.sleep(0.75)
        lines = [x.body for x in t.stream_lines(f"/v1/spec/sessions/{again['session_id']}/generate",
                                                 {"base_len": len(opened["prompt_ids"]), "mode": "server-ar",
                                                  "max_new_tokens": 4})]
        t.close()
    assert [tok for x in lines for tok in x["tokens"]] == reference[:4]


def test_api_fallback_is_recorded(target):
    with LoopbackServer(target, config()) as a:
        url = a.url
    client = SpecClient(url, mode="server", fallback_model="openai/fallback-model", retries=0, timeout=2,
                        api_kwargs={"mock_response": "fallback answer"})
    final = client.generate(MESSAGES, max_tokens=MAX)
    assert final.text == "fallback answer"
    assert [s.mode for s in final.stats.segments] == ["api"] and final.stats.fallbacks


def test_verifier_killed_mid_request_falls_back_to_the_api_model(target, reference):
    """No second verifier: the committed tokens stay, the API model continues, and the result says so."""
    with LoopbackServer(target, config()) as a:
        client = SpecClient(a.url, drafter=ModelDrafter(target), mode="edge", segment_tokens=4, retries=1,
                            timeout=5, fallback_model="openai/fallback-model",
                            api_kwargs={"mock_response": " and the rest"})
        events = []
        for ev in client.stream(MESSAGES, max_tokens=MAX):
            events.append(ev)
            if len(events) == 2:
                a.server.should_exit = True
                a.thread.join(timeout=10)
    final = events[-1]
    committed = len(final.tokens)  # the verified tokens; the API model's continuation is text only
    assert sum(s.tokens for s in final.stats.segments if s.mode != "api") == committed  # the cut segment counts
    assert committed >= 1 and final.tokens == reference[:committed]  # nothing lost or changed
    assert final.text == target.tokenizer.decode(reference[:committed]) + " and the rest"  # nor duplicated
    assert final.stats.segments[-1].mode == "api" and "VerifierUnavailable" in final.stats.fallbacks[0]


def test_typed_error_without_fallback(target):
    with LoopbackServer(target, config()) as a:
        url = a.url
    client = SpecClient(url, mode="server", retries=1, timeout=2)
    with pytest.raises(VerifierUnavailable) as info:
        client.generate(MESSAGES, max_tokens=4)
    assert info.value.__cause__ is not None


def test_mode_policy_hysteresis_and_probing():
    policy = ModePolicy(ModeConfig(has_drafter=True, probe_every=5))
    costs = {"edge": 0.010, "server": 0.020, "server-ar": 0.030}
    seen = []
    for _ in range(3):
        seen.append(policy.choose())
        policy.observe_segment(seen[-1], costs[seen[-1]])
    assert seen == ["edge", "server", "server-ar"]  # untried modes first
    picks = [policy.choose() for _ in range(10)]
    assert picks.count("edge") >= 8  # cheapest, with a periodic probe of the stalest mode
    calm = ModePolicy(ModeConfig(has_drafter=True, probe_every=10**6, ema=1.0))
    for m, cost in (("edge", 0.010), ("server", 0.020), ("server-ar", 0.030)):
        calm.choose()
        calm.observe_segment(m, cost)
    assert calm.choose() == "edge"
    calm.observe_segment("server", 0.0097)  # barely cheaper: within the hysteresis, stay on edge
    assert calm.choose() == "edge"
    calm.observe_segment("server", 0.005)  # clearly cheaper: switch
    assert calm.choose() == "server"


def test_mode_policy_probes_back_off_while_they_lose():
    """A probe that finds its mode 3x worse doubles that mode's probe interval once per 1.25x it lost by
    (four times: log 3 / log 1.25 = 4.9), up to the cap; a competitive one resets it."""
    policy = ModePolicy(ModeConfig(has_drafter=False, probe_every=4, ema=1.0))
    costs = {"server": 0.010, "server-ar": 0.030}
    probes = []
    for i in range(200):
        mode = policy.choose()
        if mode == "server-ar" and i > 1:
            probes.append(i)
        policy.observe_segment(mode, costs[mode])
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == [64, 128], probes
    costs["server-ar"] = 0.0101  # now competitive: the next probe resets the interval
    last = probes[-1]
    for i in range(200, 200 + 2 * policy.config.max_probe_every):
        mode = policy.choose()
        policy.observe_segment(mode, costs[mode])
        if mode == "server-ar" and i > last:
            break
    assert policy.probe_interval[("server-ar", "text")] == policy.config.probe_every
