"""The command lines' promises: ``--version``, help with defaults on every flag, strict boolean flags,
required train flags, one dtype vocabulary, a taken port failing before the model loads, and model
errors as one paragraph."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import pytest

from agentspec.cli import build_parser, main
from agentspec.training.config import TrainConfig
from agentspec.verifier_server import cli as verifier_cli


def subparser(name: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_both_commands_print_their_version(capsys):
    import importlib.metadata

    expected = importlib.metadata.version("agentspec")
    parsers = ((build_parser().parse_args, "agentspec"), (verifier_cli.parse_args, "agentspec-verifier"))
    for parse, prog in parsers:
        with pytest.raises(SystemExit) as exit_:
            parse(["--version"])
        assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"{prog} {expected}"


@pytest.mark.parametrize("command", ["demo", "train"])
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subparser(command)
    flags = [a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")]
    assert len(flags) >= 5
    for action in flags:
        assert action.help and ("(default: " in action.help or "(required)" in action.help), action.dest
    if command == "train":  # generated from TrainConfig's field metadata, defaults from its fields
        by_dest = {a.dest: a for a in flags}
        for f in fields(TrainConfig):
            assert f.metadata["help"] and by_dest[f.name].help.startswith(f.metadata["help"])
        assert "(default: 3)" in by_dest["epochs"].help and "(default: False)" in by_dest["train_head"].help
    assert "(default: " in parser.format_help()


def test_demo_system_prompt_defaults_to_the_rules_and_can_be_emptied():
    from agentspec.demo import AGENT_RULES, DemoConfig

    assert DemoConfig().system_prompt == AGENT_RULES
    assert subparser("demo").parse_args([]).system_prompt == AGENT_RULES
    assert subparser("demo").parse_args(["--system-prompt", ""]).system_prompt == ""


def test_boolean_flags_are_strict(capsys):
    base = ["train", "--target", "t", "--output", "o"]
    for text, value in [("true", True), ("TRUE", True), ("1", True), ("Yes", True), ("false", False),
                        ("False", False), ("0", False), ("no", False)]:
        assert build_parser().parse_args([*base, "--train-head", text]).train_head is value
    for text in ("ture", "on", "", "2"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*base, "--train-head", text])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--train-head" in err and "true/false, 1/0 or yes/no" in err


@pytest.mark.parametrize("argv", [["train"], ["train", "--target", "t"], ["train", "--output", "o"]])
def test_train_requires_target_and_output(argv, capsys, monkeypatch):
    import agentspec.training.run

    monkeypatch.setattr(agentspec.training.run, "run_training", lambda cfg: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "required" in err
    assert all(flag in err for flag in ("--target", "--output") if flag not in argv)


def test_verifier_accepts_every_dtype_spelling_load_model_does():
    from agentspec.models import DTYPES, resolve_dtype

    for name in ("auto", *DTYPES):
        assert verifier_cli.parse_args(["m", "--dtype", name]).dtype == name
        resolve_dtype(name)
    with pytest.raises(SystemExit):
        verifier_cli.parse_args(["m", "--dtype", "fp8"])


def test_verifier_quantises_only_a_draft_model_on_the_cpu(capsys):
    args = verifier_cli.parse_args(["m", "--draft-model", "d", "--draft-quantize", "int4", "--device", "cpu"])
    assert (args.draft_model, args.draft_quantize) == ("d", "int4")
    assert verifier_cli.parse_args(["m"]).draft_quantize is None
    for argv, says in ((["m", "--draft-quantize", "int4"], "quantises the --draft-model"),
                       (["m", "--draft-model", "d", "--draft-quantize", "int4", "--device", "cuda"], "CPU only"),
                       (["m", "--draft-model", "d", "--draft-quantize", "nf4"], "invalid choice")):
        with pytest.raises(SystemExit):
            verifier_cli.parse_args(argv)
        assert says in capsys.readouterr().err


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_taken_port_fails_before_the_model_loads(taken_port, monkeypatch):
    loading = threading.Event()
    monkeypatch.setattr(verifier_cli, "build_engine", lambda args: (loading.set(), threading.Event().wait(9)))
    with pytest.raises(SystemExit) as exit_:
        verifier_cli.main(["no-such-model", "--port", str(taken_port)])
    assert not loading.wait(1.0)  # the model never started loading
    assert f"127.0.0.1:{taken_port}" in str(exit_.value.code)  # SystemExit(message): exit status 1


def test_taken_port_exits_at_once_naming_it(taken_port):
    exe = Path(sys.executable).with_name("agentspec-verifier")
    out = subprocess.run([str(exe), "smollm2-135m-instruct", "--port", str(taken_port)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and f"127.0.0.1:{taken_port}" in out.stderr
    assert "Traceback" not in out.stderr and "ready: " not in out.stderr


def test_bad_model_error_lists_the_aliases_and_both_spellings_of_the_flag():
    from agentspec import models

    with pytest.raises(models.ModelLoadError) as err:
        models.load_model("no-such-org/no-such-model", device="cpu")
    assert "--allow-download (CLI) / allow_download=True (Python)" in str(err.value)
    assert all(alias in str(err.value) for alias in models.OFFLINE_MODELS)


def test_demo_with_a_bad_model_prints_one_paragraph():
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--model", "no-such-model", "--device", "cpu"])
    err = str(exit_.value.code)  # SystemExit(message): printed to stderr, exit status 1
    assert err.startswith("agentspec demo: could not load model 'no-such-model'")
    assert "--allow-download" in err
    assert "Traceback" not in err and "\n" not in err


def test_api_key_file_and_env(tmp_path, monkeypatch, capsys):
    keys = tmp_path / "keys"
    keys.write_text("# operators\nalpha\n\n  beta  \n")
    args = verifier_cli.parse_args(["m", "--api-key-file", str(keys)])
    assert args.config.api_keys == ("alpha", "beta")
    monkeypatch.setenv("AGENTSPEC_API_KEY", "one, two")
    assert verifier_cli.parse_args(["m"]).config.api_keys == ("one", "two")
    monkeypatch.delenv("AGENTSPEC_API_KEY")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for bad in (str(empty), str(tmp_path / "missing")):
        with pytest.raises(SystemExit):
            verifier_cli.parse_args(["m", "--api-key-file", bad])
        assert "--api-key-file" in capsys.readouterr().err


def test_repeated_log_lines_are_collapsed():
    import logging

    f = verifier_cli.RepeatFilter(window_s=60)
    rec = lambda: logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "accept failed: too many files", (), None)  # noqa: E731
    assert [f.filter(rec()) for _ in range(1000)].count(True) == 1
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", (), None)
    assert f.filter(other)


def test_fd_limit_is_raised_to_the_hard_limit():
    resource = pytest.importorskip("resource", reason="no rlimits on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        verifier_cli.raise_fd_limit(100)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connection_cap_above_the_fd_limit_is_lowered_to_fit():
    """With the hard limit at 256, ``--max-connections 1024`` cannot be held: the cap becomes what fits
    beside the server's own descriptors (in a subprocess: a lowered hard limit cannot be raised again)."""
    pytest.importorskip("resource", reason="no rlimits on this platform")
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
            "from agentspec.verifier_server.cli import FD_RESERVE, raise_fd_limit; "
            "print(raise_fd_limit(1024), raise_fd_limit(100), FD_RESERVE)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    fits, small, reserve = map(int, out.stdout.split())
    assert (fits, small) == (256 - reserve, 100) and "serving at most" in out.stderr
