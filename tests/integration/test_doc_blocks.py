"""Every fenced code block in README.md and docs/*.md works as written (issue 21, item 11).

* every block names its language: ``python``, ``bash``, ``json`` or ``text`` (output, diagrams);
* ``json`` blocks, and the JSON bodies of ``curl -d`` in ``bash`` blocks, parse;
* ``python`` blocks compile, use no undefined names and import nothing they do not use (the blocks of one
  file form one script, in order), and **run**, in order in one namespace per file, against a real
  ``agentspec-verifier`` on loopback serving the README's model name with the README's API key. Two
  documented values are swapped for test-sized ones (:data:`SUBSTITUTIONS`): ``load_model`` of the offline
  default target loads a tiny random model saved to a directory (``load_model`` takes directories) and the
  verifier URL ``http://127.0.0.1:8000`` becomes the loopback server's;
* ``bash`` blocks: every ``agentspec …`` / ``agentspec-verifier …`` command line parses with the real
  parsers (and its values build the real config), without loading a model or starting a server; every
  ``curl`` runs, against the loopback server, and gets a 2xx. A command of any other program must be in
  :data:`NOT_RUN`, with the reason it cannot run here.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentspec.verifier_server.config import ServerConfig
from tests.integration.server import LoopbackServer

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "bash", "json", "text"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)

# What the README's server serves (`agentspec-verifier qwen2.5-coder-0.5b-instruct ... --api-key secret`).
SERVED_NAME = "qwen2.5-coder-0.5b-instruct"
API_KEY = "secret"
DOC_URL = "http://127.0.0.1:8000"
DOC_HOST = "localhost:8000"  # curl's form

# Commands that cannot run in a test, by their first words, with the reason.
NOT_RUN = {
    ("make", "demo"): "installs into .venv, then runs the 0.5B demo for minutes",
    ("make", "test"): "runs the whole test suite",
    ("python3", "-m", "venv"): "creates a virtual environment (set-up by hand)",
    (".",): "activates a virtual environment in the user's shell",
    ("pip", "install"): "installs packages from PyPI",
    ("make", "reliability-short"): "starts verifier processes and attacks them for minutes",
    (".venv/bin/python", "-m", "benchmarks.reliability"): "the reliability suite's long run (~40 minutes)",
    (".venv/bin/python", "-m", "benchmarks.pair"): "the pair benchmark (the 1.5B target; ~25 minutes)",
    (".venv/bin/python", "-m", "benchmarks.agent"): "the agent benchmark (the 1.5B target; 40-75 minutes)",
    (".venv/bin/python", "-m", "benchmarks.train"): "a training benchmark (tens of minutes)",
    (".venv/bin/python", "-m", "benchmarks.cross_core"): "times both cores for ~2 minutes over 3.6 GB of weights",
    ("make", "vllm"): "makes the vLLM venv (minutes, hundreds of MB)",
    ("make", "test-vllm"): "starts vLLM servers (make test-vllm is its own suite)",
    ("make", "bench-vllm"): "runs the vLLM benchmark for many minutes",
    (".venv-vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"): "starts a vLLM server (make test-vllm "
                                                                         "does, in tests/integration/test_vllm_live.py)",
}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_blocks(path: Path) -> list[Block]:
    text = path.read_text()
    return [Block(path, text.count("\n", 0, m.start()) + 1, m.group(1).strip(), m.group(2))
            for m in FENCE.finditer(text)]


ALL_BLOCKS = [b for p in DOC_FILES for b in doc_blocks(p)]


def blocks(lang: str) -> list[Block]:
    return [b for b in ALL_BLOCKS if b.lang == lang]


def test_the_docs_have_blocks_and_each_names_a_known_language():
    assert len(blocks("python")) >= 3 and len(blocks("bash")) >= 3
    bad = [f"{b}: {b.lang or '(none)'}" for b in ALL_BLOCKS if b.lang not in LANGUAGES]
    assert not bad, f"fence languages must be one of {sorted(LANGUAGES)}: {bad}"


# ---------------------------------------------------------------- bash: split into commands


def shell_commands(code: str) -> list[list[str]]:
    """The block's simple commands as argv lists: continuation lines joined, comments dropped, quoted
    strings kept whole (also across lines), split at ``&&``, ``||``, ``;`` and ``|``."""
    out: list[list[str]] = []
    pending = ""
    for line in code.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the string goes on on the next line
            pending += "\n"
            continue
        pending = ""
        argv: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|"):
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(w)
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return out


def curl_bodies(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, w in enumerate(argv[:-1]) if w in ("-d", "--data", "--data-raw", "--json")]


def test_json_blocks_and_curl_bodies_parse():
    checked = 0
    for b in blocks("json"):
        try:
            json.loads(b.code)
        except json.JSONDecodeError as e:
            pytest.fail(f"{b}: not valid JSON: {e}")
        checked += 1
    for b in blocks("bash"):
        for argv in shell_commands(b.code):
            for body in curl_bodies(argv) if argv[0] == "curl" else ():
                try:
                    json.loads(body)
                except json.JSONDecodeError as e:
                    pytest.fail(f"{b}: curl's JSON body is not valid JSON: {e}\n{body}")
                checked += 1
    assert checked


def check_agentspec(argv: list[str]) -> None:
    """Parse like ``agentspec.cli.main`` and build the command's config, but run nothing."""
    from agentspec.cli import build_parser

    args = build_parser().parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    if args.command == "demo":
        from agentspec.demo import DemoConfig

        DemoConfig(**values)
    elif args.command == "export":
        assert args.source and args.out  # export's arguments are checked by its parser alone
    else:
        from agentspec.training.config import TrainConfig

        TrainConfig(**{k: v for k, v in values.items() if v is not None})


