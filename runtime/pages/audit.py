"""Audit pages: the tenant's journal (filters, keyset paging, export) and one run's trail.

They live in `runtime` because pages need the principal (`runtime.pages.access`); `audit`
itself stays free of runtime imports (DESIGN.md, layering). Every read goes through
`journal_for(principal)`, so another tenant's entries are never in a queryset and another
tenant's run is the same 404 as a run that does not exist (invariant 9). Nothing here writes
history except the record that an export happened (invariant 8: the journal is append-only).

The log is meant to stay fast on millions of entries: every filter is an equality (or a
range on `created_at`) that one of JournalEntry's indexes serves in the order the page
shows, pages are keyset by id (`?before=<id>`) rather than OFFSET, and nothing COUNTs the
tenant's entries. `bench/audit_log.py` measures it on a million entries in PostgreSQL.
"""

from __future__ import annotations

import csv
import heapq
import io
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any
from urllib.parse import urlencode
from uuid import UUID

from django.db import transaction
from django.db.models import F, Field, Q, QuerySet, Subquery
from django.http import (
    HttpRequest,
    HttpResponse,
    QueryDict,
    StreamingHttpResponse,
)
from django.http.response import HttpResponseBase
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone

from audit import journal
from audit.journal import run_stream
from audit.models import JournalEntry, stored_time
from audit.verification import Break, ChainWalk
from runtime.events import RunEvent
from runtime.pages.access import reviewer_page
from runtime.pages.display import pretty, summarise
from runtime.pages.runs import scoped_run
from runtime.tenancy import Principal, journal_for

PAGE_SIZE = 50
# A run's trail is verified from seq 1 on every view (the chain has no shortcut), but only
# this many entries are rendered per page, so a run that retried for weeks stays readable.
TRAIL_PAGE = 500
EXPORT_CHUNK_ROWS = 2000  # rows per database round trip of the export's cursor
EXPORT_CHUNK_BYTES = 64 * 1024  # bytes per write to the client: not one write per row
HASH_SHOWN = 12
# Every type the code writes: a run's events and the tenants' streams' (audit.journal).
KNOWN_TYPES = tuple(sorted({*RunEvent.values, *journal.TENANT_EVENTS}))
# The fields the log renders; prev_hash (and the rest of the row) stays in the database.
LOG_FIELDS = ("id", "stream", "seq", "type", "actor", "object_ref", "payload", "created_at")
EXPORT_FIELDS = (
    "id",
    "stream",
    "seq",
    "created_at",
    "type",
    "actor",
    "object_ref",
    "payload",
    "redacted",
    "prev_hash",
    "hash",
)
# A spreadsheet runs a cell starting with one of these as a formula (OWASP "CSV injection");
# tab and carriage return too, which some spreadsheets strip before looking.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
MAX_BIGINT = 2**63 - 1
# The last time a datetime holds: "to" the calendar's last day still ends there, so a period
# never takes in an entry edited to 'infinity' (audit.models.JournalTime) — see `merged`.
LAST_TIME = datetime.max.replace(tzinfo=UTC)
# A worker's bookkeeping: leases taken and given back, wake-ups, recorded calls, step and
# action checkpoints — most of a busy tenant's log, and not what a reader of the log is
# after (who asked, who decided, what was sent and how it ended). Consecutive ones on a page
# are folded into one line a reader can open ("7 worker events: …").
FOLDED_TYPES = frozenset(
    e.value
    for e in (
        RunEvent.LEASE_TAKEN,
        RunEvent.LEASE_RELEASED,
        RunEvent.WOKEN,
        RunEvent.CALL_RECORDED,
        RunEvent.STEP_COMMITTED,
        RunEvent.ACTION_CHECKPOINT,
        RunEvent.RECONCILE_SCHEDULED,
        RunEvent.PARKED,
    )
)
# A decision is journalled twice, in the run's stream (with the run as its object) and in
# the tenant's (the tenant's human acts); the log shows the run's entry once. The exports
# and the verification keep both: they are the record, the page is for reading.
DECIDED_TWICE = "approval_decided"


