"""The action hash an approval is bound to.

Built like Django's password-reset token: a documented list of what is hashed, and why;
compared in constant time. Any change of a bound field gives another hash, and an approval
of the old hash no longer lets the action go.

Hashed (as canonical JSON, RFC 8785):
- `tool` and `tool_version` — approving "create a task" under one tool contract is not
  approving whatever a later version of the tool does with the same params;
- `params` — the exact canonical bytes stored on the action, which are the bytes the
  executor sends (never a re-serialisation of something else). Hashed as that text (a JSON
  string), so the hash does not depend on how the params were canonicalised: an action
  stored before Holdpoint wrote RFC 8785 (audit.canonical) keeps its hash, and its approval;
- `run` and `goal_rev` — the approval is for this run under this goal revision: a revised
  goal must be approved again;
- `action_id` — this action, not another one with identical params (apply-once).
"""

from __future__ import annotations

import hmac

from audit.canonical import canonical_bytes, sha256_hex
from runtime.models import Action


def action_hash(action: Action) -> str:
    return sha256_hex(
        canonical_bytes(
            {
                "tool": action.tool,
                "tool_version": action.tool_version,
                "params": action.params,
                "run": str(action.run_id),
                "goal_rev": action.goal_rev,
                "action_id": str(action.action_id),
            }
        )
    )


def same_hash(seen: str, expected: str) -> bool:
    """Constant-time comparison: no timing oracle on how much of a hash was right."""
    return hmac.compare_digest(seen.encode("ascii", "replace"), expected.encode("ascii"))
