"""django-q2 entry points: thin wrappers; tests call the functions they wrap.

Each is one task of a worker process that runs task after task in one thread, so each runs in
its own log scope (`logs.scope`): what it binds — a run's lease, an action — labels its own
lines and none after it (django-q2's "processing …" of the next task, another run's send).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import ParamSpec, TypeVar

from django.conf import settings

from runtime import executor, logs, sweeper

P = ParamSpec("P")
R = TypeVar("R")


def task(fn: Callable[P, R]) -> Callable[P, R]:
    """One queue task: it starts with nothing bound and leaves nothing behind."""

    @wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with logs.scope():
            return fn(*args, **kwargs)

    return run


@task
def advance(run_id: str) -> str:
    return executor.advance_run(run_id).outcome


@task
def sweep() -> int:
    return sweeper.sweep_for(
        settings.HOLDPOINT_SWEEP_WINDOW, settings.HOLDPOINT_SWEEP_INTERVAL, turns=True
    )


@task
def dispatch_standalone(action_id: str) -> str:
    from runtime.compensation import dispatch_standalone as dispatch

    return dispatch(action_id).status


@task
def close_failed_logins() -> int:
    from runtime.accounts import close_ended_failed_login_windows

    return close_ended_failed_login_windows()
