"""The mode policy's trials: a switch that rests on older text than staying runs as a probe first.

The agent benchmark's shape: server mode copied an earlier call's short ids well; edge drafted the last call
and the prose since. A call that writes a file's code is "tool" text too, but server mode copies none of it:
switching to it for a whole segment on the older call's estimate lost, where a probe-length trial loses
little and its rounds correct the estimate.
"""

from __future__ import annotations

from agentspec import router
from agentspec.client.run import Run
from agentspec.protocol import RoundReply
from agentspec.types import SamplingParams
from tests.unit.test_router import _agent_policy, _rounds


def _edge_after_server_in_tool_calls() -> router.ModePolicy:
    """Server ran a tool call (4 tokens a pass), then edge ran a later one (3 a round, slower than server's)
    and then prose: edge is current, its tool estimate newer, server's cheaper."""
    policy = _agent_policy()
    for mode, kind, rounds in (("server-ar", "text", [("text", 1, 0, 0.0)] * 8),
                               ("server", "tool", [("tool", 4, 6, 0.0)] * 8),
                               ("edge", "tool", [("tool", 3, 6, 0.05)] * 6),
                               ("edge", "text", [("text", 3, 4, 0.05)] * 10)):
        policy.current = mode
        policy.last_used[(mode, kind)] = policy.segments = policy.segments + 1
        _rounds(policy, mode, rounds, seg_kind=kind)
    assert policy.predicted("server", "tool") < 0.9 * policy.predicted("edge", "tool")
    return policy


def _winning_trials(policy: router.ModePolicy, rounds: int, kind: str = "tool", tokens: int = 4) -> None:
    """Trials of server in ``kind`` (two rounds of ``tokens`` each) until their rounds reach ``rounds``: each
    is chosen as a trial while the incumbent stays current."""
    while (policy.trial_streak.get(("server", kind)) or 0) < rounds:
        assert policy.choose(kind=kind) == "server"
        assert policy.probing == "server" and policy.current == "edge"
        _rounds(policy, "server", [(kind, tokens, 6, 0.0)] * 2, seg_kind=kind)


def test_a_switch_on_an_older_estimate_runs_as_a_trial_and_reverts_when_it_loses():
    policy = _edge_after_server_in_tool_calls()
    assert policy.choose(kind="tool") == "server"
    assert policy.probing == "server" and policy.current == "edge"  # a trial: probe-length, edge stays current
    _rounds(policy, "server", [("tool", 1, 6, 0.0)] * 6, seg_kind="tool")  # this call's code: no copies
    assert policy.choose(kind="tool") == "edge"
    assert policy.probing is None and policy.current == "edge"


def test_a_trial_that_holds_up_becomes_a_switch_once_its_rounds_add_up():
    """The agent benchmark's fix_mean at RTT 50: a trial ran a call's copyable opening in two 4-token rounds
    and won, and the switch then ran the call's file content at a token a round for a whole segment. Trials
    go on until they add up to ``trial_rounds`` rounds; one that loses on the way reverts."""
    policy = _edge_after_server_in_tool_calls()
    _winning_trials(policy, policy.config.trial_rounds)  # two rounds at a time: trial after trial
    assert policy.choose(kind="tool") == "server"
    assert policy.probing is None and policy.current == "server"
    losing = _edge_after_server_in_tool_calls()
    _winning_trials(losing, 2)
    assert losing.choose(kind="tool") == "server" and losing.probing == "server"
    _rounds(losing, "server", [("tool", 1, 6, 0.0)] * 8, seg_kind="tool")  # the file's code: no copies
    assert losing.choose(kind="tool") == "edge" and losing.current == "edge"


def test_trials_over_a_calls_ids_do_not_switch_before_they_reach_the_calls_prose():
    """The agent benchmark's order_email at RTT 100 (agent_linear_cost.json): server trials ran the first
    call's order id, 7 rounds at 63-103 ms a token, and with ``trial_rounds`` at 4 made the switch; server
    then ran the next call's email body, 48 tokens at 180 and 329 ms a token. Trials must cover as many
    rounds as an estimate rests on (``round_memory``), which takes them past a call's ids into its prose."""
    policy = _edge_after_server_in_tool_calls()
    _winning_trials(policy, 7)  # the order id
    assert policy.choose(kind="tool") == "server" and policy.probing == "server" and policy.current == "edge"
    _rounds(policy, "server", [("tool", 1, 6, 0.0)] * 8, seg_kind="tool")  # the email's body: no copies
    assert policy.choose(kind="tool") == "edge" and policy.current == "edge"


