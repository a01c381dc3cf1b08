"""The core client stays free of the optional frameworks."""

from __future__ import annotations

import subprocess
import sys

from tests import procs


def test_importing_the_client_imports_no_langgraph() -> None:
    check = (
        "import sys, holdpoint_client; "
        "loaded = {m.split('.')[0] for m in sys.modules}; "
        "print(sorted(loaded & {'langgraph', 'langchain', 'langchain_core'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=procs.ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
