"""The DBOS Transact workflow bench/peers.py measures: 50 `@DBOS.step` calls in a row.

DBOS is a process-wide singleton: `launch()` once per process, `shutdown()` at the end.
Imported only when the bench extra is installed.
"""

from __future__ import annotations

from dbos import DBOS, DBOSConfig


@DBOS.step()
def increment(i: int) -> int:
    return i + 1


@DBOS.workflow()
def chain(steps: int) -> int:
    i = 0
    for _ in range(steps):
        i = increment(i)
    return i


def launch(system_database_url: str) -> None:
    config: DBOSConfig = {
        "name": "holdpoint-bench",
        "system_database_url": system_database_url,
        "run_admin_server": False,
        "log_level": "WARNING",
    }
    DBOS(config=config)
    DBOS.launch()


def shutdown() -> None:
    DBOS.destroy()