class BadFilter(ValueError):
    """A filter value the log cannot use; its message is shown to the reviewer."""


# --- filters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AuditFilters:
    """What the log and the exports are narrowed to. Empty means "any"."""

    actor: str = ""
    type: str = ""
    object_ref: str = ""
    since: date | None = None  # ?from=, inclusive, a UTC day
    until: date | None = None  # ?to=, inclusive, a UTC day

    @property
    def has_period(self) -> bool:
        return self.since is not None or self.until is not None

    def params(self) -> dict[str, str]:
        """The query string that reproduces these filters (links, exports, the journal)."""
        found = {"actor": self.actor, "type": self.type, "object": self.object_ref}
        found["from"] = self.since.isoformat() if self.since else ""
        found["to"] = self.until.isoformat() if self.until else ""
        return {key: value for key, value in found.items() if value}

    def bounds(self) -> tuple[datetime | None, datetime | None]:
        """[lower, upper) in UTC: whole days, so "to" includes its own day."""
        lower = datetime.combine(self.since, time.min, tzinfo=UTC) if self.since else None
        upper = None
        if self.until is not None and self.until < date.max:
            upper = datetime.combine(self.until + timedelta(days=1), time.min, tzinfo=UTC)
        return lower, upper


def _text(params: QueryDict, param: str, label: str, field: str) -> str:
    value = params.get(param, "").strip()
    column = JournalEntry._meta.get_field(field)
    limit = (column.max_length if isinstance(column, Field) else None) or 0
    if len(value) > limit:
        raise BadFilter(f"{label} is longer than {limit} characters.")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        # PostgreSQL refuses NUL in text outright: a 500 waiting to happen, and never a match.
        raise BadFilter(f"{label} contains control characters.")
    return value


def _actor(params: QueryDict) -> str:
    return _text(params, "actor", "Actor", "actor")


def _type(params: QueryDict) -> str:
    return _text(params, "type", "Event type", "type")


def _object(params: QueryDict) -> str:
    """`run:<uuid>` or any other exact ref; a bare run id is taken as `run:<uuid>`."""
    value = _text(params, "object", "Object", "object_ref")
    try:
        return f"run:{UUID(value)}"
    except ValueError:
        pass
    if value.startswith("run:"):
        try:
            return f"run:{UUID(value[4:])}"
        except ValueError:
            raise BadFilter(f"Object {value!r} is not run:<run id>.") from None
    return value


def _day(params: QueryDict, param: str, label: str) -> date | None:
    value = params.get(param, "").strip()
    if not value:
        return None
    try:
        return datetime.strptime(value, "%Y-%m-%d").date()
    except ValueError:
        raise BadFilter(f"{label} {value[:40]!r} is not a date (YYYY-MM-DD).") from None


def _since(params: QueryDict) -> date | None:
    return _day(params, "from", "From")


def _until(params: QueryDict) -> date | None:
    return _day(params, "to", "To")


PARSERS: dict[str, Callable[[QueryDict], Any]] = {
    "actor": _actor,
    "type": _type,
    "object_ref": _object,
    "since": _since,
    "until": _until,
}


def parse_filters(params: QueryDict) -> tuple[AuditFilters, list[str]]:
    """The filters of a query string, and what is wrong with it (each a sentence)."""
    problems: list[str] = []
    found: dict[str, Any] = {}
    for name, parse in PARSERS.items():
        try:
            found[name] = parse(params)
        except BadFilter as exc:
            problems.append(str(exc))
    filters = AuditFilters(**found) if not problems else AuditFilters()
    if filters.since and filters.until and filters.since > filters.until:
        problems.append("The period starts after it ends.")
    return filters, problems


