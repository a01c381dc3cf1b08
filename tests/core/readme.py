"""The README's code blocks, as the tests that execute them read them (issue 20).

The rule, stated in the README ("Every block here is executed"): every fenced block is
executed by the test suite unless the line right before its fence is an HTML comment saying
otherwise —

- `<!-- not-run: REASON -->`: not executed, for the reason given (production-only lines, a
  diff, a map of the tree, `make run` itself);
- `<!-- run-by: tests/… -->`: executed by that test (the graph example is registered and run
  through an approval by tests/core/test_readme_graph.py).

Every `sh` block without a comment is run by tests/core/test_run_script.py, line by line in
`bash -e`, in a new shell's environment while `make run`'s services are up, after its set-up
wrote var/local.env. Only the places are the test's own: the web's and the sandbox's ports
(8000, 8765) and `var/` are replaced by the test's ports and directory, so a test run never
touches a developer's `make run`.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[a-z]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not-run|run-by):\s*(?P<what>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # the opening fence's line (1-based), for messages
    lang: str
    text: str  # dedented by the fence's indentation
    kind: str  # "", "not-run" or "run-by"
    what: str  # the reason, or the test that runs it

    def where(self) -> str:
        return f"README.md:{self.line} ({self.lang or 'plain'})"


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of the file with the comment before it, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(before)
        indent = opened["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = textwrap.dedent("\n".join(lines[i + 1 : end]))
        found.append(
            Block(
                line=i + 1,
                lang=opened["lang"],
                text=body + "\n",
                kind=marker["kind"] if marker else "",
                what=marker["what"] if marker else "",
            )
        )
        assert len(indent) % 2 == 0, f"README.md:{i + 1}: odd fence indentation"
        i = end + 1
    return found


def shell_blocks(path: Path = README) -> list[Block]:
    """The `sh` blocks the shell test runs: those without a comment."""
    return [b for b in blocks(path) if b.lang == "sh" and not b.kind]


def localise(text: str, *, web_port: int, sandbox_port: int, var_dir: Path) -> str:
    """The block with the test's own places for the web, the sandbox and var/."""
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{web_port}")
    text = text.replace("127.0.0.1:8765", f"127.0.0.1:{sandbox_port}")
    return re.sub(r"(?<![\w./-])var/", f"{var_dir}/", text)
