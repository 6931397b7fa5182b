"""The layering of docs/architecture.md, checked on the AST of every module (imports anywhere in a file,
also inside functions): the pure core imports no I/O, the router decides from numbers, the client and the
drafters never reach into the server; no module-level import circles; modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "agentspec"
FILES = sorted(PKG.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute names of the ``agentspec`` modules (and names in them) a file imports."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    name = module_name(path) if PKG in path.parents else path.stem
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {n for n in out if n == "agentspec" or n.startswith("agentspec.")}


def files(*prefixes: str) -> list[Path]:
    return [f for f in FILES if any(module_name(f) == p or module_name(f).startswith(p + ".") for p in prefixes)]


RULES = [  # (modules, may not import)
    (("agentspec.router",), ("agentspec.drafters",)),
    (("agentspec.verify", "agentspec.types", "agentspec.protocol", "agentspec.toolcalls"),
     ("agentspec.models", "agentspec.transport", "agentspec.verifier_server", "agentspec.adapters")),
    (("agentspec.drafters", "agentspec.client"), ("agentspec.verifier_server",)),
]


@pytest.mark.parametrize("sources,forbidden", RULES)
def test_layers(sources, forbidden):
    checked = files(*sources)
    assert checked, f"no module matches {sources}"
    bad = {module_name(f): sorted(n for n in imports(f) if any(n == x or n.startswith(x + ".") for x in forbidden))
           for f in checked}
    assert not {m: b for m, b in bad.items() if b}, f"layering broken: {bad}"


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def g():\n    from agentspec.drafters.base import DraftContext\n")
    assert "agentspec.drafters.base" in imports(f)


def test_no_module_level_import_circles():
    known = {module_name(f) for f in FILES}
    graph = {module_name(f): {n for n in imports(f, top_level_only=True) if n in known} - {module_name(f)}
             for f in FILES}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError(f"import circle: {' -> '.join([*path[path.index(n):], n])}")
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])


def test_modules_stay_small():
    big = {module_name(f): n for f in FILES if (n := len(f.read_text().splitlines())) > 400}
    assert not big, f"modules over 400 lines: {big}"