def parse_before(value: str | None) -> int | None:
    """The keyset cursor: the id of the last entry of the previous page."""
    if not value:
        return None
    try:
        before = int(value)
    except ValueError:
        raise BadFilter("That page position is not an entry id.") from None
    if not 0 < before <= MAX_BIGINT:
        raise BadFilter("That page position is not an entry id.")
    return before


@dataclass(frozen=True)
class Part:
    """One index-ordered query of the entries a filter matches, and the order it reads in;
    `stream`: the one stream it reads in seq order (an object's own), else empty."""

    entries: QuerySet[JournalEntry]
    order: list[str]
    stream: str = ""


def filtered(
    entries: QuerySet[JournalEntry], filters: AuditFilters, *, newest_first: bool = True
) -> list[Part]:
    """Equality filters only (and a created_at range): each is the prefix of an index
    (tenant_id, actor|type|object_ref, id) or (tenant_id, created_at). Parts, in the same
    order, that together are the matching entries, each once: one, but two for an object.

    An object's entries are those in the stream of its name that are about it (a run's own
    events, every step of it: (stream, seq) holds them in order, seq rising with id within
    a stream) and those about it in other streams — the partial by_object index holds only
    entries about something other than their own stream, which leaves out most of the
    journal (issue 22). Every step of every run is one index entry fewer."""
    if filters.actor:
        entries = entries.filter(actor=filters.actor)
    if filters.type:
        entries = entries.filter(type=filters.type)
    lower, upper = filters.bounds()
    if lower is not None:
        entries = entries.filter(created_at__gte=lower)
    if upper is not None:
        entries = entries.filter(created_at__lt=upper)
    elif filters.until is not None:
        entries = entries.filter(created_at__lte=LAST_TIME)
    order = ordering(filters, newest_first=newest_first)
    target = filters.object_ref
    if not target:
        return [Part(entries, order)]
    own = entries.filter(stream=target, object_ref=target)
    about = entries.filter(object_ref=target).exclude(object_ref=F("stream"))
    if filters.has_period:
        return [Part(own, order), Part(about, order)]
    return [Part(own, ["-seq" if newest_first else "seq"], stream=target), Part(about, order)]


def merged(
    parts: Sequence[Iterable[Any]], filters: AuditFilters, newest_first: bool
) -> Iterator[Any]:
    """The parts' rows (entries or export dicts) as one sequence in the page's order."""
    if len(parts) == 1:
        return iter(parts[0])
    # A time no datetime holds reads as None (audit.models.JournalTime); the database sorted
    # it at the period's open end. A period has a bound, and `filtered` bounds "to" even on
    # the calendar's last day, so only one infinity can be in it: 'infinity' after every
    # time when the period has no end, '-infinity' before every time when it has one.
    unreadable = (1 if filters.until is None else -1, LAST_TIME)

    def key(row: Any) -> tuple[Any, ...]:
        get = row.get if isinstance(row, dict) else lambda name: getattr(row, name)
        if not filters.has_period:
            return (get("id"),)
        at = get("created_at")
        return ((0, at) if at is not None else unreadable, get("id"))

    return heapq.merge(*parts, key=key, reverse=newest_first)


def ordering(filters: AuditFilters, *, newest_first: bool = True) -> list[str]:
    """By id, which the tenant/actor/type/object indexes hold in order; with a period by
    (created_at, id) instead, so (tenant_id, created_at) serves it as a range read from one
    end — ordering a period by id would sort every entry of the period (or walk the newer
    ones first) before the first row comes out."""
    fields = ["created_at", "id"] if filters.has_period else ["id"]
    return [("-" if newest_first else "") + f for f in fields]


# --- the log ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogRow:
    entry: JournalEntry
    summary: str
    payload_json: str
    run_id: UUID | None


