"""The agent and training benchmarks' command lines: what they run, and what they refuse before loading anything."""

from __future__ import annotations

import pytest


def test_command_line_picks_methods_and_refuses_what_it_cannot_run(tmp_path, capsys) -> None:
    from benchmarks.agent import parse_args

    none = ["--tuned-drafter", "none", "--small-drafter", "none"]
    args, tasks, methods, rtts = parse_args(["--methods", "server,edge_0.5b", "--rtts", "0,50", "--tasks", "2", *none])
    assert methods == ("plain", "server", "edge_0.5b") and rtts == [0.0, 50.0] and len(tasks) == 2
    assert parse_args(none)[2] == ("plain", "server", "server_0.5b_int4", "edge_0.5b", "edge_0.5b_int4",
                                   "edge_0.5b_sync", "auto")  # no trained drafters, no A/A twin: left out
    assert parse_args([*none, "--methods", "edge_0.5b_int4,edge_0.5b_int4_twin"])[2] == (
        "plain", "edge_0.5b_int4", "edge_0.5b_int4_twin")  # the A/A pair, when asked for
    made = tmp_path / "small"
    made.mkdir()
    (made / "config.json").write_text("{}")
    _, _, methods, _ = parse_args(["--small-drafter", str(made), "--tuned-drafter", "none", "--auto-drafter", "small"])
    assert methods == ("plain", "server", "server_small", "server_0.5b_int4", "edge_0.5b", "edge_0.5b_int4",
                       "edge_0.5b_sync", "edge_small", "auto")
    assert parse_args([*none, "--auto-drafter", "0.5b_int4"])[0].auto_drafter == "0.5b_int4"  # made on the fly
    assert parse_args(none)[0].repeats == 1 and parse_args([*none, "--repeats", "2"])[0].repeats == 2
    assert parse_args(none)[0].draft_confidence == 0.0  # off unless asked
    assert parse_args([*none, "--draft-confidence", "0.4"])[0].draft_confidence == 0.4
    for bad, says in ((["--methods", "server,warp"], "unknown ['warp']"), (["--rtts", "0,fast"], "--rtts"),
                      (["--small-drafter", str(tmp_path / "missing"), "--tuned-drafter", "none"], "no drafter there"),
                      ([*none, "--auto-drafter", "small"], "--auto-drafter small"),
                      ([*none, "--repeats", "0"], "--repeats takes a number of runs per task >= 1"),
                      ([*none, "--draft-confidence", "1.5"], "--draft-confidence takes a probability in [0, 1)")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert says in capsys.readouterr().err


def test_each_repeat_has_its_own_api_key_so_none_copies_an_earlier_runs_answer() -> None:
    from benchmarks.agent import repeat_key

    keys = [repeat_key("bf16", m, rtt, k) for m in ("server", "auto") for rtt in (0.0, 20.0) for k in range(3)]
    assert len(set(keys)) == len(keys)
    assert repeat_key("bf16", "auto", 20.0, 0) == "bf16-auto-20"  # a single run keeps its name
    assert repeat_key("bf16", "auto", 20.0, 1) == "bf16-auto-20-r1"


def test_training_benchmark_refuses_a_pair_recipe_without_the_pair(capsys) -> None:
    from benchmarks.train import main

    with pytest.raises(SystemExit):
        main(["--recipe", "from-target"])
    assert "--recipe from-target is a --pair option" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--nodes", "5,10"], ["--nodes", "0,17"], ["--reps", "0"]])
def test_verify_rows_refuses_sizes_it_cannot_send_before_starting_a_verifier(bad, capsys) -> None:
    from benchmarks.verify_rows import main

    with pytest.raises(SystemExit):
        main(bad)
    assert "--" in capsys.readouterr().err

