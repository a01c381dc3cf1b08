"""django-q2 entry points: thin wrappers; tests call the functions they wrap."""

from __future__ import annotations

from django.conf import settings

from runtime import executor, sweeper


def advance(run_id: str) -> str:
    return executor.advance_run(run_id).outcome


def sweep() -> int:
    return sweeper.sweep_for(
        settings.HOLDPOINT_SWEEP_WINDOW, settings.HOLDPOINT_SWEEP_INTERVAL, turns=True
    )


def dispatch_standalone(action_id: str) -> str:
    from runtime.compensation import dispatch_standalone as dispatch

    return dispatch(action_id).status


def close_failed_logins() -> int:
    from runtime.accounts import close_ended_failed_login_windows

    return close_ended_failed_login_windows()
