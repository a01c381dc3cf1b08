"""Runtime models, one module per concept."""

from runtime.models.actions import SENDABLE, STANDALONE, UNSENT, Action, ActionStatus
from runtime.models.idempotency import IdempotencyRecord
from runtime.models.logins import FailedLoginWindow
from runtime.models.mcp import McpServer, McpTransport
from runtime.models.runs import (
    FINISHED,
    RUNNABLE,
    TERMINAL,
    Artifact,
    Checkpoint,
    RecordedCall,
    Run,
    RunStatus,
)
from runtime.models.secrets import ToolCredential
from runtime.models.shapers import RunShaper, ShaperKind
from runtime.models.sweeps import SweeperTurn
from runtime.models.tallies import Tally
from runtime.models.tenancy import AgentAccount, Membership, Role, Tenant
from runtime.models.tokens import AgentToken, TokenStatus
from runtime.models.tooldefs import ToolDefinition

__all__ = [
    "SENDABLE",
    "STANDALONE",
    "UNSENT",
    "Action",
    "ActionStatus",
    "FINISHED",
    "RUNNABLE",
    "TERMINAL",
    "AgentAccount",
    "AgentToken",
    "Artifact",
    "Checkpoint",
    "FailedLoginWindow",
    "IdempotencyRecord",
    "McpServer",
    "McpTransport",
    "Membership",
    "RecordedCall",
    "Role",
    "Run",
    "RunShaper",
    "RunStatus",
    "ShaperKind",
    "SweeperTurn",
    "Tally",
    "Tenant",
    "TokenStatus",
    "ToolCredential",
    "ToolDefinition",
]