@dataclass(frozen=True)
class LogPage:
    rows: list[LogRow]
    next_before: int | None
    # False when the reader filtered by event type: they asked for exactly those entries.
    folds: bool = True

    @property
    def groups(self) -> list[Fold]:
        """The rows as the page shows them: each alone, except runs of two or more
        consecutive worker entries (FOLDED_TYPES), which come as one fold."""
        groups: list[list[LogRow]] = []
        for row in self.rows:
            folds = self.folds and row.entry.type in FOLDED_TYPES
            last = groups[-1] if groups else None
            if folds and last is not None and last[0].entry.type in FOLDED_TYPES:
                last.append(row)
            else:
                groups.append([row])
        return [Fold(g) for g in groups]


@dataclass(frozen=True)
class Fold:
    """One line of the log: a single entry, or consecutive worker entries folded."""

    rows: list[LogRow]

    @property
    def folded(self) -> bool:
        return len(self.rows) > 1

    @property
    def summary(self) -> str:
        """'7 worker events: call_recorded ×4, step_committed ×2, lease_taken'."""
        counts = Counter(r.entry.type for r in self.rows)
        kinds = ", ".join(f"{t} ×{n}" if n > 1 else t for t, n in counts.most_common())
        return f"{len(self.rows)} worker events: {kinds}"


def run_of(object_ref: str) -> UUID | None:
    if not object_ref.startswith("run:"):
        return None
    try:
        return UUID(object_ref[4:])
    except ValueError:
        return None


def _older_than(principal: Principal, filters: AuditFilters, before: int) -> Q:
    """Entries after the cursor entry in the page's order (strictly: no overlap, no gap)."""
    if not filters.has_period:
        return Q(id__lt=before)
    cursor = journal_for(principal).filter(pk=before)
    if not cursor.exists():
        raise BadFilter("That page position is not an entry of this tenant.")
    # The cursor's time as stored, compared in the database: one that no datetime holds
    # ('infinity', edited in) orders the next page there as it ordered this one.
    at = Subquery(cursor.values(at=stored_time())[:1])
    # created_at <= at bounds the index range; among equal times, id breaks the tie.
    return Q(created_at__lte=at) & (Q(created_at__lt=at) | Q(id__lt=before))


def log_query(
    principal: Principal, filters: AuditFilters, before: int | None
) -> list[QuerySet[JournalEntry]]:
    """The page's queries, one per part of `filtered` (bench/audit_log.py EXPLAINs exactly
    these), each PAGE_SIZE + 1 rows at most."""
    queries = []
    older = Q() if before is None else _older_than(principal, filters, before)
    for part in filtered(journal_for(principal), filters):
        entries = part.entries.exclude(
            type=DECIDED_TWICE, stream=journal.tenant_stream(principal.tenant.pk)
        ).only(*LOG_FIELDS)
        entries = entries.filter(older)
        if part.stream and before is not None:  # bound the stream's range, not only filter it
            entries = entries.filter(_stream_older_than(principal, part.stream, before))
        queries.append(entries.order_by(*part.order)[: PAGE_SIZE + 1])
    return queries


def _stream_older_than(principal: Principal, stream: str, before: int) -> Q:
    """Within one stream, entries before the cursor by seq (which rises with id there), so
    the (stream, seq) index starts at the cursor instead of skipping to it."""
    cursor = journal_for(principal).filter(pk=before, stream=stream)
    seq = cursor.values_list("seq", flat=True).first()
    return Q() if seq is None else Q(seq__lt=seq)


def log_page(principal: Principal, filters: AuditFilters, before: int | None) -> LogPage:
    """One page, newest first: one query per part (and one more with a period and a cursor,
    or an object and a cursor), PAGE_SIZE + 1 rows read to know whether there is an older
    page."""
    queries = log_query(principal, filters, before)
    found = list(merged(queries, filters, newest_first=True))[: PAGE_SIZE + 1]
    shown = found[:PAGE_SIZE]
    rows = [LogRow(e, summarise(e.payload), pretty(e.payload), run_of(e.object_ref)) for e in shown]
    return LogPage(rows, shown[-1].pk if len(found) > PAGE_SIZE else None, folds=not filters.type)