def check_verifier(argv: list[str]) -> None:
    from agentspec.verifier_server.cli import parse_args

    parse_args(argv)  # the ServerConfig too: a bad value is an argparse error (SystemExit)


@pytest.mark.parametrize("block", blocks("bash"), ids=str)
def test_bash_block_command_lines(block: Block, server: LoopbackServer, monkeypatch):
    for name in ("MODEL", "API_KEY", "PORT", "HOST", "DTYPE", "DEVICE", "DRAFT_MODEL"):
        monkeypatch.delenv(f"AGENTSPEC_{name}", raising=False)  # the command line alone, not the env
    commands = shell_commands(block.code)
    assert commands, f"{block}: no command"
    for argv in commands:
        line = shlex.join(argv)
        if argv[0] in ("agentspec", "agentspec-verifier"):
            try:
                (check_agentspec if argv[0] == "agentspec" else check_verifier)(argv[1:])
            except SystemExit as e:
                pytest.fail(f"{block}: `{line}` does not parse (exit {e.code}); see the error above")
            except (TypeError, ValueError) as e:
                pytest.fail(f"{block}: `{line}`: {e}")
        elif argv[0] == "curl":
            run_curl(block, argv, server)
        elif not any(tuple(argv[: len(k)]) == k for k in NOT_RUN):
            pytest.fail(f"{block}: `{line}`: no check for this command; add one, or a NOT_RUN entry and why")


def test_verifier_doc_names_only_real_flags():
    """docs/verifier.md's table and prose name ``agentspec-verifier``'s flags: each must exist."""
    from agentspec.verifier_server.cli import build_parser

    real = {s for a in build_parser()._actions for s in a.option_strings}
    named = set(re.findall(r"`(--[a-z][a-z-]*)", (ROOT / "docs" / "verifier.md").read_text()))
    assert named and not named - real, f"not flags of agentspec-verifier: {sorted(named - real)}"


