"""A small client for Holdpoint's agent API (API.md), importable without Django.

`Holdpoint` (and `AsyncHoldpoint`) is what an agent author writes against: `with
hp.run(thread_id, ...) as run: run.act(...)`, `@hp.action(tool)`, `run.record`/`run.model`
(README.md). Underneath, `Client`/`AsyncClient` mirror the REST calls with typed results,
problem codes as exceptions, automatic idempotency keys and bounded retries; `Executor`
(`AsyncExecutor`) runs an external agent's loop on a leased run so that a crash of the
agent process never sends an action twice.
"""

from __future__ import annotations

from holdpoint_client.agent import (
    AsyncHoldpoint,
    AsyncRunHandle,
    Holdpoint,
    NotRecorded,
    RunHandle,
    current_run,
)
from holdpoint_client.aio import AsyncClient, AsyncExecutor
from holdpoint_client.client import Client
from holdpoint_client.errors import (
    ActionFailed,
    ActionRejected,
    ActionWithdrawn,
    AlreadyCompleted,
    ApprovalExpired,
    ApprovalRequired,
    ApprovalTimeout,
    Conflict,
    ExecutorError,
    HoldpointAPIError,
    HoldpointError,
    IdempotencyKeyReused,
    InvalidParams,
    LeaseHeld,
    LeaseLost,
    NotExternal,
    NotFound,
    OutcomeUnknown,
    Rejected,
    RunFinished,
    StaleFence,
    ToolRefused,
    TransportError,
    VersionConflict,
)
from holdpoint_client.executor import Executor, ToolCall
from holdpoint_client.models import (
    Action,
    Approval,
    Checkpoint,
    JournalEntry,
    LeaseGrant,
    Page,
    Run,
)

__all__ = [
    "Action",
    "ActionFailed",
    "ActionRejected",
    "ActionWithdrawn",
    "AlreadyCompleted",
    "Approval",
    "ApprovalExpired",
    "ApprovalRequired",
    "ApprovalTimeout",
    "AsyncClient",
    "AsyncExecutor",
    "AsyncHoldpoint",
    "AsyncRunHandle",
    "Checkpoint",
    "Client",
    "Conflict",
    "Executor",
    "ExecutorError",
    "Holdpoint",
    "HoldpointAPIError",
    "HoldpointError",
    "IdempotencyKeyReused",
    "InvalidParams",
    "JournalEntry",
    "LeaseGrant",
    "LeaseHeld",
    "LeaseLost",
    "NotExternal",
    "NotFound",
    "NotRecorded",
    "OutcomeUnknown",
    "Page",
    "Rejected",
    "Run",
    "RunFinished",
    "RunHandle",
    "StaleFence",
    "ToolCall",
    "ToolRefused",
    "TransportError",
    "VersionConflict",
    "current_run",
]
