"""Fault points are one enum, and the environment that arms them is checked against it.

A crash test armed with a misspelt point would otherwise arm nothing: the worker never
dies, and a test that expects "recovered after the crash" passes with no crash at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from runtime.faults import FaultPoint, points_from
from tests import procs

RUNTIME = Path(settings.BASE_DIR) / "runtime"


def test_points_are_parsed_into_the_enum() -> None:
    env = {"HOLDPOINT_FAULTS": " after_prepare, ,during_reconcile,"}
    assert points_from("HOLDPOINT_FAULTS", env) == {
        FaultPoint.AFTER_PREPARE,
        FaultPoint.DURING_RECONCILE,
    }
    assert points_from("HOLDPOINT_FAULTS", {}) == frozenset()


def test_an_unknown_point_fails_loudly_with_the_valid_ones() -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        points_from("HOLDPOINT_PAUSE", {"HOLDPOINT_PAUSE": "after_sent_mark,after_prepar"})
    message = str(refused.value)
    assert "HOLDPOINT_PAUSE" in message and "'after_prepar'" in message
    assert all(point.value in message for point in FaultPoint)


def _fault_calls() -> list[tuple[str, ast.expr]]:
    """Every `fault(...)` call in the runtime package, with where it is."""
    found = []
    for path in sorted(RUNTIME.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "fault"
            ):
                found.append((f"{path.relative_to(RUNTIME)}:{node.lineno}", node.args[0]))
    return found


def test_every_point_is_reached_in_the_code_and_every_call_names_a_point() -> None:
    calls = _fault_calls()
    named: set[str] = set()
    for where, arg in calls:
        is_member = (
            isinstance(arg, ast.Attribute)
            and isinstance(arg.value, ast.Name)
            and arg.value.id == "FaultPoint"
        )
        assert is_member, f"{where}: fault() takes a FaultPoint member, not {ast.unparse(arg)}"
        assert isinstance(arg, ast.Attribute)
        named.add(arg.attr)
    assert named == {point.name for point in FaultPoint}


@pytest.mark.slow
def test_a_worker_armed_with_a_typo_does_not_start(tmp_path: Path) -> None:
    """At start, not when the point would have been reached: `manage.py` fails at once."""
    env = procs.child_env(HOLDPOINT_FAULTS="after_chekpoint")
    done = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=settings.BASE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "unknown fault point(s) 'after_chekpoint'" in done.stderr
    assert "after_checkpoint" in done.stderr.rpartition("valid points:")[2]
