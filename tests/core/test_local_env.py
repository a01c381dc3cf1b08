"""VAR_DIR/local.env: local manage.py commands work with no variable set (issue 20).

`make run` writes the file (DEBUG=1, a generated SECRET_KEY); manage.py fills in from it the
variables the environment does not set. Production is untouched: without the file, or with
DEBUG=0 in its environment, or started through config.wsgi, a process without real secrets
still refuses to start with the EnvError that names the variable. Each case runs
manage.py in a clean environment (PATH and HOME only, as `env -i` would give).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from config.env import EnvError, load_local_env, read_env_file

ROOT = Path(__file__).resolve().parents[2]
KEY = "local-" + "k3y" * 20
SHOW = "from django.conf import settings; print(settings.DEBUG, settings.SECRET_KEY)"


def run(args: list[str], var_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    clean.update(HOLDPOINT_VAR_DIR=str(var_dir), **env)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=clean, capture_output=True, text=True, timeout=120
    )


def manage(var_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run(["manage.py", *args], var_dir, **env)


@pytest.fixture
def var_dir(tmp_path: Path) -> Path:
    """A VAR_DIR with the file `make run` writes."""
    var = tmp_path / "var"
    var.mkdir()
    (var / "local.env").write_text(f"# written by make run\n\nDEBUG=1\nSECRET_KEY={KEY}\n")
    (var / "local.env").chmod(0o600)
    return var


def test_manage_py_reads_the_local_file(var_dir: Path) -> None:
    shown = manage(var_dir, "shell", "-c", SHOW)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split()[-2:] == ["True", KEY]
    assert manage(var_dir, "check").returncode == 0


def test_the_environment_wins_over_the_file(var_dir: Path) -> None:
    shown = manage(var_dir, "shell", "-c", SHOW, SECRET_KEY="from-the-environment-" + "x" * 40)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.split()[-2:] == ["True", "from-the-environment-" + "x" * 40]


def test_without_the_file_production_still_refuses_to_start(tmp_path: Path) -> None:
    started = manage(tmp_path, "check")
    assert started.returncode != 0
    assert "EnvError: SECRET_KEY is required when DEBUG is off" in started.stderr


def test_debug_off_in_the_environment_ignores_the_file(var_dir: Path) -> None:
    """A process started as production never borrows a developer's key."""
    started = manage(var_dir, "check", DEBUG="0")
    assert started.returncode != 0
    assert "EnvError: SECRET_KEY is required when DEBUG is off" in started.stderr


def test_the_web_entry_point_does_not_read_it(var_dir: Path) -> None:
    """`uvicorn config.asgi:application` (and config.wsgi) is production: its settings come
    from its environment alone."""
    for module in ("config.asgi", "config.wsgi"):
        started = run(["-c", f"import {module}"], var_dir)
        assert started.returncode != 0
        assert "EnvError: SECRET_KEY is required when DEBUG is off" in started.stderr


def test_a_malformed_line_names_the_file_and_line(var_dir: Path) -> None:
    (var_dir / "local.env").write_text("DEBUG=1\nexport SECRET_KEY\n")
    started = manage(var_dir, "check")
    assert started.returncode != 0
    assert f"EnvError: {var_dir / 'local.env'}:2: expected NAME=value" in started.stderr


def test_load_fills_in_only_what_is_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "local.env"
    path.write_text("HP_TEST_A=from-file\nHP_TEST_B = spaced = value \n")
    monkeypatch.setenv("HP_TEST_A", "from-env")
    monkeypatch.delenv("HP_TEST_B", raising=False)
    monkeypatch.delenv("DEBUG", raising=False)
    assert read_env_file(path) == {"HP_TEST_A": "from-file", "HP_TEST_B": "spaced = value"}
    try:
        assert load_local_env(path) == ["HP_TEST_B"]
        assert os.environ["HP_TEST_A"] == "from-env"
        assert os.environ["HP_TEST_B"] == "spaced = value"
    finally:
        os.environ.pop("HP_TEST_B", None)
    assert load_local_env(tmp_path / "missing.env") == []
    with pytest.raises(EnvError, match="local.env:1"):
        path.write_text("1BAD=x\n")
        read_env_file(path)
