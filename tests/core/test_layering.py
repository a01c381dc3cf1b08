"""Imports run downwards: fastsql <- audit <- runtime <- approvals (DESIGN.md, layering).

Checked on the source, every import statement including those inside functions: a lazy
import is still a dependency (the journal's admin once reached runtime that way)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the first-party packages it must not import
BELOW = {
    "fastsql": {"audit", "runtime", "approvals", "config", "holdpoint_client"},
    "audit": {"runtime", "approvals"},
}


def _imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_a_lower_package_imports_nothing_above_it(package: str) -> None:
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imported(path) & BELOW[package])
        for path in sorted((ROOT / package).rglob("*.py"))
        if _imported(path) & BELOW[package]
    }
    assert wrong == {}
