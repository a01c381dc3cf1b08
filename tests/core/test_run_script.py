"""`make run` as a person uses it: started in a terminal, stopped with Ctrl-C (issue 20).

scripts/run.sh runs in a pseudo-terminal of its own, as the foreground process group, and
the test types Ctrl-C into it: the terminal turns that into SIGINT for the foreground group,
exactly as a user's keypress does. It must then stop the web, the worker cluster (all its
processes) and the sandbox, and exit, within a few seconds — a django-q2 cluster whose whole
process group gets SIGTERM hangs for minutes (NOTES.md). Every process the script started is
found by a marker in its environment (its own HOLDPOINT_VAR_DIR), so one that outlived its
parent is found too.

While the services are up, every `sh` block of the README runs in a new shell
(tests/core/readme.py has the rule and the few blocks marked not-run): the README's commands
are executed as written, and one that breaks fails this test.

The same run shows the local settings file at work: `make run` writes VAR_DIR/local.env
(DEBUG=1, a generated SECRET_KEY, mode 600) and keeps its key on the next start, and the
README's manage.py lines then work in a clean shell with nothing else set.
"""

from __future__ import annotations

import os
import pty
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from tests.core.readme import localise, shell_blocks
from tests.pg_guard import on_postgres
from tests.procs import free_port, owns_port, wait_for

# `make run` is SQLite by definition: the script, its services and the README's commands
# run in a clean environment (`clean_env`: no DATABASE_URL) on their own VAR_DIR's SQLite,
# never on the database under test — so the PostgreSQL run would repeat the SQLite run's
# test exactly (~40 s of CI's PostgreSQL suite under contention, for nothing it could see).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        on_postgres(),
        reason="make run is SQLite by definition and ignores DATABASE_URL; "
        "the SQLite run covers it",
    ),
]
ROOT = Path(__file__).resolve().parents[2]
# Generous for a shared 2-core machine; the script's own bound is STOP_GRACE (3 s) per stop.
STOP_BOUND = 15.0


def clean_env(**extra: str) -> dict[str, str]:
    """A new shell's environment: nothing of the test settings leaks in."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    env.update(extra)
    return env


def marked(marker: str) -> dict[int, str]:
    """pid → command line of every process whose environment carries `marker`."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if marker.encode() in environ:
                found[int(entry.name)] = (
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                )
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


class Terminal:
    """scripts/run.sh in a pseudo-terminal: its output collected, Ctrl-C typed into it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        # setsid -c: a new session whose controlling terminal is the pty (stdin), with the
        # script's process group in the foreground — as a login shell starts a command.
        self.proc = subprocess.Popen(
            ["setsid", "-c", "bash", "scripts/run.sh"],
            cwd=ROOT,
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            close_fds=True,
            # A person's terminal delivers SIGINT; a test run started in the background of a
            # non-interactive shell (as .ci/run does) has it ignored, and bash cannot trap a
            # signal ignored on entry. Start the script as a login shell would.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        os.close(slave)
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: every holder of the terminal has closed it
                return
            if not data:
                return
            self.chunks.append(data)

    @property
    def output(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.reader.join(timeout=5)
        os.close(self.master)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def var_dir(tmp_path: Path) -> Iterator[Path]:
    """The script's own VAR_DIR; whatever it started is SIGKILLed after the test, pass or
    fail, so a broken stop cannot leave a worker running on the machine."""
    var = tmp_path / "var"
    try:
        yield var
    finally:
        for pid in marked(f"HOLDPOINT_VAR_DIR={var}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class PortTaken(Exception):
    """A port picked for `make run` was another process's by the time a service bound it."""


def held(marker: str, port: int) -> bool:
    """Whether one of the processes the script started listens on `port`."""
    return any(owns_port(pid, port) for pid in marked(marker))


