"""Every code block of the README is executed by a test or says why not (tests/core/readme.py
has the rule). Fast and without a database: a new block fails here at once, before the slow
test that runs the shell blocks against `make run` (tests/core/test_run_script.py)."""

from __future__ import annotations

import subprocess

from tests.core.readme import ROOT, blocks, localise, shell_blocks


def test_every_block_is_run_or_says_why_not() -> None:
    unclaimed = [b.where() for b in blocks() if not b.kind and b.lang != "sh"]
    assert not unclaimed, (
        f"README blocks no test runs: {unclaimed}; run them in a test and put "
        "<!-- run-by: tests/... --> before the fence, or <!-- not-run: why -->"
    )


def test_each_run_by_names_a_test_that_reads_the_readme() -> None:
    claimed = [b for b in blocks() if b.kind == "run-by"]
    assert claimed, "the graph example is run by tests/core/test_readme_graph.py"
    for block in claimed:
        test = ROOT / block.what
        assert test.is_file(), f"{block.where()}: {block.what} does not exist"
        assert "README" in test.read_text(), f"{block.where()}: {block.what} never reads it"


def test_the_shell_blocks_are_bash() -> None:
    """Each block the shell test runs parses as bash (placeholders such as `[--name ci]` or
    `hpt_…` would be typed literally by a reader: they belong in the prose)."""
    run = shell_blocks()
    assert len(run) >= 3, [b.where() for b in run]
    for block in run:
        text = localise(block.text, web_port=8000, sandbox_port=8765, var_dir=ROOT / "var")
        checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, (block.where(), checked.stderr)
        assert "…" not in text and "[--" not in text, f"{block.where()}: a placeholder"
