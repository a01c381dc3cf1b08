"""Storage growth: bytes stored per run for a state that grows by one kilobyte per step.

Holdpoint runs `bench-grow` (bench/graphs.py); LangGraph runs the same chain with an
`operator.add` list channel (bench/peers.py). Both append the same incompressible kilobyte
strings, with a fresh seed per run so nothing is shared between runs. Bytes are measured
from the database, by difference before/after the runs:

- PostgreSQL: `pg_total_relation_size` (heap + indexes + TOAST + free-space/visibility maps)
  of the tables that hold a run — Holdpoint: runtime_run, runtime_checkpoint,
  runtime_artifact, runtime_recordedcall, audit_journalentry, audit_streamhead; LangGraph:
  checkpoints, checkpoint_blobs, checkpoint_writes;
- SQLite: the pages in use per table and its indexes from the `dbstat` virtual table
  (`SUM(pgsize)`), LangGraph in its own file (checkpoints, writes).

Several runs of each length are measured together and divided, so that page granularity
(8 KB on PostgreSQL, 4 KB on SQLite, per relation) stays small against what one run adds.
The django-q2 doorbell row a new run rings is not storage of the run and is not counted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from bench.common import log

HOLDPOINT_TABLES = (
    "runtime_run",
    "runtime_checkpoint",
    "runtime_artifact",
    "runtime_recordedcall",
    "audit_journalentry",
    "audit_streamhead",
)
LANGGRAPH_TABLES = {
    "postgres": ("checkpoints", "checkpoint_blobs", "checkpoint_writes"),
    "sqlite": ("checkpoints", "writes"),
}
RUNS = {50: 4, 200: 4}  # runs measured together per length


def final_state_bytes(steps: int, seed: str) -> int:
    """The canonical JSON size of the state both systems end with: {"i": n, "log": [...]}."""
    from audit.canonical import canonical_bytes
    from bench.graphs import kilobyte

    return len(
        canonical_bytes({"i": steps, "log": [kilobyte(seed, k) for k in range(1, steps + 1)]})
    )


def pg_sizes(cursor: Any, tables: tuple[str, ...]) -> dict[str, int]:
    cursor.execute(
        "SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'public' AND c.relkind = 'r' AND c.relname = ANY(%s)",
        [list(tables)],
    )
    return {name: int(size) for name, size in cursor.fetchall()}


def sqlite_sizes(execute: Any, tables: tuple[str, ...]) -> dict[str, int]:
    """Bytes of pages in use per table, its indexes included (dbstat)."""
    rows = execute(
        "SELECT m.tbl_name, SUM(s.pgsize) FROM dbstat s JOIN sqlite_master m ON m.name = s.name"
        " GROUP BY m.tbl_name"
    )
    sizes = {name: int(size) for name, size in rows}
    return {t: sizes.get(t, 0) for t in tables}


def settle(cursor: Any, tables: tuple[str, ...]) -> None:
    """VACUUM the tables before each size reading (both systems alike). The first one
    creates the free-space and visibility maps (three and one 8 KB pages per relation, each
    index too) that autovacuum would otherwise create at some moment during the runs — a
    one-time 30 KB or so per relation that then landed in one run's bytes (the figure moved
    by 20 KB between two runs of the same code); after it, a reading counts what the runs
    wrote. Outside a transaction (Django autocommit), as VACUUM must be."""
    for table in tables:
        cursor.execute(f'VACUUM (ANALYZE false) "{table}"')


class StorageBench:
    def __init__(self, bench: Any, langgraph: Any | None) -> None:
        self.bench = bench  # bench.run.Bench: tenant, connection, backend
        self.langgraph = langgraph

    def holdpoint_sizes(self) -> dict[str, int]:
        with self.bench.connection.cursor() as cur:
            if self.bench.pg:
                settle(cur, HOLDPOINT_TABLES)
                return pg_sizes(cur, HOLDPOINT_TABLES)

            def execute(sql: str) -> list[Any]:
                cur.execute(sql)
                return cur.fetchall()

            return sqlite_sizes(execute, HOLDPOINT_TABLES)

    def langgraph_sizes(self) -> dict[str, int]:
        tables = LANGGRAPH_TABLES[self.bench.backend]
        if self.bench.pg:
            with self.bench.connection.cursor() as cur:
                settle(cur, tables)
                return pg_sizes(cur, tables)
        conn = self.langgraph.conn
        return sqlite_sizes(lambda sql: conn.execute(sql).fetchall(), tables)

    def holdpoint_runs(self, steps: int, count: int) -> dict[str, Any]:
        from runtime.executor import advance_run
        from runtime.lifecycle import create_run
        from runtime.models import Artifact, Checkpoint, RunStatus

        seeds = [uuid.uuid4().hex for _ in range(count)]
        runs = [
            create_run(self.bench.tenant, "bench-grow", {"steps": steps, "seed": s}, actor="bench")
            for s in seeds
        ]
        before = self.holdpoint_sizes()
        artifacts_before = Artifact.objects.count()
        started = time.perf_counter()
        for run in runs:
            result = advance_run(run.run_id, "bench", slice_seconds=3600)
            run.refresh_from_db()
            if result.outcome != "completed" or run.status != RunStatus.COMPLETED:
                raise RuntimeError(f"bench-grow run did not complete: {result}")
        seconds = time.perf_counter() - started
        after = self.holdpoint_sizes()
        per_table = {t: (after[t] - before[t]) / count for t in after}
        return {
            "steps": steps,
            "runs": count,
            "bytes_per_run": sum(per_table.values()),
            "per_table": per_table,
            "checkpoints_per_run": Checkpoint.objects.filter(run__in=runs).count() / count,
            "artifacts_per_run": (Artifact.objects.count() - artifacts_before) / count,
            "final_state_bytes": final_state_bytes(steps, seeds[0]),
            "seconds_per_run": seconds / count,
        }

    def langgraph_runs(self, steps: int, count: int) -> dict[str, Any]:
        before = self.langgraph_sizes()
        started = time.perf_counter()
        finals = [self.langgraph.grow_run(steps, uuid.uuid4().hex) for _ in range(count)]
        seconds = time.perf_counter() - started
        after = self.langgraph_sizes()
        per_table = {t: (after[t] - before[t]) / count for t in after}
        return {
            "steps": steps,
            "runs": count,
            "bytes_per_run": sum(per_table.values()),
            "per_table": per_table,
            "final_state_bytes": finals[0]["final_state_bytes"],
            "seconds_per_run": seconds / count,
        }

    def go(self) -> dict[str, Any]:
        out: dict[str, Any] = {"holdpoint": {}, "langgraph": {}}
        for steps, count in RUNS.items():
            h = self.holdpoint_runs(steps, count)
            out["holdpoint"][str(steps)] = h
            line = (
                f"[{self.bench.backend}] storage {steps} steps: Holdpoint "
                f"{h['bytes_per_run'] / 1024:,.0f} KiB/run"
            )
            if self.langgraph is not None:
                g = self.langgraph_runs(steps, count)
                out["langgraph"][str(steps)] = g
                line += f", LangGraph {g['bytes_per_run'] / 1024:,.0f} KiB/run"
            log(f"{line}; final state {h['final_state_bytes'] / 1024:,.0f} KiB")
        for steps in map(str, RUNS):
            final = out["holdpoint"][steps]["final_state_bytes"]
            limit = 2 * final + 1024 * int(steps)
            out.setdefault("target", {})[steps] = {
                "final_state_bytes": final,
                "limit_bytes": limit,
                "holdpoint_over_final": out["holdpoint"][steps]["bytes_per_run"] / final,
                "langgraph_over_final": (
                    out["langgraph"][steps]["bytes_per_run"] / final
                    if steps in out["langgraph"]
                    else None
                ),
                "holdpoint_met": out["holdpoint"][steps]["bytes_per_run"] <= limit,
            }
        return out
