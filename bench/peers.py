"""The peers, measured in the same process and the same interleaved rounds as Holdpoint:

- LangGraph: a 50-node chain (`n0 → n1 → … → n49`, each node `i + 1`) compiled with the
  SqliteSaver (its own file, WAL as the saver sets it, `synchronous=FULL` as ours) or the
  PostgresSaver (psycopg 3, `from_conn_string`'s connection: autocommit, the server's
  defaults), invoked with `durability="sync"`: every superstep's checkpoint is written
  before the next step starts — Holdpoint's normal mode.
- DBOS Transact: a workflow of 50 `@DBOS.step` calls (each `i + 1`), its system database a
  scratch PostgreSQL database (or, on the SQLite backend, a WAL file in the temp dir).
- LangGraph's storage: the same chain with `log: Annotated[list[str], operator.add]`, each
  node appending `bench.graphs.kilobyte(seed, i)` — the state bench-grow builds.

Every figure is per step of a 50-step run; a run that does not end with i == 50 fails the
benchmark.
"""

from __future__ import annotations

import contextlib
import operator
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, TypedDict

from bench.common import log
from bench.graphs import kilobyte


def available() -> dict[str, str]:
    """Installed peer packages and their versions ({} when the bench extra is missing)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in (
        "langgraph",
        "langgraph-checkpoint-sqlite",
        "langgraph-checkpoint-postgres",
        "dbos",
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


class ChainState(TypedDict):
    i: int


class GrowState(TypedDict):
    i: int
    log: Annotated[list[str], operator.add]


def _chain(state_type: type, node: Any, steps: int) -> Any:
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(state_type)
    names = [f"n{k}" for k in range(steps)]
    for name in names:
        graph.add_node(name, node)
    graph.add_edge(START, names[0])
    for a, b in zip(names, names[1:], strict=False):
        graph.add_edge(a, b)
    graph.add_edge(names[-1], END)
    return graph


def _step(state: ChainState) -> dict[str, int]:
    return {"i": state["i"] + 1}


class LangGraphBench:
    """One saver on the backend; the no-op chain and the growing chain share it."""

    def __init__(self, backend: str, target: str, steps: int) -> None:
        """`target`: the SQLite file, or the PostgreSQL URL of the bench database."""
        self.backend = backend
        self.steps = steps
        self.stack = contextlib.ExitStack()
        if backend == "sqlite":
            from langgraph.checkpoint.sqlite import SqliteSaver

            self.path = Path(target)
            conn = sqlite3.connect(str(self.path), check_same_thread=False)
            self.stack.callback(conn.close)
            self.saver = SqliteSaver(conn)
            self.saver.setup()  # journal_mode=WAL
            conn.execute("PRAGMA synchronous=FULL")  # the default; said out loud, as ours
            self.conn = conn
            self.settings = {
                "journal_mode": conn.execute("PRAGMA journal_mode").fetchone()[0],
                "synchronous": conn.execute("PRAGMA synchronous").fetchone()[0],
            }
        else:
            from langgraph.checkpoint.postgres import PostgresSaver

            self.saver = self.stack.enter_context(PostgresSaver.from_conn_string(target))
            self.saver.setup()
            self.settings = {"connection": "from_conn_string (autocommit, prepare_threshold=0)"}
        self.chain = _chain(ChainState, _step, steps).compile(checkpointer=self.saver)
        self.grow_seed = "bench"

    def close(self) -> None:
        self.stack.close()

    def once(self) -> dict[str, float]:
        config = {"configurable": {"thread_id": str(uuid.uuid4())}}
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = self.chain.invoke({"i": 0}, config, durability="sync")
        t1, cpu1 = time.perf_counter(), time.process_time()
        if out.get("i") != self.steps:
            raise RuntimeError(f"LangGraph chain ended with {out}, not i={self.steps}")
        return {"seconds": t1 - t0, "cpu": cpu1 - cpu0}

    def flush_stats(self) -> None:
        """Have the saver's backend publish its pending statistics now (PostgreSQL)."""
        if self.backend == "postgres":
            self.saver.conn.execute("SELECT pg_stat_force_next_flush()")

    def grow_run(self, steps: int, seed: str) -> dict[str, Any]:
        """One run of the growing chain; returns its final state's size (canonical JSON)."""
        from audit.canonical import canonical_bytes

        def append(state: GrowState) -> dict[str, Any]:
            i = state["i"] + 1
            return {"i": i, "log": [kilobyte(seed, i)]}

        app = _chain(GrowState, append, steps).compile(checkpointer=self.saver)
        config = {"configurable": {"thread_id": f"grow-{seed}"}}
        out = app.invoke({"i": 0, "log": []}, config, durability="sync")
        if out["i"] != steps or len(out["log"]) != steps:
            raise RuntimeError(f"LangGraph growing chain ended with i={out['i']}")
        return {"final_state_bytes": len(canonical_bytes({"i": out["i"], "log": out["log"]}))}


class DbosBench:
    """DBOS Transact launched once in this process (it is a singleton) on its own system
    database; `once()` runs the 50-step workflow."""

    def __init__(self, system_database_url: str, steps: int) -> None:
        from bench import dbos_app

        self.steps = steps
        self.app = dbos_app
        started = time.perf_counter()
        dbos_app.launch(system_database_url)
        self.launch_seconds = time.perf_counter() - started
        log(f"DBOS launched in {self.launch_seconds:.1f}s on {system_database_url.split('@')[-1]}")

    def once(self) -> dict[str, float]:
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = self.app.chain(self.steps)
        t1, cpu1 = time.perf_counter(), time.process_time()
        if out != self.steps:
            raise RuntimeError(f"DBOS workflow returned {out}, not {self.steps}")
        return {"seconds": t1 - t0, "cpu": cpu1 - cpu0}

    def close(self) -> None:
        self.app.shutdown()


def prepare_sqlite_wal(path: Path) -> None:
    """DBOS opens SQLite in its default rollback-journal mode; put the file in WAL first
    (the mode is stored in the file) so it has the durability settings ours has."""
    conn = sqlite3.connect(str(path))
    try:
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()
