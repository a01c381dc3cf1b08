"""The `mcp-session` graph: the run behind each session of the MCP gateway (gateway/).

A session's run is external: the gateway is its executor (through runtime.protocol, like
any agent running its own loop), each `tools/call` one action of the step `api`. No worker
ever executes it, so its one step only says so if something tried. Registered by the
runtime app at start-up in every process (not through HOLDPOINT_GRAPH_MODULES): the pages,
the sweeper and the API must know the graph of any run they show.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, QuerySet

from runtime.context import StepContext
from runtime.errors import HoldpointError
from runtime.graphs import Fail, Graph, Outcome, register
from runtime.leases import db_now_plus, lease_free
from runtime.models import FINISHED, Action, ActionStatus, Run

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
    # A call rejected at expiry is answered REJECTED to its host like any rejection.
    final_expiry_needs_attention=False,
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
    if open_calls(run.tenant_id, run.run_id):
        return False
    return _close(run, owner, who, closed_by, lambda: open_calls(run.tenant_id, run.run_id))


# A call in one of these is still on its way to an outcome — a reviewer, the executor's
# reconciliation, a person — and keeps even an idle session open: what they decide must be
# able to land, and be handed to a client that comes back.
STILL_OPEN = (
    ActionStatus.AWAITING_APPROVAL,
    ActionStatus.SENT,
    ActionStatus.UNKNOWN,
    ActionStatus.MANUAL_REVIEW,
)
IDLE_OWNER = "sweeper:mcp-idle"


def close_idle(limit: int) -> int:
    """The sweeper's part: close up to `limit` sessions nobody has used for
    HOLDPOINT_MCP_SESSION_IDLE_HOURS (0: never), oldest first. How many were closed.

    Its client is gone, so what DELETE waits for (every final answer handed over) will not
    come: a call decided after its client stopped asking — approved, rejected, expired — is
    closed with the session (the ledger keeps its outcome), one approved or prepared but
    never sent is withdrawn (only the client sends it, and it will not). A session with a
    call still on its way (STILL_OPEN) stays, and is not even looked at: the oldest of those
    must not take every turn's `limit` and keep the others open for ever."""
    hours = settings.HOLDPOINT_MCP_SESSION_IDLE_HOURS
    if not hours:
        return 0
    # Between calls a session is `queued`, but not only: a gateway that died holding the
    # lease leaves it `needs_attention` (executor_lost, runtime.sweeper), and nobody comes
    # back for that one either. Any unfinished session whose lease is free (none, or a dead
    # one: the close's takeover settles what it left) is a candidate; what may still be on
    # its way (STILL_OPEN) keeps it. The exclude is runtime_run_mcp_open_sessions' own condition.
    idle = (
        Run.objects.filter(
            lease_free(),
            graph=NAME,
            # By the database's clock, as leases and the protocol's writes of updated_at are:
            # a process whose clock runs ahead must not close sessions still in use.
            updated_at__lt=db_now_plus(-hours * 3600.0),
            external=True,
        )
        .exclude(status__in=FINISHED)
        .exclude(Exists(_still_open().filter(run_id=OuterRef("pk"))))
    )
    closed = 0
    for run in idle.order_by("updated_at")[:limit]:
        # Under the lease, again: a call may have come in meanwhile, or the takeover handed
        # one to a person.
        kept_open = _still_open().filter(tenant_id=run.tenant_id, run_id=run.run_id).exists
        try:
            closed += _close(
                run, IDLE_OWNER, "sweeper", "idle", kept_open, withdraw="session closed: idle"
            )
        except HoldpointError:
            continue  # taken meanwhile (a call came in): the session is not idle
    return closed


def _still_open() -> QuerySet[Action]:
    return Action.objects.filter(status__in=STILL_OPEN)


def _close(
    run: Any,
    owner: str,
    who: str,
    closed_by: str,
    kept_open: Callable[[], bool],
    *,
    withdraw: str = "",
) -> bool:
    """Under the session's lease: complete its run with a last checkpoint (which gives the
    lease up) unless `kept_open()` now says a call keeps it open (then the lease is given
    back). With `withdraw`, its unsent calls are withdrawn first, for that reason."""
    from runtime import ledger, protocol

    lease = protocol.take(run, owner, CLOSE_LEASE, who=who)
    run.refresh_from_db()
    if kept_open():
        protocol.release(run, lease.fence, who, owner=owner)
        return False
    withdrawn: list[str] = []
    if withdraw:
        with transaction.atomic(durable=True):
            ledger.fenced(run.run_id, lease.fence, run.tenant_id)
            withdrawn = ledger.withdraw_unsent(run, withdraw, lease.actor)
    calls = Action.objects.filter(tenant_id=run.tenant_id, run_id=run.run_id).count()
    state: dict[str, Any] = {"calls": calls, "closed_by": closed_by}
    if withdrawn:
        state["withdrawn"] = withdrawn
    protocol.write_checkpoint(
        run, lease.fence, run.checkpoint_rev, state, protocol.API_STEP, who, status="completed"
    )
    return True
