"""What names an action and what it is compared by: its idempotency key and its params'
canonical text and fingerprint.

Apart from the ledger's transitions because these are pure functions of a run, a step and the
params, asked by every path that makes or matches an action (a worker's step, an external
executor's prepare, the MCP gateway, a compensation, a reviewer's edit) before any row is
written; the ledger (runtime.ledger) is what writes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from audit.canonical import (
    MAX_DEPTH,
    TOO_DEEP,
    CanonicalError,
    canonical_forms,
    deeper_than,
    digest,
    sha256_hex,
)
from runtime.errors import InvalidParams
from runtime.models import Run
from runtime.tools import Tool


def idempotency_key(run: Run, step: str, call_index: int) -> str:
    """Stable across retries and processes: the same call of the same step visit gets the same
    key. The visit is named by the checkpoint rev it began at (`step_rev`), so a step that
    loops to itself acts anew on each visit, while a re-run after a crash finds its action.
    The one spelling of a derived key, for a worker's steps and an external executor's alike."""
    return f"{visit_prefix(run, step)}{call_index}"


def visit_prefix(run: Run, step: str) -> str:
    """What every key of one visit of `step` begins with (the call index follows)."""
    return f"{run.run_id}:{run.goal_rev}:{step}@{run.step_rev}:"


# The keys Holdpoint derives begin with their run's id: a step's (`visit_prefix`), an MCP
# call's (`mcp:<run id>:…`, gateway.calls); a compensation's is its action's key and UNDO
# (the first one asked for), or UNDO and `:<n>` (the n-th, asked after earlier ones ended
# unsent: `runtime.compensation.compensate`).
UNDO = ":undo"
_UNDONE = re.compile(re.escape(UNDO) + r"(?::[0-9]+)?\Z")
_DERIVED = re.compile(r"^(?:mcp:)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}):")


def undo_key(key: str, attempt: int) -> str:
    """The key of the `attempt`-th compensation of the action keyed `key` (what
    `reserved_key` keeps clients from spelling)."""
    return f"{key}{UNDO}" if attempt == 1 else f"{key}{UNDO}:{attempt}"


def reserved_key(key: str, run_id: Any) -> str:
    """Why an executor may not give `key` to an action of run `run_id`; "" when it may.

    Keys are unique per tenant, and every part of a derived key is on the API (run id, goal
    revision, step, visit): a client's key spelled as another run's next one took it first,
    and that run's own prepare failed on it, step after step, until the run failed."""
    if _UNDONE.search(key):
        return f"keys ending in {UNDO} or {UNDO}:<n> are Holdpoint's, for compensations"
    derived = _DERIVED.match(key)
    if derived is not None and derived.group(1) != str(run_id):
        return "the key is one Holdpoint derives for another run"
    return ""


@dataclass(frozen=True)
class Canonical:
    """Params as an action stores them — canonical text (RFC 8785) and its fingerprint — and
    as an action stored before Holdpoint wrote RFC 8785 may hold the same params (`earlier`,
    the form audit.canonical describes: only a float below 1e-4 or a key beyond U+FFFF
    differs). A step re-executed or a client's request retried across that upgrade asks for
    the action it prepared before it, with the fingerprint that action stores: matching
    either form keeps that the same request, not a "different params" refusal."""

    text: str
    fingerprint: str
    earlier: tuple[str, str] | None = None  # (text, fingerprint) in the earlier form

    def texts(self) -> tuple[str, ...]:
        return (self.text,) if self.earlier is None else (self.text, self.earlier[0])

    def fingerprints(self) -> tuple[str, ...]:
        return (self.fingerprint,) if self.earlier is None else (self.fingerprint, self.earlier[1])


def canonical_params(params: Any) -> Canonical:
    """The params' canonical forms; refuses what cannot be canonicalised unambiguously, and
    params nested deeper than any JSON Holdpoint takes in (MAX_DEPTH: the API's parser
    refuses such a body; an MCP host's arguments or a step's params reach here parsed)."""
    if not isinstance(params, dict):
        raise InvalidParams("params must be a JSON object", errors={"params": ["not an object"]})
    if deeper_than(params, MAX_DEPTH):
        raise InvalidParams(TOO_DEEP, errors={"params": [TOO_DEEP]})
    try:
        current, *earlier = canonical_forms(params)
    except CanonicalError as exc:
        raise InvalidParams(str(exc), errors={"params": [str(exc)]}) from None
    before = (earlier[0].decode("utf-8"), sha256_hex(earlier[0])) if earlier else None
    return Canonical(current.decode("utf-8"), sha256_hex(current), before)


def journal_params(tool: Tool, params: dict[str, Any]) -> dict[str, Any]:
    """Params as the journal keeps them: sensitive values as digests only."""
    return {k: ({"sha256": digest(v)} if k in tool.sensitive else v) for k, v in params.items()}
