"""`manage.py sandbox_tasks` on a port something already listens on: a first-hour user runs
the examples README's sandbox line beside `make run`, which already serves one on 8765."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

pytestmark = pytest.mark.ci_database("sqlite")  # no database: one of CI's suites is enough


def test_a_busy_port_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"port {port} is already in use") as raised:
            call_command("sandbox_tasks", "--port", str(port), "--data", str(tmp_path / "t.db"))
    assert "make run" in str(raised.value) and "--port" in str(raised.value)