@reviewer_page(no_tenant="audit/log.html")
def audit_log(request: HttpRequest, principal: Principal) -> HttpResponse:
    """The tenant's journal, every stream, newest first, filterable and exportable."""
    filters, problems = parse_filters(request.GET)
    page = LogPage([], None)
    if not problems:
        try:
            page = log_page(principal, filters, parse_before(request.GET.get("before")))
        except BadFilter as exc:
            problems.append(str(exc))
    query = filters.params() if not problems else {}
    types = list(KNOWN_TYPES)
    if filters.type and filters.type not in types:
        types.append(filters.type)  # an event type of older code, still in the journal
    context = {
        "rows": page.rows,
        "groups": page.groups,
        "filters": filters,
        "form": request.GET if problems else filters.params(),
        "types": types,
        "problems": problems,
        "paged": bool(request.GET.get("before")),
        "newest_url": _url("audit-log", query),
        "older_url": (
            _url("audit-log", {**query, "before": str(page.next_before)})
            if page.next_before
            else ""
        ),
        "csv_url": _url("audit-export-csv", query),
        "jsonl_url": _url("audit-export-jsonl", query),
    }
    return render(request, "audit/log.html", context, status=400 if problems else 200)


def _url(name: str, query: dict[str, str]) -> str:
    return reverse(name) + ("?" + urlencode(query) if query else "")


# --- exports ------------------------------------------------------------------------------


def record_export(principal: Principal, filters: AuditFilters, format: str) -> JournalEntry:
    """An export is a human act on the tenant's data: it goes into the tenant's stream, and
    commits before the first byte leaves, so no export happens unrecorded."""
    tenant_id = principal.tenant.pk
    with transaction.atomic(durable=True):
        return journal.append(
            journal.tenant_stream(tenant_id),
            "audit_exported",
            tenant_id=tenant_id,
            actor=principal.label,
            payload={"filters": filters.params(), "format": format},
        )


def export_rows(principal: Principal, filters: AuditFilters) -> Iterator[dict[str, Any]]:
    """Oldest first, as plain dicts from a cursor read 2000 rows at a time: the queryset is
    never materialised, so memory stays flat however many entries match."""
    parts = [
        part.entries.order_by(*part.order)
        .values(*EXPORT_FIELDS)
        .iterator(chunk_size=EXPORT_CHUNK_ROWS)
        for part in filtered(journal_for(principal), filters, newest_first=False)
    ]
    rows: Iterator[dict[str, Any]] = merged(parts, filters, newest_first=False)
    return rows


def _cell(name: str, value: Any) -> Any:
    if name == "payload":
        value = _json(value)  # always JSON, whatever its type, so it parses back
    elif isinstance(value, bool):
        return "true" if value else "false"
    elif isinstance(value, int):
        return value
    elif isinstance(value, datetime):
        return value.isoformat()
    elif value is None:  # a time that cannot be read (audit.models.JournalTime)
        return ""
    text = str(value)
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def csv_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(EXPORT_FIELDS)
    for row in rows:
        writer.writerow([_cell(name, row[name]) for name in EXPORT_FIELDS])
        if buffer.tell() >= EXPORT_CHUNK_BYTES:
            yield _drain(buffer)
    yield _drain(buffer)


def jsonl_lines(rows: Iterable[dict[str, Any]]) -> Iterator[str]:
    buffer = io.StringIO()
    for row in rows:
        at = row["created_at"]  # None: a time that cannot be read (audit.models.JournalTime)
        row["created_at"] = at.isoformat() if at is not None else None
        buffer.write(_json(row) + "\n")
        if buffer.tell() >= EXPORT_CHUNK_BYTES:
            yield _drain(buffer)
    yield _drain(buffer)


def _drain(buffer: io.StringIO) -> str:
    text = buffer.getvalue()
    buffer.seek(0)
    buffer.truncate()
    return text


