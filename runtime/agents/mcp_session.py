"""The `mcp-session` graph: the run behind each session of the MCP gateway (gateway/).

A session's run is external: the gateway is its executor (through runtime.protocol, like
any agent running its own loop), each `tools/call` one action of the step `api`. No worker
ever executes it, so its one step only says so if something tried. Registered by the
runtime app at start-up in every process (not through HOLDPOINT_GRAPH_MODULES): the pages,
the sweeper and the API must know the graph of any run they show.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from runtime.context import StepContext
from runtime.graphs import Fail, Graph, Outcome, register

NAME = "mcp-session"
# The lease a closing takes: long enough for its two reads and its checkpoint.
CLOSE_LEASE = 5.0

graph = Graph(
    NAME,
    version="1",
    description=(
        "A session of an MCP client with Holdpoint's gateway (/mcp/<tenant>/): each "
        "tools/call is one action of this run."
    ),
)


@graph.step(start=True)
def api(ctx: StepContext) -> Outcome:
    return Fail("an mcp-session run is executed by the MCP gateway, not by a worker")


register(graph)


# --- closing a session ------------------------------------------------------------------------
# The one writer of a session's end, whoever ends it: the client (HTTP DELETE, gateway.calls)
# or the sweeper, once a session has been idle for HOLDPOINT_MCP_SESSION_IDLE_HOURS — most
# hosts never send DELETE (a desktop app that quits just stops calling), and a session left
# open would stay `queued` on the Runs pages and in the metrics for ever.


def open_calls(tenant_id: int, run_id: Any) -> bool:
    """Whether an action of the session has not had its final answer handed to the client
    (a `result_delivered` entry in the run's stream names each one that has)."""
    from audit import journal
    from audit.models import JournalEntry
    from runtime.events import RunEvent
    from runtime.models import Action

    actions = set(
        Action.objects.filter(tenant_id=tenant_id, run_id=run_id).values_list(
            "action_id", flat=True
        )
    )
    delivered = set(
        JournalEntry.objects.filter(
            stream=journal.run_stream(run_id),
            tenant_id=tenant_id,
            type=RunEvent.RESULT_DELIVERED.value,
        ).values_list("payload__action_id", flat=True)
    )
    return bool({str(a) for a in actions} - {str(d) for d in delivered})


def close(run: Any, owner: str, who: str, closed_by: str) -> bool:
    """Complete the session's run if every call of it has had its final answer delivered;
    otherwise it stays open — a call still waits for a reviewer, or a person must settle
    one — so the decision still lands and a client that comes back with the session id gets
    it. Whether the run was completed. Raises LeaseHeld while a call of it is being sent."""
    from runtime import protocol
    from runtime.models import Action

    if open_calls(run.tenant_id, run.run_id):
        return False
    lease = protocol.take(run, owner, CLOSE_LEASE, who=who)
    run.refresh_from_db()
    if open_calls(run.tenant_id, run.run_id):  # a call came in meanwhile
        protocol.release(run, lease.fence, who, owner=owner)
        return False
    calls = Action.objects.filter(tenant_id=run.tenant_id, run_id=run.run_id).count()
    # The completing checkpoint gives the lease up with it (nothing left to release).
    protocol.write_checkpoint(
        run,
        lease.fence,
        run.checkpoint_rev,
        {"calls": calls, "closed_by": closed_by},
        protocol.API_STEP,
        who,
        status="completed",
    )
    return True


def close_idle(limit: int) -> int:
    """The sweeper's part: close up to `limit` sessions nobody has used for
    HOLDPOINT_MCP_SESSION_IDLE_HOURS (0: never), oldest first — a session with a call still
    open stays, as it would for its client's DELETE. How many were closed."""
    from runtime.errors import HoldpointError
    from runtime.models import Run, RunStatus

    hours = settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS
    if not hours:
        return 0
    # Between calls a session is `queued` and holds no lease (runtime_run_idle_sessions).
    idle = Run.objects.filter(
        graph=NAME,
        status=RunStatus.QUEUED,
        updated_at__lt=timezone.now() - timedelta(hours=hours),
        external=True,
        lease_expires_at__isnull=True,
    )
    closed = 0
    for run in idle.order_by("updated_at")[:limit]:
        try:
            closed += close(run, "sweeper:mcp-idle", "sweeper", "idle")
        except HoldpointError:
            continue  # taken meanwhile (a call came in): the session is not idle
    return closed
