"""Settings for the test suite: the product's settings with testing switches on."""

import os

os.environ.setdefault("HOLDPOINT_TESTING", "1")
os.environ.setdefault("HOLDPOINT_LEASE_TTL", "5")
os.environ.setdefault("SECURE_SSL_REDIRECT", "0")
os.environ.setdefault("HOLDPOINT_HEARTBEAT_THREAD", "0")
os.environ.setdefault("HOLDPOINT_GRAPH_MODULES", "runtime.agents.api_review.graph,tests.graphs")
# The built-in task tracker tools, pointed at a sandbox (tests start their own and set it).
os.environ.setdefault("HOLDPOINT_TASKS_URL", "http://127.0.0.1:8765")
os.environ.setdefault("ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")
# Tools may call the sandbox tracker and the tests' own servers on this machine.
os.environ.setdefault("HOLDPOINT_TOOL_HOSTS", "127.0.0.1,localhost")
os.environ.setdefault("HOLDPOINT_TOOL_PRIVATE_NETWORKS", "127.0.0.0/8,::1/128")
# A test session's metrics directory meets every tool the suite names: a test that reads one
# tool's series must not find it under `_other` because others ran first. The tests of the
# bound set their own (tests/ops/test_metrics_tool_label.py).
os.environ.setdefault("HOLDPOINT_METRICS_TOOL_LABELS", "10000")
# Tests keep their SQLite files and worker heartbeats apart from a running `make run`.
# One directory per test session (its worker processes are told to use the same one), so
# concurrent test runs on a machine never see each other's files or worker heartbeats.
os.environ.setdefault(
    "HOLDPOINT_VAR_DIR",
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "var",
        "test",
        f"session-{os.getpid()}",
    ),
)
# Under pytest-xdist each worker is a session of its own: the controller's directory (its
# environment is inherited) gets one subdirectory per worker. Processes the worker starts
# are handed that subdirectory (tests/procs.child_env) and keep it.
# What the controller's settings derived from its directory goes with it (a shared metrics
# directory would add one worker's observations to another's scrapes).
_xdist = os.environ.get("PYTEST_XDIST_WORKER", "")
if _xdist and os.path.basename(os.environ["HOLDPOINT_VAR_DIR"]) != _xdist:
    _controller = os.environ["HOLDPOINT_VAR_DIR"]
    os.environ["HOLDPOINT_VAR_DIR"] = os.path.join(_controller, _xdist)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") == os.path.join(_controller, "metrics"):
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]

from config.settings import *  # noqa: E402,F403

# WhiteNoise finds a static file when one is asked for, as it does under DEBUG, instead of
# listing every file of every finder (the admin's, DRF's, Swagger UI's) each time its
# middleware is made: Django's test client makes the middleware anew for every Client, and
# that listing took 6% of the test processes' time (py-spy over CI's pair). What is served is
# the same; production still lists STATIC_ROOT once, at start.
WHITENOISE_AUTOREFRESH = True