def start_and_stop(
    env: dict[str, str],
    marker: str,
    web: str,
    *,
    presses: int = 1,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[float, float, str]:
    """Start run.sh, wait for the site and the worker's heartbeat, call `meanwhile`, type
    Ctrl-C (`presses` times, a moment apart, as an impatient person does); the seconds until
    the script exited and until the last process it started was gone, and its output.

    PortTaken when a port picked for it was taken first (by CI's other suite, running
    beside this one): a service could not bind it ("address already in use") and the
    script stopped everything it had started. Until both ports are held by the script's own
    processes, an answer on the web port may be another server's and counts for nothing."""
    terminal = Terminal(env)
    ports = int(env["HOLDPOINT_WEB_PORT"]), int(env["HOLDPOINT_SANDBOX_PORT"])

    def exited() -> bool:
        if terminal.proc.poll() is None:
            return False
        if "address already in use" in terminal.output.lower():  # uvicorn's, the sandbox's
            raise PortTaken(terminal.output[-2000:])
        return True

    def ours() -> bool:
        return all(held(marker, port) for port in ports)

    try:
        try:
            wait_for(lambda: answers(f"{web}/healthz") or exited(), 240)
            wait_for(lambda: (answers(f"{web}/readyz") and ours()) or exited(), 60)
        except PortTaken:
            wait_for(lambda: not marked(marker), 60, every=0.05)  # before another start
            raise
        assert terminal.proc.poll() is None, terminal.output
        started = marked(marker)
        commands = " | ".join(started.values())
        for part in ("scripts/run.sh", "sandbox_tasks", "qcluster", "serve"):
            assert part in commands, commands
        assert len(started) >= 6, commands  # bash, sandbox, web, cluster main + workers
        if meanwhile is not None:
            meanwhile()

        pressed = time.monotonic()
        terminal.ctrl_c()
        for _ in range(presses - 1):
            time.sleep(0.3)  # while the script is stopping its services
            terminal.ctrl_c()
        terminal.proc.wait(timeout=60)
        exited = time.monotonic() - pressed
        wait_for(lambda: not marked(marker), 60, every=0.05)
        gone = time.monotonic() - pressed
        assert terminal.proc.returncode == 130, terminal.output  # stopped by Ctrl-C
        assert "Stopping Holdpoint" in terminal.output
        return exited, gone, terminal.output
    finally:
        terminal.close()


def run_readme_shell_blocks(var_dir: Path, web_port: int, sandbox_port: int) -> None:
    """Every `sh` block of the README (tests/core/readme.py says which), each in `bash -e`
    in a new shell — `.venv` activated, nothing else set but the place of var/ — while
    `make run`'s services are up: a line that fails fails the test, naming the block."""
    shell = clean_env(HOLDPOINT_VAR_DIR=str(var_dir))
    shell["PATH"] = f"{ROOT / '.venv' / 'bin'}:{shell.get('PATH', '/usr/bin:/bin')}"
    shell["VIRTUAL_ENV"] = str(ROOT / ".venv")
    ran = []
    for block in shell_blocks():
        script = localise(block.text, web_port=web_port, sandbox_port=sandbox_port, var_dir=var_dir)
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", script],
            cwd=ROOT,
            env=shell,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert done.returncode == 0, (block.where(), script, done.stdout, done.stderr)
        ran.append((block, done.stdout))
    # What the blocks did is there to see: the run the agent started over the API, the
    # tools imported and exported, the tokens issued and revoked.
    outputs = "\n".join(out for _, out in ran)
    assert '"graph":"api-review"' in outputs.replace(" ", ""), outputs
    assert (var_dir / "demo-tools.json").is_file()
    # The MCP gateway's example: a session listed the demo's tools and its call is held.
    assert "tool tasks.create: " in outputs and "result PENDING: " in outputs, outputs
    print(f"README: {len(ran)} shell blocks ran: {', '.join(b.where() for b, _ in ran)}")


def on_free_ports(
    var_dir: Path,
    *,
    presses: int = 1,
    meanwhile: Callable[[int, int], None] | None = None,
) -> tuple[float, float, str]:
    """`start_and_stop` on a web and a sandbox port picked free — again on others, up to
    three times, if one was taken first (PortTaken). `meanwhile` gets the two ports."""
    last: PortTaken | None = None
    for _ in range(3):
        web_port, sandbox_port = free_port(), free_port()
        env = clean_env(
            HOLDPOINT_VAR_DIR=str(var_dir),
            HOLDPOINT_WEB_PORT=str(web_port),
            HOLDPOINT_SANDBOX_PORT=str(sandbox_port),
            HOLDPOINT_DEMO_PASSWORD="demo-password-for-the-test",
            # The README's MCP call waits for a reviewer nobody is: 2 s, not 30, before PENDING.
            HOLDPOINT_MCP_WAIT_SECONDS="2",
            TERM="dumb",
        )
        try:
            return start_and_stop(
                env,
                f"HOLDPOINT_VAR_DIR={var_dir}",
                f"http://127.0.0.1:{web_port}",
                presses=presses,
                meanwhile=None if meanwhile is None else partial(meanwhile, web_port, sandbox_port),
            )
        except PortTaken as taken:
            last = taken
    raise AssertionError(f"three pairs of free ports were taken first: {last}")


def test_ctrl_c_stops_everything_make_run_started(var_dir: Path) -> None:
    # README line in a new shell: `make run`'s setup (its SQLite, its worker) passes doctor.
    shell = clean_env(HOLDPOINT_VAR_DIR=str(var_dir))

    def doctor() -> None:
        done = subprocess.run(
            [".venv/bin/python", "manage.py", "doctor"],
            cwd=ROOT,
            env=shell,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        said = done.stdout.strip().splitlines()
        # The demo tenants keep some write tools held by default: said as warnings only.
        assert not [line for line in said if not line.startswith("WARNING ")][:-1], said
        assert said[-1].endswith(("checks pass.", "no errors, 1 warning(s).")), said

    def while_up(web_port: int, sandbox_port: int) -> None:
        doctor()
        run_readme_shell_blocks(var_dir, web_port, sandbox_port)

    exited, gone, output = on_free_ports(var_dir, meanwhile=while_up)
    killed = "Killed after" in output  # the grace ran out: a group was SIGKILLed
    print(
        f"first start: Ctrl-C → exited in {exited:.2f} s, all gone in {gone:.2f} s, "
        f"{'killed' if killed else 'stopped by themselves'}"
    )
    assert exited < STOP_BOUND and gone < STOP_BOUND, output

    local_env = var_dir / "local.env"
    assert stat.S_IMODE(local_env.stat().st_mode) == 0o600
    lines = local_env.read_text().splitlines()
    assert "DEBUG=1" in lines
    (key,) = [line for line in lines if line.startswith("SECRET_KEY=")]
    assert len(key) > len("SECRET_KEY=") + 50

    # README lines in a new shell: nothing but the place of var/ (this test's own).
    issued = subprocess.run(
        [".venv/bin/python", "manage.py", "agent_token", "issue", "demo-agent"],
        cwd=ROOT,
        env=shell,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert issued.returncode == 0, issued.stderr
    assert issued.stdout.strip().splitlines()[-1].startswith("hpt_")
    for line in (["agent_token", "list", "demo-agent"], ["check_migrations"], ["audit_verify"]):
        done = subprocess.run(
            [".venv/bin/python", "manage.py", *line],
            cwd=ROOT,
            env=shell,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, (line, done.stdout, done.stderr)

    # Started again: the same key (sessions, signed anchors and the credentials' derived
    # keys survive a restart), and the same clean stop, even with Ctrl-C pressed twice.
    exited, gone, output = on_free_ports(var_dir, presses=2)
    killed = "Killed after" in output  # the grace ran out: a group was SIGKILLed
    print(
        f"second start: Ctrl-C → exited in {exited:.2f} s, all gone in {gone:.2f} s, "
        f"{'killed' if killed else 'stopped by themselves'}"
    )
    assert exited < STOP_BOUND and gone < STOP_BOUND, output
    assert [line for line in local_env.read_text().splitlines() if "SECRET_KEY" in line] == [key]