def test_a_switch_on_a_newer_estimate_is_immediate():
    """Where the challenger ran in the kind after the incumbent did, its estimate is the newer: no trial."""
    policy = _edge_after_server_in_tool_calls()
    policy.last_used[("server", "tool")] = policy.segments
    assert policy.choose(kind="tool") == "server"
    assert policy.probing is None and policy.current == "server"


def test_a_switch_on_one_winning_probe_runs_as_a_trial_first():
    """The agent benchmark's fix_mean: a server probe in prose ran over a copyable stretch and won; switching
    on it for a whole segment then ran 32 prose tokens at a token a round. One probe's few tokens decide a
    trial only: a trial's win, or a whole segment, makes the switch."""
    policy = _agent_policy()
    for mode, rounds in (("server-ar", [("text", 1, 0, 0.0)] * 8), ("server", [("text", 1, 6, 0.0)] * 6),
                         ("edge", [("text", 3, 4, 0.05)] * 10)):
        policy.current = mode
        policy.last_used[(mode, "text")] = policy.segments = policy.segments + 1
        _rounds(policy, mode, rounds, seg_kind="text")
    policy.segments += policy.config.probe_every
    assert policy.choose(kind="text") == "server" and policy.probing == "server"  # a probe, due
    _rounds(policy, "server", [("text", 7, 6, 0.0)] * 3, seg_kind="text")  # a stretch it copies: it wins
    assert policy.predicted("server", "text") < 0.9 * policy.predicted("edge", "text")
    assert policy.choose(kind="text") == "server"
    assert policy.probing == "server" and policy.current == "edge"  # a trial, not yet a switch
    _winning_trials(policy, policy.config.trial_rounds, kind="text", tokens=7)  # it wins again, trial after trial
    assert policy.choose(kind="text") == "server"
    assert policy.probing is None and policy.current == "server"
    _rounds(policy, "server", [("text", 7, 6, 0.0)] * 4, seg_kind="text")  # a whole segment: no trial after it
    policy.current = "edge"
    assert policy.choose(kind="text") == "server" and policy.current == "server"


