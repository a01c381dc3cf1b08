"""A test agent (run as a process by test_approval_agent): one `record` and one `model`
call, each appending its name to the --count file when it is really made."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from holdpoint_client import Holdpoint

parser = argparse.ArgumentParser()
parser.add_argument("--thread", required=True)
parser.add_argument("--count", type=Path, required=True)
args = parser.parse_args()


def paid(kind: str, answer: int) -> Callable[[], int]:
    def call() -> int:
        with args.count.open("a") as out:
            out.write(kind + "\n")
        return answer

    return call


hp = Holdpoint.from_env(ttl=3)
with hp.run(args.thread, graph="api-review") as run:
    evidence = run.record("evidence", paid("record", 42))
    summary = run.model("summary", paid("model", 43))
    print(f"answers record={evidence} model={summary}", flush=True)
