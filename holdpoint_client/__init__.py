"""A small client for Holdpoint's agent API (API.md), importable without Django.

`Client` mirrors the REST calls with typed results, problem codes as exceptions, automatic
idempotency keys and bounded retries; `Executor` runs an external agent's loop on a leased
run so that a crash of the agent process never sends an action twice.
"""

from __future__ import annotations

from holdpoint_client.client import Client
from holdpoint_client.errors import (
    ActionFailed,
    ActionRejected,
    ActionWithdrawn,
    AlreadyCompleted,
    ApprovalExpired,
    ApprovalRequired,
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
    "Checkpoint",
    "Client",
    "Conflict",
    "Executor",
    "ExecutorError",
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
    "OutcomeUnknown",
    "Page",
    "Run",
    "RunFinished",
    "StaleFence",
    "ToolCall",
    "ToolRefused",
    "TransportError",
    "VersionConflict",
]
