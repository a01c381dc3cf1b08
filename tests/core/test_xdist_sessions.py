"""Under pytest-xdist (`-n 2`, as CI runs each suite) every worker is a session of its own:
its own scratch directory and metrics directory, never the controller's shared with the
other worker (one worker's steps then showed up in the other's /metrics scrape). Checked by
running pytest itself with two workers on a small test file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

SAMPLE = """
import json
import os

from django.conf import settings


def test_where_this_session_keeps_its_files():
    out = os.path.join(os.environ["XDIST_SAMPLE_OUT"], os.environ["PYTEST_XDIST_WORKER"])
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "var": str(settings.VAR_DIR),
                "metrics": settings.PROMETHEUS_MULTIPROC_DIR,
                "metrics_env": os.environ["PROMETHEUS_MULTIPROC_DIR"],
                "database": settings.DATABASES["default"]["TEST"].get("NAME"),
            },
            f,
        )
"""


# Its sample runs on SQLite whatever the suite's database: CI's pair runs it once.
@pytest.mark.ci_database("sqlite")
def test_each_xdist_worker_keeps_its_own_directories(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "out"
    out.mkdir()
    inherited = ("HOLDPOINT_VAR_DIR", "PROMETHEUS_MULTIPROC_DIR", "DATABASE_URL")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in inherited and not k.startswith(("PYTEST_XDIST", "HOLDPOINT_CI"))
    }
    env.update(PYTHONPATH=str(procs.ROOT), XDIST_SAMPLE_OUT=str(out))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"),
            *("--ds", "config.settings_test", "-n", "2", "--dist", "each", str(tmp_path)),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(seen) == {"gw0", "gw1"}, seen
    controllers = {Path(s["var"]).parent for s in seen.values()}
    assert len(controllers) == 1  # both under the controller's session-<pid>/
    (controller,) = controllers
    assert controller.parent == procs.ROOT / "var" / "test"
    assert controller.name.startswith("session-")
    for worker, where in seen.items():
        assert Path(where["var"]) == controller / worker
        assert where["metrics"] == where["metrics_env"] == str(controller / worker / "metrics")
    assert seen["gw0"]["database"] != seen["gw1"]["database"]
    # (The suite's own conftest removes a green session's directory; this sample has none.)
    shutil.rmtree(controller, ignore_errors=True)