def test_a_round_that_opens_a_calls_json_counts_as_a_tool_round():
    """A call opens in prose (its fence): the round that commits ```json and the brace drafted in text, but
    what it copied is the call's boilerplate. Counted as prose, it made server mode look good for the prose
    of the answer after the tool result (a whole segment of one-token rounds at RTT 100 ms)."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    run = Run([{"role": "user", "content": "x"}], tools, 64, SamplingParams(), (), "auto", None)
    kinds = []
    for text in ("Sure.", " Reading it:\n", "```json\n{\n  ", '"name": "read_file", "arguments": {}', "}\n```",
                 "\nDone."):
        run.apply(RoundReply(session_id="s", accepted=0, drafted=0, tokens=[1], text=text, committed_len=1))
        kinds.append(run.round_kind)
    assert kinds == ["text", "text", "tool", "tool", "tool", "text"]
    plain = Run([{"role": "user", "content": "x"}], None, 64, SamplingParams(), (), "auto", None)
    plain.apply(RoundReply(session_id="s", accepted=0, drafted=0, tokens=[1], text="```json\n{", committed_len=1))
    assert plain.round_kind == "text"  # no tools: JSON in an answer is prose to the router


def test_trials_that_measured_the_challenger_dearer_keep_the_incumbent_until_it_is_probed_again():
    """The agent benchmark's fix_mean at RTT 100: a server trial won over a call's copyable opening, the next
    ran a file's code at a token a round; their rounds added up to ``trial_rounds`` and, on them and older
    copies, server's closed form still came out cheaper, so a whole segment ran at a token a round (12 s).
    What the trials measured, not the closed form, decides: they cost more a token than edge measured."""
    policy = _edge_after_server_in_tool_calls()
    assert policy.choose(kind="tool") == "server" and policy.probing == "server"
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * 2, seg_kind="tool")
    assert policy.choose(kind="tool") == "server" and policy.probing == "server"
    _rounds(policy, "server", [("tool", 1, 6, 0.0)] * 2, seg_kind="tool")
    seconds, tokens = policy.trial_cost[("server", "tool")]
    assert tokens == 10 and seconds / tokens > policy.measured_kind[("edge", "tool")]
    assert policy.predicted("server", "tool") < (1 - policy.config.hysteresis) * policy.predicted("edge", "tool")
    for _ in range(3):  # not on the closed form, segment after segment
        assert policy.choose(kind="tool") == "edge"
        assert policy.current == "edge" and policy.probing is None
        _rounds(policy, "edge", [("tool", 3, 6, 0.05)] * 2, seg_kind="tool")
    policy.segments += policy.probe_interval[("server", "tool")]  # its next probe falls due: it wins, trials go on
    assert policy.choose(kind="tool") == "server" and policy.scheduled
    _rounds(policy, "server", [("tool", 6, 6, 0.0)] * 2, seg_kind="tool")
    assert policy.trial_cost[("server", "tool")] == (0.0, 0)
    _winning_trials(policy, policy.config.trial_rounds, tokens=6)
    assert policy.choose(kind="tool") == "server" and policy.current == "server"


def test_lost_trials_give_way_once_the_incumbent_is_predicted_dearer_than_they_measured():
    """The agent benchmark's fix_mean at RTT 0: an edge trial in prose measured dearer than server had
    there, then the answer went on to write code, which server drafts nothing of (a token a round):
    its prediction, from those rounds, rose past what the trial measured while the EMA of what it measured
    lagged. Against the dearer of the two the trial no longer lost, so edge runs again (as a trial)."""
    policy = _edge_after_server_in_tool_calls()
    policy.current = "server"
    _rounds(policy, "server", [("text", 3, 4, 0.0)] * 12, seg_kind="text")
    policy.trial_cost[("edge", "text")] = (16 * 2.2 * policy.measured_kind[("server", "text")], 16)
    policy.trial_streak[("edge", "text")] = 4
    assert policy._lost_trials("edge", "text")
    for _ in range(2):  # two segments of code
        _rounds(policy, "server", [("text", 1, 4, 0.0)] * 16, seg_kind="text")
    seconds, tokens = policy.trial_cost[("edge", "text")]
    assert seconds / tokens < (1 - policy.config.hysteresis) * policy.predicted("server", "text")
    assert not policy._lost_trials("edge", "text")
    assert policy.choose(kind="text") == "edge" and policy.probing == "edge"


def test_trials_beside_a_novel_opening_are_judged_against_the_incumbent_there():
    """The agent benchmark's fix_mean at RTT 50 (agent_shadow_drafting_2.json): server ran the tool calls,
    whose segments open in text and copy well, then opened the prose answer at a token a round (151 ms a
    token). An edge trial on the tokens after that measured 138: dearer than server's EMA in text (the
    calls' openings) and than its prediction, so edge waited for its next probe while server wrote the
    rest of the answer at 113-122 ms a token, where fixed edge ran at 59-85. Against what server measured
    beside the trial, the trial won; one dearer than that still loses."""
    policy = _edge_after_server_in_tool_calls()
    policy.current = "server"
    for _ in range(3):  # tool calls' openings
        policy.segments += 1
        _rounds(policy, "server", [("text", 4, 6, 0.0)] * 4, seg_kind="text")
    policy.last_used[("server", "text")] = policy.segments = policy.segments + 1
    _rounds(policy, "server", [("text", 1, 1, 0.0)] * 16, seg_kind="text")  # the answer's novel opening
    opening = policy.last_measured[("server", "text")]
    assert opening > 1.5 * policy.measured_kind[("server", "text")]
    assert policy.choose(kind="text") == "edge" and policy.probing == "edge"  # a trial
    policy.probing = None
    beside = 0.9 * opening
    assert beside > (1 - policy.config.hysteresis) * max(policy.measured_kind[("server", "text")],
                                                        policy.predicted("server", "text"))  # lost, before
    policy.trial_cost[("edge", "text")], policy.trial_streak[("edge", "text")] = (8 * beside, 8), 3
    assert not policy._lost_trials("edge", "text")
    assert policy.choose(kind="text") == "edge" and policy.probing == "edge"  # trials go on
    policy.probing = None
    policy.trial_cost[("edge", "text")] = (8 * 1.1 * opening, 8)
    assert policy._lost_trials("edge", "text") and policy.choose(kind="text") == "server"


def test_a_server_segment_that_opens_a_message_is_cut_after_opening_rounds():
    """The agent benchmark's fix_mean at RTT 50 (agent_shadow_drafting_2.json): after a tool call that
    server copied at 5 tokens a round, the answer opened in server mode, where segments starting in text
    had been calls, and its prose ran 32 tokens in 31 rounds at 151-188 ms a token (fixed edge: 109-118).
    Server's opening segment stops after ``opening_rounds``, which a call's copies take past a segment's
    tokens: then the mode is chosen again on prose's rounds. Elsewhere, and in other modes, it is not cut."""
    policy = _edge_after_server_in_tool_calls()
    c = policy.config
    policy.current = "server"
    assert policy.choose(kind="text") == "server" and policy.probing is None
    assert policy.segment_rounds("server", opening=True) == c.opening_rounds == 8
    assert 4 * c.opening_rounds >= c.segment_tokens  # a call's copies are not cut
    assert policy.segment_rounds("server") is None
    assert policy.segment_rounds("edge", opening=True) is None is policy.segment_rounds("server-ar", opening=True)
    policy.scheduled = True  # a due probe keeps its own few rounds
    assert policy.segment_rounds("server", opening=True) == c.probe_rounds
    policy.scheduled = False
    before = policy.predicted("server", "text")
    _rounds(policy, "server", [("text", 1, 2, 0.0)] * c.opening_rounds, seg_kind="text")  # prose at a token a round
    assert policy.predicted("server", "text") > 1.3 * before
    assert policy.choose(kind="text") == "edge"


