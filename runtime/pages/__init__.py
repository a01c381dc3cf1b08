"""The reviewer pages of the runtime side: HTTP in, calls of the runtime's functions, HTML out.

- `access`: who is asking — `reviewer_page`, the one decorator that logs in, checks the
  method, refuses agents and hands the view its tenant's `Principal`; `scoped_or_404` and
  `require_may_act` for the lookup-then-refuse order every object page keeps.
- `display`: how journal entries and stored JSON are shown (shared with approvals' pages).
- `runs`: the runs list, starting a run, one run's page and its levers.
- `audit`: the tenant's journal, its exports, and one run's verified trail.
- `reconcile`: actions whose outcome only a human can settle.
- `tenant`: switching the session's current tenant.

The approvals app's pages build on `access` and `display` too (they import them from here).
"""

from runtime.pages.access import principal_of, require_may_act, reviewer_page, scoped_or_404
from runtime.pages.display import TimelineRow, pretty, summarise, timeline_row

__all__ = [
    "TimelineRow",
    "pretty",
    "principal_of",
    "require_may_act",
    "reviewer_page",
    "scoped_or_404",
    "summarise",
    "timeline_row",
]
