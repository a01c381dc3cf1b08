"""What the hourly chain check reads does not grow with the journal's history (PostgreSQL).

`verify_recent` asks `streams(since=…)` for the streams written to lately, and for the
heads whose last entry is gone or changed. The journal has no index on created_at alone
(every index is written at each step: issue 22), and PostgreSQL answered `created_at >=
since` by reading all of audit_journal_by_time (tenant_id, created_at), and the heads'
check by hashing every entry of the journal (a sequential scan) — twice, once more for the
streams without a head. So each hour it read the whole journal, years of it.

Measured here by what the database counts for this transaction
(`pg_stat_get_xact_blocks_fetched`, `pg_stat_xact_user_tables`): the same streams, heads and
recent entries under four times the history must cost about the same, and no sequential scan
of the journal is made at all. Not a timing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import DateTimeField, ExpressionWrapper, Value
from django.db.models.functions import Now

from audit.verification import streams

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

STREAMS = 1200  # run streams, each with its head
TENANTS = 12
RECENT = 20  # of them written to in the last half hour (their last TAIL entries)
TAIL = 5
FILL = """
INSERT INTO audit_journalentry
    (stream, seq, tenant_id, type, actor, object_ref, payload, created_at, prev_hash, hash,
     redacted)
SELECT 'run:' || md5(s::text), q, 9000 + s %% %(tenants)s, 'step_committed', 'worker:w1',
       'run:' || md5(s::text), jsonb_build_object('rev', q, 'note', repeat('x', 120)), at,
       md5(s || ':' || q - 1) || md5(q - 1 || ':' || s), md5(s || ':' || q) || md5(q || ':' || s),
       false
FROM generate_series(1, %(streams)s) s, generate_series(1, %(length)s) q,
     LATERAL (SELECT CASE WHEN s <= %(recent)s AND q > %(length)s - %(tail)s
                          THEN now() - interval '30 minutes' + q * interval '1 second'
                          ELSE now() - interval '400 days' + (q * %(streams)s + s) * interval '5 s'
                     END AS at) t
ORDER BY at
"""
HEADS = """
INSERT INTO audit_streamhead (stream, tenant_id, seq, hash)
SELECT 'run:' || md5(s::text), 9000 + s %% %(tenants)s, %(length)s,
       md5(s || ':' || %(length)s) || md5(%(length)s || ':' || s)
FROM generate_series(1, %(streams)s) s
"""
READ = """
SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid)),
       (SELECT seq_scan FROM pg_stat_xact_user_tables WHERE relid = %(journal)s::regclass)
FROM pg_class c
WHERE c.oid IN (%(journal)s::regclass, %(heads)s::regclass)
   OR c.oid IN (SELECT indexrelid FROM pg_index
                WHERE indrelid IN (%(journal)s::regclass, %(heads)s::regclass))
"""


def _journal(length: int) -> None:
    """STREAMS streams of `length` entries each, written over the last year in the order of
    their times (as appends are), RECENT of them written to lately; every head at its
    stream's last entry. Table statistics as autovacuum would leave them."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE audit_journalentry, audit_streamhead")
        sizes = {"streams": STREAMS, "length": length, "tenants": TENANTS}
        cursor.execute(FILL, {**sizes, "recent": RECENT, "tail": TAIL})
        cursor.execute(HEADS, sizes)
        cursor.execute("ANALYZE audit_journalentry")
        cursor.execute("ANALYZE audit_streamhead")


def _read() -> tuple[int, int]:
    """Blocks of the journal's and heads' tables and indexes this transaction has read so
    far (from shared buffers or disk), and its sequential scans of the journal."""
    tables = {"journal": "audit_journalentry", "heads": "audit_streamhead"}
    with connection.cursor() as cursor:
        cursor.execute(READ, tables)
        blocks, seq_scans = cursor.fetchone()
    return int(blocks or 0), int(seq_scans or 0)


def _hourly() -> tuple[list[str], int, int]:
    """The hourly check's streams, and the blocks and sequential scans of the journal that
    finding them took."""
    lately = ExpressionWrapper(Now() - Value(timedelta(hours=2)), output_field=DateTimeField())
    blocks, seq_scans = _read()
    found = list(streams(since=lately))
    after_blocks, after_seq_scans = _read()
    return found, after_blocks - blocks, after_seq_scans - seq_scans


def test_the_hourly_check_reads_no_more_for_more_history() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's plans and counters")
    with connection.cursor() as cursor:
        cursor.execute("SELECT 'run:' || md5(s::text) FROM generate_series(1, %s) s", [RECENT])
        recent = sorted(row[0] for row in cursor.fetchall())
    costs = {}
    for length in (20, 80):
        _journal(length)
        found, blocks, seq_scans = _hourly()
        assert sorted(found) == recent, length  # the streams written to lately, no other
        assert seq_scans == 0, f"{length} entries a stream: the journal was scanned whole"
        costs[length] = blocks
        # One probe of its last entry per head — the heads' index and row, the entry's
        # B-tree descent and row: five blocks or so — and what was written lately. The old
        # plans read 24 blocks a head here at 20 entries a stream (the whole journal, twice)
        # and 10 at 80 (every head probed twice).
        assert blocks <= 7 * STREAMS, (length, blocks)
    # Four times the history, the same streams, heads and recent entries: about the same
    # reads (a B-tree a level deeper costs a block a probe more at most).
    assert costs[80] <= costs[20] * 1.25, costs