def test_trials_after_a_winning_one_run_the_rounds_left_as_one_segment():
    """The agent benchmark's fix_mean at RTT 0: edge, predicted a quarter cheaper, ran its trials as seven
    segments of 8-13 tokens, five of them at 108-177 ms a token, where fixed edge's whole segments ran at
    61-132 (each short one pays a request and a cold first round). The first trial is probe-length; once
    trials measured the challenger cheaper, the rest of ``trial_rounds`` runs as one segment."""
    policy = _edge_after_server_in_tool_calls()
    c = policy.config
    assert policy.choose(kind="tool") == "server" and policy.probing == "server"
    assert (policy.segment_limit(), policy.segment_rounds()) == (c.probe_tokens, None)  # the first trial
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * 2, seg_kind="tool")
    assert policy.choose(kind="tool") == "server" and policy.probing == "server" and policy.current == "edge"
    assert (policy.segment_limit(), policy.segment_rounds()) == (c.segment_tokens, c.trial_rounds - 2)
    assert policy.segment_rounds("server", opening=True) == min(c.trial_rounds - 2, c.opening_rounds)
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * (c.trial_rounds - 2), seg_kind="tool")
    assert policy.choose(kind="tool") == "server" and policy.probing is None and policy.current == "server"
    losing = _edge_after_server_in_tool_calls()
    losing.choose(kind="tool")
    _rounds(losing, "server", [("tool", 4, 6, 0.0)] * 2, seg_kind="tool")
    assert losing.choose(kind="tool") == "server" and losing.segment_rounds() == c.trial_rounds - 2
    _rounds(losing, "server", [("tool", 1, 6, 0.0)] * (c.trial_rounds - 2), seg_kind="tool")  # no copies
    assert losing.choose(kind="tool") == "edge" and losing.current == "edge"  # it still reverts


