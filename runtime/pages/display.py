"""How journal entries and stored JSON are shown on the reviewer pages.

Shared by the runs, audit and reconcile pages and by the approvals pages, so an event reads
the same wherever a reviewer meets it: one line that says what happened, the full payload
one click away.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from audit.models import JournalEntry

SUMMARY_LIMIT = 160
# Payload keys worth a glance in the timeline, in this order; the full payload is one click
# away. Digests and whole goals are noise in a one-line summary.
SUMMARY_KEYS = (
    "status",
    "step",
    "next_step",
    "rev",
    "goal_rev",
    "from_rev",
    "to_rev",
    "previous_status",
    "tool",
    "owner",
    "graph",
    "graph_version",
    "from_version",
    "to_version",
    "fence",
    "failures",
    "retry_in_seconds",
    "reason",
    "error",
)
SUMMARY_SKIP = frozenset(
    {"digest", "before_digest", "after_digest", "fingerprint", "goal", "previous_goal"}
)


@dataclass(frozen=True)
class TimelineRow:
    entry: JournalEntry
    summary: str
    payload_json: str


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False)


def summarise(payload: Any) -> str:
    """One line telling what an event did; the full payload stays one click away."""
    if not isinstance(payload, dict):
        return _clip(json.dumps(payload, ensure_ascii=False), SUMMARY_LIMIT)
    keys = [k for k in SUMMARY_KEYS if k in payload]
    keys += sorted(k for k in payload if k not in SUMMARY_KEYS and k not in SUMMARY_SKIP)
    parts = []
    for key in keys:
        value = payload[key]
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, dict | list):
            parts.append(f"{key}=({len(value)} items)")
        else:
            parts.append(f"{key}={_clip(str(value), 60)}")
    return _clip(" · ".join(parts), SUMMARY_LIMIT)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def timeline_row(entry: JournalEntry) -> TimelineRow:
    """An entry as a timeline shows it: the one-line summary and the indented payload."""
    return TimelineRow(entry, summarise(entry.payload), pretty(entry.payload))
