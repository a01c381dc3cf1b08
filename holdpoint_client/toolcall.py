"""What an agent's own tool code meets of the executor: `ToolCall`, `Perform`, `Lookup`.

The executor (holdpoint_client.executor, .aio) hands a `perform` or `lookup` function one
`ToolCall` — the action as the ledger holds it and the headers that send it once — and reads
back what it returns or raises; a refusal it reported comes back, after a restart too, as
`refusal_of`'s reason. This contract stands apart from the executor's loop because it is
plain data with no lease, no server and no flow in it: the integrations (langgraph,
openai_agents) build their tool calls against it alone, and an agent's tool code can be
written and read without the executor's machinery in view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from holdpoint_client.models import Action


@dataclass(frozen=True)
class ToolCall:
    """What `perform` gets: the action as the ledger holds it, and how to send it once.

    Send `params` (a reviewer may have edited them at the hold point, so they can differ
    from what the agent asked for) with `idempotency_key` as the service's Idempotency-Key;
    `replay` is True when an earlier attempt may already have applied.
    """

    action: Action
    run_id: str
    fence: int
    replay: bool

    @property
    def idempotency_key(self) -> str:
        return self.action.idempotency_key

    @property
    def params(self) -> dict[str, Any]:
        return self.action.params

    @property
    def tool(self) -> str:
        return self.action.tool

    def headers(self) -> dict[str, str]:
        """HTTP headers for a service that deduplicates by key and refuses lower fences."""
        return {
            "Idempotency-Key": self.idempotency_key,
            "Holdpoint-Run": self.run_id,
            "Holdpoint-Fence": str(self.fence),
        }


# perform(call) -> (external_id, result): raise ToolRefused when the service certainly did
# not apply it; any other exception means "cannot tell". (With AsyncExecutor it may be an
# `async def`.)
Perform = Callable[[ToolCall], Any]
# lookup(call) -> (external_id, result) if the effect exists at the service, else None.
Lookup = Callable[[ToolCall], Any]


def refusal_of(action: Action) -> str:
    """Why a failed action failed: the server's word (`last_error`, set when Holdpoint sent
    the tool itself), else the refusal the agent reported with the outcome (the ledger's
    `result.error`, from `perform`'s ToolRefused) — found again after a restart too."""
    if action.last_error:
        return action.last_error
    result = action.result
    if isinstance(result, Mapping) and result.get("error"):
        return str(result["error"])
    return "the tool refused it"