FORMATS = {
    "csv": ("text/csv; charset=utf-8", csv_lines),
    "jsonl": ("application/jsonl; charset=utf-8", jsonl_lines),
}


def _export(request: HttpRequest, principal: Principal, format: str) -> HttpResponseBase:
    filters, problems = parse_filters(request.GET)
    if problems:
        return HttpResponse(
            "\n".join(problems) + "\n", status=400, content_type="text/plain; charset=utf-8"
        )
    record_export(principal, filters, format)
    content_type, lines = FORMATS[format]
    chunks = (text.encode("utf-8") for text in lines(export_rows(principal, filters)))
    response = StreamingHttpResponse(chunks, content_type=content_type)
    stamp = timezone.now().strftime("%Y%m%dT%H%M%SZ")
    name = f"holdpoint-audit-{principal.tenant.slug}-{stamp}.{format}"
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    response["Cache-Control"] = "no-store"
    return response


@reviewer_page()
def export_csv(request: HttpRequest, principal: Principal) -> HttpResponseBase:
    return _export(request, principal, "csv")


@reviewer_page()
def export_jsonl(request: HttpRequest, principal: Principal) -> HttpResponseBase:
    return _export(request, principal, "jsonl")


# --- a run's trail ------------------------------------------------------------------------


@dataclass(frozen=True)
class TrailRow:
    entry: JournalEntry
    summary: str
    payload_json: str
    verdict: str  # "verified", "broken", "after a break"


@dataclass(frozen=True)
class Trail:
    rows: list[TrailRow]
    chain_break: Break | None
    total: int
    next_after: int | None


def _verdict(seq: int, found: Break | None) -> str:
    if found is None or seq < found.seq:
        return "verified"
    return "broken" if seq == found.seq else "after a break"


def walk_trail(principal: Principal, run_id: UUID, after: int = 0) -> Trail:
    """Verify the run's whole stream in one pass, keeping only the entries shown.

    The chain's check stops at the first break; the walk goes on past it so the entries
    after a break are still shown (marked as such) and counted.
    """
    stream = run_stream(run_id)
    entries = journal_for(principal).filter(stream=stream).order_by("seq")
    shown: list[JournalEntry] = []
    total = 0

    def walk() -> Iterator[JournalEntry]:
        nonlocal total
        for entry in entries.iterator(chunk_size=TRAIL_PAGE):
            total += 1
            if entry.seq > after and len(shown) <= TRAIL_PAGE:
                shown.append(entry)
            yield entry

    steps = walk()
    chain = ChainWalk(stream)
    found = chain.over(steps)
    for _ in steps:
        pass
    if found is None:
        # The head, read now, against the last entry (or entries the run appended since the
        # walk: checked, not shown). The stream is the principal's run's.
        found = chain.ended(entries)
    rows = [
        TrailRow(e, summarise(e.payload), pretty(e.payload), _verdict(e.seq, found))
        for e in shown[:TRAIL_PAGE]
    ]
    more = len(shown) > TRAIL_PAGE
    return Trail(rows, found, total, rows[-1].entry.seq if more else None)


@reviewer_page()
def run_trail(request: HttpRequest, principal: Principal, run_id: UUID) -> HttpResponse:
    """A run's whole story from its stream, oldest first, each entry's link checked."""
    run = scoped_run(principal, run_id)
    try:
        after = max(0, min(int(request.GET.get("after") or 0), MAX_BIGINT))
    except ValueError:
        after = 0
    trail = walk_trail(principal, run.run_id, after)
    context = {
        "run": run,
        "trail": trail,
        "hash_shown": HASH_SHOWN,
        "export_url": _url("audit-export-jsonl", {"object": f"run:{run.run_id}"}),
        "later_url": (
            reverse("run-trail", args=[run.run_id]) + f"?after={trail.next_after}"
            if trail.next_after
            else ""
        ),
    }
    return render(request, "audit/trail.html", context)
