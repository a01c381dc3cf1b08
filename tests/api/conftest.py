"""The live-event tests' web server (tests/api/test_live_*.py): one real uvicorn per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import procs
from tests.api.live import LIVE_CLIENTS, web_server


@pytest.fixture(scope="module")
def server(
    django_db_setup: None, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[procs.Child, str]]:
    """One real web server for the module (the database is emptied between tests, the server
    keeps no state of its own): its process and base URL. One token opens all of
    test_200_stream_clients_hold_on_postgresql's streams: it may hold that many open."""
    log = tmp_path_factory.mktemp("web") / "web.log"
    streams = {"HOLDPOINT_STREAMS_PER_TOKEN": str(LIVE_CLIENTS + 10)}
    with web_server(django_db_blocker, log, **streams) as found:
        yield found


@pytest.fixture
def web(server: tuple[procs.Child, str]) -> str:
    return server[1]
