"""Packaging promises: a light ``import agentspec`` and working console entry points."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_import_is_light():
    code = (
        "import sys, agentspec; agentspec.SamplingParams(); "
        "heavy = [m for m in ('torch', 'transformers', 'litellm', 'langchain_core', 'langgraph') if m in sys.modules]; "
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_lazy_attributes_resolve():
    import agentspec

    assert agentspec.SpecEngine.__name__ == "SpecEngine"
    assert agentspec.NgramDrafter.name == "ngram"


def test_cli_help():
    for module in ("agentspec.cli", "agentspec.verifier_server"):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "usage" in out.stdout


def test_the_package_ships_py_typed():
    import agentspec

    root = Path(agentspec.__file__).parent
    assert (root / "py.typed").is_file()
    package_data = (root.parent / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    assert '"py.typed"' in package_data.split("\n[")[0]  # shipped in wheels, not only in the checkout


def test_served_model_names_and_aliases(monkeypatch):
    from agentspec.verifier_server.cli import parse_args

    assert parse_args(["m"]).config.served_names == ("m",)
    args = parse_args(["m", "--served-model-name", "qwen", "qwen-coder", "gpt-4o"])
    assert args.config.served_model_name == "qwen" and args.config.served_names == ("qwen", "qwen-coder", "gpt-4o")
    monkeypatch.setenv("AGENTSPEC_SERVED_MODEL_NAME", "a b")
    assert parse_args(["m"]).config.served_names == ("a", "b")


def test_keep_alive_outlasts_the_clients_idle_connections(monkeypatch):
    """The server must not close an idle connection the client may still reuse."""
    from agentspec.transport import KEEPALIVE_EXPIRY_S
    from agentspec.verifier_server.cli import parse_args

    assert parse_args(["m"]).config.keep_alive_s > KEEPALIVE_EXPIRY_S
    assert parse_args(["m", "--keep-alive", "120"]).config.keep_alive_s == 120
    monkeypatch.setenv("AGENTSPEC_KEEP_ALIVE", "90")
    assert parse_args(["m"]).config.keep_alive_s == 90
    with pytest.raises(SystemExit):
        parse_args(["m", "--keep-alive", "0"])


def test_client_and_chat_model_are_lazy_top_level_exports():
    """``agentspec.SpecClient`` loads no heavy module; ``agentspec.ChatAgentSpec`` only LangChain's core."""
    code = (
        "import sys, agentspec; c = agentspec.SpecClient; "
        "heavy = lambda: [m for m in ('torch', 'transformers', 'litellm', 'langchain_core') "
        "                 if m in sys.modules]; "
        "print(c.__name__, ','.join(heavy())); m = agentspec.ChatAgentSpec; "
        "print(m.__name__, ','.join(heavy()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["SpecClient ", "ChatAgentSpec langchain_core"]
    import agentspec

    assert {"SpecClient", "ChatAgentSpec"} <= set(agentspec.__all__)
