"""Imports run downwards (audit ← runtime ← approvals): runtime reaches approvals only
through the `gates` port, and approvals' modules import each other without loops."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Chaos is a soak driver that decides approvals like a reviewer; it is leaving runtime.
ALLOWED = {"runtime/chaos.py", "runtime/management/commands/chaos.py"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _modules(package: str) -> dict[str, set[str]]:
    return {
        str(p.relative_to(ROOT)): _imports(p)
        for p in (ROOT / package).rglob("*.py")
        if "migrations" not in p.parts
    }


def test_runtime_does_not_import_approvals() -> None:
    offenders = {
        path
        for path, names in _modules("runtime").items()
        if any(n == "approvals" or n.startswith("approvals.") for n in names)
    }
    assert offenders <= ALLOWED, sorted(offenders - ALLOWED)


def test_approvals_modules_form_no_import_cycle() -> None:
    graph = {
        path.removesuffix(".py").replace("/", "."): {n for n in names if n.startswith("approvals.")}
        for path, names in _modules("approvals").items()
    }
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, trail: list[str]) -> None:
        if seen.get(module) == 2:
            return
        assert seen.get(module) != 1, " -> ".join([*trail, module])
        seen[module] = 1
        for target in sorted(graph.get(module, ())):
            visit(target, [*trail, module])
        seen[module] = 2

    for module in sorted(graph):
        visit(module, [])