def test_a_switch_starts_with_probe_length_segments_that_double_while_it_holds_up():
    """The agent benchmark's fix_mean at RTT 20: a server probe and trial both won over a call's copyable
    opening; the switch's segment then ran the call's code at a token a round, 32 tokens in 30 rounds. A
    switch's first segment is probe-length, so such a switch is judged again after ``probe_tokens``; one
    that holds up doubles its segments up to the client's."""
    policy = _edge_after_server_in_tool_calls()
    c = policy.config
    assert policy.tenure is None and policy.segment_limit() == c.segment_tokens  # never switched: whole segments
    assert policy.segment_rounds() is None  # a whole segment: its tokens alone limit it
    assert policy.choose(kind="tool") == "server" and policy.segment_limit() == c.probe_tokens  # a trial
    assert policy.segment_rounds() is None  # a trial's rounds decide a switch: not cut
    _rounds(policy, "server", [("tool", 4, 6, 0.0)] * 2, seg_kind="tool")
    _winning_trials(policy, c.trial_rounds)
    limits = []
    while len(limits) < 4:
        pick = policy.choose(kind="tool")
        if policy.scheduled:  # edge's probe, due after the trials' many short segments: it loses
            assert policy.segment_rounds() == c.probe_rounds == 3  # a due probe: a few rounds judge it
            _rounds(policy, pick, [("tool", 3, 6, 0.05)] * 2, seg_kind="tool")
            continue
        assert pick == "server" and policy.current == "server" and policy.probing is None
        assert policy.segment_rounds() is None
        limits.append(policy.segment_limit())
        _rounds(policy, "server", [("tool", 4, 6, 0.0)] * (limits[-1] // 4), seg_kind="tool")
    assert limits == [8, 16, 32, 32] and c.probe_tokens == 8 and c.segment_tokens == 32
    losing = _edge_after_server_in_tool_calls()
    _winning_trials(losing, c.trial_rounds)
    assert losing.choose(kind="tool") == "server" and losing.current == "server"
    assert losing.segment_limit() == c.probe_tokens
    _rounds(losing, "server", [("tool", 1, 6, 0.0)] * 8, seg_kind="tool")  # the call's code: no copies
    assert losing.choose(kind="tool") == "edge"  # judged again after 8 tokens, not 32: it goes back
    assert losing.segment_limit() == c.probe_tokens  # (as a trial: edge's tool estimate is the older)


def _end_of_message(policy: router.ModePolicy, mode: str, ended: bool) -> None:
    """A segment of one token in one round at 0.6 s (server measured 0.46 s a token in this prose): a message's
    last token (``ended``), or a whole segment's figure, which is a verdict."""
    policy.observe_round(mode, 2, 0, 1, wall_s=0.6, server_s=0.42, verify_s=0.42, draft_s=0.0, kind="text",
                         segment_kind="text")
    policy.observe_segment(mode, 0.6, tokens=1, rounds=1, drafted=2, kind="text", ended=ended)


def test_a_segment_its_message_ended_after_a_token_or_two_is_no_verdict():
    """The agent benchmark's fix_mean at RTT 0: an edge trial in prose ran the message's last token, one round
    at 172 ms; as a verdict it lost against server's 74 ms a token, and server ran the next answer's prose,
    three segments at 103-137 ms a token, while edge was predicted at 57-81. A round cut by the end commits
    what was left of the message, not what the mode drafts."""
    def prose_on_server() -> router.ModePolicy:
        policy = _edge_after_server_in_tool_calls()
        policy.current = "server"
        policy.last_used[("server", "text")] = policy.segments = policy.segments + 1  # newer than edge's
        _rounds(policy, "server", [("text", 1, 4, 0.0)] * 12, seg_kind="text")  # prose it copies none of
        assert policy.choose(kind="text") == "edge" and policy.probing == "edge" and not policy.scheduled
        return policy

    cut = prose_on_server()
    measured = cut.measured_kind[("edge", "text")]
    _end_of_message(cut, "edge", ended=True)
    assert cut.trial_cost.get(("edge", "text"), (0.0, 0))[1] == 0 and cut.measured_kind[("edge", "text")] == measured
    assert cut.choose(kind="text") == "edge" and cut.probing == "edge"  # the trial goes on in the next answer
    judged = prose_on_server()
    _end_of_message(judged, "edge", ended=False)
    assert judged.choose(kind="text") == "server"  # the same figure as a whole segment's is a lost trial
    probed = prose_on_server()
    probed.segments += probed.config.probe_every
    probed.current, probed.probing = "server", None
    assert probed.choose(kind="text") == "edge" and probed.scheduled  # a due probe that the message's end cuts
    _end_of_message(probed, "edge", ended=True)
    assert ("edge", "text") not in probed.probe_interval  # not backed off
    _end_of_message(probed, "server-ar", ended=True)
    assert "server-ar" in probed.seconds_per_token  # tried: a mode whose segments all end short is not untried