def run_curl(block: Block, argv: list[str], server: LoopbackServer) -> None:
    host = server.url.removeprefix("http://")
    used = [w for w in argv if DOC_HOST in w or DOC_URL in w]
    assert used, f"{block}: curl must address the documented server ({DOC_HOST})"
    argv = [w.replace(DOC_URL, server.url).replace(DOC_HOST, host) for w in argv]
    done = subprocess.run([*argv, "--max-time", "30", "-w", "\n%{http_code}"], capture_output=True, text=True,
                          timeout=40)
    body, _, status = done.stdout.rpartition("\n")
    assert done.returncode == 0 and status.startswith("2"), (
        f"{block}: `{shlex.join(argv)}` → exit {done.returncode}, HTTP {status}: {body[:500]}"
        f" {done.stderr[:500]}")
    json.loads(body)


# ---------------------------------------------------------------- python


def names_of(code: str) -> tuple[set[str], set[str], set[str]]:
    """(names bound, names read, names imported) anywhere in ``code`` (flow-insensitive, like a linter's
    first pass: enough to catch a snippet that uses a name no block defines)."""
    tree = ast.parse(code)
    bound: set[str] = set()
    imported: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound | imported, read, imported


PY_FILES = sorted({b.path for b in blocks("python")})


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_define_every_name_they_use(path: Path):
    defined = set(dir(builtins))
    all_read: set[str] = set()
    all_imported: dict[str, Block] = {}
    for b in (b for b in blocks("python") if b.path == path):
        try:
            bound, read, imported = names_of(b.code)
        except SyntaxError as e:
            pytest.fail(f"{b}: does not compile: {e}")
        defined |= bound
        missing = read - defined
        assert not missing, f"{b}: uses names no block before it (or it) defines: {sorted(missing)}"
        all_read |= read
        all_imported.update({n: b for n in imported})
    unused = {n: str(b) for n, b in all_imported.items() if n not in all_read}
    assert not unused, f"imported, never used: {unused}"


@pytest.fixture(scope="module")
def server(target):
    config = ServerConfig(served_model_name=SERVED_NAME, api_keys=(API_KEY,), max_model_len=1024)
    with LoopbackServer(target, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def tiny_model_dir(target, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-target")
    target.model.save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return path


def substitutions(server: LoopbackServer, model_dir: Path) -> dict[str, str]:
    """Documented values → the test's (only these; each must occur in some block)."""
    return {
        f'load_model("{SERVED_NAME}"': f"load_model({str(model_dir)!r}",
        DOC_URL: server.url,
    }


def test_every_substitution_applies():
    """A README edit that drops a substituted value must update :func:`substitutions` too."""
    code = "".join(b.code for b in blocks("python"))
    for old in (f'load_model("{SERVED_NAME}"', DOC_URL):
        assert old in code, f"no python block contains {old!r}: update the substitutions"


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, server: LoopbackServer, tiny_model_dir: Path, monkeypatch):
    monkeypatch.delenv("AGENTSPEC_API_KEY", raising=False)  # the blocks must say which key they use
    namespace: dict = {"__name__": "__main__"}
    subs = substitutions(server, tiny_model_dir)
    for b in (b for b in blocks("python") if b.path == path):
        code = b.code
        for old, new in subs.items():
            code = code.replace(old, new)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, str(b), "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - any failure of a documented block is the finding
            raise AssertionError(f"{b} failed: {type(e).__name__}: {e}\n--- output:\n{out.getvalue()}") from e


def test_not_run_entries_are_still_in_the_docs():
    """The allowlist stays small: an entry no doc command uses any more is removed."""
    argvs = [argv for b in blocks("bash") for argv in shell_commands(b.code)]
    stale = [k for k in NOT_RUN if not any(tuple(a[: len(k)]) == k for a in argvs)]
    assert not stale, f"NOT_RUN entries no doc block uses: {stale}"


def test_shell_splitting():
    code = "a b  # c\nd 'e\nf' \\\n  g && h ; i | j"
    assert shell_commands(code) == [["a", "b"], ["d", "e\nf", "g"], ["h"], ["i"], ["j"]]
