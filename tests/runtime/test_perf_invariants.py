"""What a durable step and a side effect cost the database — counted, so a regression fails —
and proof that the shortcuts behind those numbers keep every guarantee.

Counts are marginal (a longer run minus a shorter one), so they measure the steady state of
a step or an action, not the lease taken once per run. Statements are what Django sends
(BEGIN excluded: SQLite sends it as a statement, PostgreSQL's driver does not); durable
transactions are commits of the database connection.

The shortcuts: the executor carries the journal head through its own appends instead of
re-reading it; a step visit that just began does not look for an earlier action; `sent` is
marked without the full hold-point re-check when a cheap indexed question says no hold
point can apply; checkpoints keep an unchanged state as one reference. Each has a test here
that tries to break what it must not break.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from hypothesis import given, settings
from hypothesis import strategies as st

from approvals.models import ApprovalPolicy, ApprovalRequest
from audit import journal
from audit.canonical import CanonicalError, canonical, canonical_bytes
from audit.models import JournalEntry
from audit.verification import verify_stream
from runtime import actionkeys, ledger, tools
from runtime.artifacts import CHUNK, INLINE_LIMIT, Encoder, resolve
from runtime.context import StepContext
from runtime.errors import StaleFence
from runtime.events import RunEvent, record
from runtime.executor import advance_run
from runtime.graphs import Complete, Graph, Next, Outcome, register
from runtime.leases import take_lease
from runtime.lifecycle import create_run, revise_goal
from runtime.models import Action, ActionStatus, Checkpoint, Run, RunStatus, Tenant
from runtime.tools import CallResult, Tool, register_tool
from tests.runtime.helpers import expire_lease, in_other_thread

pytestmark = pytest.mark.django_db(transaction=True)

# --- graphs and a local tool ------------------------------------------------------------------

tick = Graph("perf-tick", version="1")


@tick.step(start=True)
def count(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    if i >= int(ctx.goal["steps"]):
        return Complete(update={"i": i})
    return Next("count", update={"i": i})


register(tick)

CALLS: list[str] = []  # idempotency keys the local tool was called with
BEFORE_SEND: list[Callable[[], None]] = []  # run once, at the seam before `sent` is marked
AFTER_CALL: list[Callable[[], None]] = []  # run once, once the effect happened


def _before_send(params: dict[str, Any]) -> None:
    while BEFORE_SEND:
        BEFORE_SEND.pop(0)()


class Ledgered(Tool):
    """Applies at once with a synthetic id; counts its calls (the oracle for 'sent?')."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        CALLS.append(key)
        while AFTER_CALL:
            AFTER_CALL.pop(0)()
        return CallResult("applied", external_id=f"x-{key}", result={"ok": True})


register_tool(Ledgered(name="perf.effect", schema={"type": "object"}, precheck=_before_send))
# The same effect from a service that can neither deduplicate nor be asked: its actions are
# prepared on a commit of their own, and marked sent on the next.
register_tool(
    Ledgered(
        name="perf.effect-once", schema={"type": "object"}, precheck=_before_send, dedup="none"
    )
)


class Credentialed(Ledgered):
    """Reads the run's credential for its service as an http tool does; records what it got."""

    def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
        secret = tools.credential_for_run(self.credential, run_id)
        SECRETS_SEEN.append(secret.reveal() if secret is not None else None)
        return super().call(params_text, key=key, fence=fence, run_id=run_id)


SECRETS_SEEN: list[str | None] = []
register_tool(
    Credentialed(name="perf.with-secret", schema={"type": "object"}, credential="perf-svc")
)

MAX_ACTS = 20
FAILED_ONCE: list[str] = []
acts = Graph(
    "perf-acts", version="1", tools=("perf.effect", "perf.effect-once", "perf.with-secret")
)


def act_once(ctx: StepContext) -> Outcome:
    i = ctx.state.get("i", 0) + 1
    tool = ctx.goal.get("tool", "perf.effect")
    ctx.act(tool, {"n": i, "pad": ctx.goal.get("pad", "")}, reason="perf")
    for n in range(1, int(ctx.goal.get("more", 0)) + 1):  # more actions in the same step
        ctx.act(tool, {"n": i, "more": n}, reason="perf")
    if ctx.goal.get("fail_once") and not ctx.state.get("failed"):
        FAILED_ONCE.append(ctx.step)
        if len(FAILED_ONCE) == 1:
            raise RuntimeError("the step fails after its action")
    update = {"i": i, "pad": ctx.goal["pad"]} if ctx.goal.get("pad") else {"i": i}
    if i >= int(ctx.goal["steps"]):
        return Complete(update=update)
    return Next(f"act_{i + 1}", update=update)


for _k in range(1, MAX_ACTS + 1):  # each visit its own step: the bench-act shape
    acts.step(act_once, name=f"act_{_k}", start=_k == 1)
register(acts)


@pytest.fixture(autouse=True)
def _clean_seams() -> Iterator[None]:
    CALLS.clear()
    BEFORE_SEND.clear()
    AFTER_CALL.clear()
    FAILED_ONCE.clear()
    yield
    BEFORE_SEND.clear()
    AFTER_CALL.clear()


# --- counting -----------------------------------------------------------------------------


# Transaction control, logged as queries on SQLite only: counted as commits instead.
_NOT_STATEMENTS = ("BEGIN", "COMMIT", "ROLLBACK")


@contextmanager
def counted() -> Iterator[dict[str, Any]]:
    """Statements Django sends (transaction control excluded) and durable transactions — the
    commits of the connection, and each statement that writes outside a transaction (its
    own implicit one), while the block runs."""
    seen: dict[str, Any] = {"commits": 0}
    real = connection.commit

    def commit() -> None:
        seen["commits"] += 1
        real()

    def autocommit_writes(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if not connection.in_atomic_block and _WRITES.match(sql):
            seen["commits"] += 1
        return execute(sql, params, many, context)

    connection.commit = commit  # a spy: the commit still happens
    try:
        with CaptureQueriesContext(connection) as captured:
            with connection.execute_wrapper(autocommit_writes):
                yield seen
    finally:
        del connection.commit
    seen["sql"] = [
        q["sql"] for q in captured.captured_queries if not q["sql"].startswith(_NOT_STATEMENTS)
    ]


_WRITES = re.compile(r"\s*(INSERT|UPDATE|DELETE|WITH\b.*\b(INSERT|UPDATE|DELETE)\b)", re.S)


def cost(tenant: Tenant, graph: str, steps: int, **goal: Any) -> dict[str, Any]:
    run = create_run(tenant, graph, {"steps": steps, **goal}, actor="t")
    with counted() as seen:
        result = advance_run(run.run_id, "w", slice_seconds=600)
    assert result.outcome == "completed", result
    return seen


def marginal(tenant: Tenant, graph: str, short: int, long: int, **goal: Any) -> dict[str, float]:
    a, b = cost(tenant, graph, short, **goal), cost(tenant, graph, long, **goal)
    n = long - short
    return {
        "statements": (len(b["sql"]) - len(a["sql"])) / n,
        "commits": (b["commits"] - a["commits"]) / n,
        "head_reads": (_head_reads(b["sql"]) - _head_reads(a["sql"])) / n,
    }


def _head_reads(statements: list[str]) -> int:
    return sum(1 for s in statements if s.startswith("SELECT") and "audit_streamhead" in s)


# The run CAS, the checkpoint, the head swap and the journal entry in one statement, its own
# transaction: PostgreSQL's data-modifying CTE (audit.journal.append_after), SQLite's INSERT
# into a view whose trigger writes them (runtime.sqlitestep).
STEP_STATEMENTS = {"postgresql": 1, "sqlite": 1}
# An action of a key tool: the prepare commit (run CAS + checkpoint, the hold-point question
# asked inside it, the action's insert — already `sent`, its database-time marks returned by
# the INSERT itself —, head swap + entries); the step commit (run CAS + checkpoint, the
# outcome's compare-and-swap, head swap + entries). SQLite sends each head swap and its
# entries as one INSERT into the journal's view (audit.sqliteappend), and also reads the
# tool's current version (tools are data: a redefinition must be seen before the send) and
# the tenant's credential (a tool that sends one). PostgreSQL sends each commit as one statement
# (runtime.stepcommit): the prepare's hold-point question is a guard part of it (no active
# policy names the tool), so is the tool's version (none newer than the one last seen), and
# it reads the credential along; the confirmation is a part of the step's.
ACTION_STATEMENTS = {"postgresql": 2, "sqlite": 10}


def test_a_durable_step_is_one_transaction_of_a_few_statements(tenant_a: Tenant) -> None:
    per_step = marginal(tenant_a, "perf-tick", 5, 25)
    assert per_step["commits"] == 1
    assert per_step["statements"] <= STEP_STATEMENTS[connection.vendor], per_step
    assert per_step["head_reads"] == 0  # the executor carries the head through


def test_an_action_is_two_transactions_and_reads_no_journal_head(
    tenant_a: Tenant,
) -> None:
    per_action = marginal(tenant_a, "perf-acts", 2, 8)
    # prepare and `sent` (committed before the request leaves); the step commit, which
    # writes the outcome too
    assert per_action["commits"] == 2
    assert per_action["statements"] <= ACTION_STATEMENTS[connection.vendor], per_action
    assert per_action["head_reads"] == 0


def test_an_action_of_a_tool_that_cannot_deduplicate_is_prepared_on_its_own_commit(
    tenant_a: Tenant,
) -> None:
    per_action = marginal(tenant_a, "perf-acts", 2, 8, tool="perf.effect-once")
    # prepare; `sent` (a crash between them must leave an action safe to send); the step
    assert per_action["commits"] == 3
    assert per_action["head_reads"] == 0


def test_a_run_s_first_credential_needs_no_read_of_its_tenant(tenant_a: Tenant) -> None:
    """The executor read the run row: a tool's credential lookup does not read the run's
    tenant again (it did, once per run and process), and still finds the tenant's secret."""
    from runtime.models import ToolCredential

    credential = ToolCredential(tenant=tenant_a, service="perf-svc")
    credential.set_secret("s3cret-of-a", actor="test")
    credential.save()
    tools._run_tenants.clear()  # as in a fresh worker process
    SECRETS_SEEN.clear()
    seen = cost(tenant_a, "perf-acts", 3, tool="perf.with-secret")
    assert SECRETS_SEEN == ["s3cret-of-a"] * 3
    tenant_reads = [s for s in seen["sql"] if re.match(r'SELECT "runtime_run"."tenant_id"', s)]
    assert tenant_reads == [], tenant_reads


def test_a_prepare_that_marks_sent_writes_what_a_sent_mark_does(tenant_a: Tenant) -> None:
    """The fused commit leaves the same ledger record as prepare-then-mark: the prepared and
    the sent entries in the journal, in that order, one attempt under this fence, an in-flight
    window in database time; and the run's stream still verifies."""
    run = create_run(tenant_a, "perf-acts", {"steps": 1}, actor="t")
    seen: list[Action] = []

    class Spy(Ledgered):
        def call(self, params_text: str, *, key: str, fence: int, run_id: str) -> CallResult:
            seen.append(Action.objects.get(idempotency_key=key, tenant=tenant_a))
            return super().call(params_text, key=key, fence=fence, run_id=run_id)

    register_tool(Spy(name="perf.effect", schema={"type": "object"}, precheck=_before_send))
    try:
        assert advance_run(run.run_id, "w", slice_seconds=60).outcome == "completed"
    finally:
        register_tool(
            Ledgered(name="perf.effect", schema={"type": "object"}, precheck=_before_send)
        )
    [at_call] = seen  # what the database said while the request was out
    run.refresh_from_db()
    assert at_call.status == ActionStatus.SENT and at_call.attempts == 1
    assert at_call.sent_fence == run.fence and at_call.in_flight_until is not None
    assert at_call.sent_at is not None and at_call.in_flight_until > at_call.sent_at
    types = [
        (e.type, e.payload.get("action_status"))
        for e in JournalEntry.objects.filter(stream=journal.run_stream(run.run_id)).order_by("seq")
        if e.payload.get("action_id") == str(at_call.action_id)
    ]
    assert types[:2] == [("action_prepared", "prepared"), ("action_outcome", "sent")], types
    assert types[-1] == ("action_outcome", "confirmed"), types
    assert verify_stream(journal.run_stream(run.run_id)) is None


def test_a_step_commit_changes_no_column_an_index_of_the_run_names(tenant_a: Tenant) -> None:
    """PostgreSQL rewrites a row in place (a HOT update: no new entry in any index, a
    fraction of the WAL) only when no column that an index names — as a key or in a partial
    index's condition — changes. A run's row is updated on every step, so no index of
    runtime_run may name what a step commit sets (an index on updated_at once made every
    step's update a full one: +19% WAL per step)."""
    if connection.vendor != "postgresql":
        pytest.skip("HOT updates are PostgreSQL's")
    seen = cost(tenant_a, "perf-tick", 12)
    sets = Counter(
        frozenset(re.findall(r'"(\w+)" =', found.group(1)))
        for sql in seen["sql"]
        if (found := re.search(r'UPDATE "runtime_run" SET (.*?) WHERE', sql))
    )
    steady, times = sets.most_common(1)[0]
    assert times >= 10 and {"checkpoint_rev", "updated_at"} <= steady, sets
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'runtime_run'")
        indexes = dict(cursor.fetchall())
    named = {
        name: sorted(column for column in steady if re.search(rf"\b{column}\b", definition))
        for name, definition in indexes.items()
    }
    assert {name: columns for name, columns in named.items() if columns} == {}


def _prepared_on_this_connection() -> list[tuple[str, int]]:
    with connection.cursor() as cur:
        cur.execute("SELECT statement, generic_plans + custom_plans FROM pg_prepared_statements")
        return list(cur.fetchall())


def test_postgresql_prepares_the_step_statement_once_and_reuses_it(tenant_a: Tenant) -> None:
    """Planning a step's one statement took as long as running it; the hot path's cursor
    prepares it on the first step and every later step only executes it. Turned off
    (HOLDPOINT_PG_PREPARE=0, for poolers in transaction mode) nothing is prepared."""
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    connection.close()  # a fresh connection: nothing prepared yet
    run = create_run(tenant_a, "perf-tick", {"steps": 12}, actor="t")
    assert advance_run(run.run_id, "t").outcome == "completed"
    step = [
        uses
        for text, uses in _prepared_on_this_connection()
        # (the lease's one statement also starts with the run's swap; it sets no rev)
        if text.startswith('WITH changed AS (UPDATE "runtime_run" SET "checkpoint_rev"')
    ]
    # Every one of the 12 step commits executed a prepared statement; the steady shape
    # (every step but the last, which ends the run — the first extends no lease it has
    # just taken) was prepared once and executed 11 times.
    assert sum(step) == 12 and max(step) == 11, _prepared_on_this_connection()

    from django.test import override_settings

    connection.close()
    with override_settings(HOLDPOINT_PG_PREPARE=False):
        run = create_run(tenant_a, "perf-tick", {"steps": 5}, actor="t")
        assert advance_run(run.run_id, "t").outcome == "completed"
        assert _prepared_on_this_connection() == []
    connection.close()


def test_postgresql_keeps_the_parameter_adapters_of_statements_that_alternate(
    tenant_a: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An action alternates two one-statement commits (its prepare, its step's), 60 to 90
    parameters each. A psycopg cursor looks up an adapter per parameter whenever its
    statement differs from its last; each such statement has a cursor of its own, so the
    lookups are made once, not again for every action."""
    if connection.vendor != "postgresql":
        pytest.skip("psycopg's adapters are PostgreSQL's")
    from psycopg._adapters_map import AdaptersMap

    lookups = [0]
    real = AdaptersMap.get_dumper

    def counting(self: AdaptersMap, cls: type, format: Any) -> Any:
        lookups[0] += 1
        return real(self, cls, format)

    monkeypatch.setattr(AdaptersMap, "get_dumper", counting)
    per_run = {}
    for actions in (3, 9):
        run = create_run(tenant_a, "perf-acts", {"steps": actions}, actor="t")
        lookups[0] = 0
        assert advance_run(run.run_id, "w", slice_seconds=600).outcome == "completed"
        per_run[actions] = lookups[0]
    # Six more actions, twelve more one-statement commits: no more lookups than a couple of
    # parameters of a new Python type would make (a cursor per statement: ~19 per action).
    assert per_run[9] - per_run[3] <= 6, per_run


def test_every_statement_of_a_step_names_the_run_and_its_fence(tenant_a: Tenant) -> None:
    """The cheaper statements are still the fenced compare-and-swap: a stale executor's
    step commit changes nothing (asserted on the SQL the commit sends)."""
    seen = cost(tenant_a, "perf-tick", 3)
    if connection.vendor == "sqlite":  # an INSERT into the view: its trigger has the CAS
        from runtime import sqlitestep

        sent = [s for s in seen["sql"] if s.startswith(f"INSERT INTO {sqlitestep.VIEW} ")]
        assert len(sent) == 3 and all("fence" in s and "expect_rev" in s for s in sent)
        trigger = sqlitestep.installed(connection)[sqlitestep.TRIGGER]
        assert "fence = NEW.fence" in trigger and "checkpoint_rev = NEW.expect_rev" in trigger
        return
    cas = [s for s in seen["sql"] if "UPDATE" in s and "runtime_run" in s and "checkpoint_rev" in s]
    assert cas and all('"fence" = ' in s and '"checkpoint_rev" = ' in s for s in cas)


# --- the journal head the executor carries -------------------------------------------------


def _append(stream: str, tenant: Tenant, label: str) -> None:
    with transaction.atomic():
        journal.append(stream, "note", tenant_id=tenant.id, actor=label, payload={"n": label})


def test_a_remembered_head_that_moved_falls_back_to_the_locked_head(tenant_a: Tenant) -> None:
    stream = "perf:moved"
    with journal.owning(stream):
        _append(stream, tenant_a, "mine-1")  # remembered: seq 1
        in_other_thread(lambda: _append(stream, tenant_a, "reviewer"))  # seq 2, elsewhere
        _append(stream, tenant_a, "mine-2")  # the remembered head is stale: must not fork
    entries = list(JournalEntry.objects.filter(stream=stream).order_by("seq"))
    assert [e.actor for e in entries] == ["mine-1", "reviewer", "mine-2"]
    assert verify_stream(stream) is None


def test_a_head_remembered_from_a_rolled_back_transaction_never_matches(
    tenant_a: Tenant,
) -> None:
    """The swap names seq *and* hash: after a rollback another writer takes the same seq;
    a swap on seq alone would chain the next entry onto an entry that does not exist."""
    stream = "perf:rolled-back"
    with journal.owning(stream):
        _append(stream, tenant_a, "mine-1")
        with transaction.atomic():
            journal.append(stream, "note", tenant_id=tenant_a.id, actor="lost", payload={})
            transaction.set_rollback(True)  # remembered seq 2 "lost" never committed
        in_other_thread(lambda: _append(stream, tenant_a, "reviewer"))  # takes seq 2
        _append(stream, tenant_a, "mine-2")
    entries = list(JournalEntry.objects.filter(stream=stream).order_by("seq"))
    assert [e.actor for e in entries] == ["mine-1", "reviewer", "mine-2"]
    assert verify_stream(stream) is None


def test_a_batch_is_chained_and_written_together(tenant_a: Tenant) -> None:
    stream = "perf:batch"
    with transaction.atomic(), journal.batched(stream):
        for n in range(3):
            journal.append(stream, "note", tenant_id=tenant_a.id, actor=f"a{n}", payload={})
        assert not JournalEntry.objects.filter(stream=stream).exists()  # not yet
    assert list(
        JournalEntry.objects.filter(stream=stream).order_by("seq").values_list("actor", "seq")
    ) == [("a0", 1), ("a1", 2), ("a2", 3)]
    assert verify_stream(stream) is None


def test_a_batch_that_fails_writes_nothing(tenant_a: Tenant) -> None:
    stream = "perf:batch-fails"
    with pytest.raises(RuntimeError), transaction.atomic(), journal.batched(stream):
        journal.append(stream, "note", tenant_id=tenant_a.id, actor="a", payload={})
        raise RuntimeError("the change failed")
    assert not JournalEntry.objects.filter(stream=stream).exists()
    _append(stream, tenant_a, "after")
    assert verify_stream(stream) is None


def test_an_executor_and_a_reviewer_interleave_on_a_run_stream(tenant_a: Tenant) -> None:
    """Someone else appends to the run's stream between two of the executor's steps (as a
    decision does): the executor's next commit must chain after it."""
    run = create_run(tenant_a, "perf-tick", {"steps": 4}, actor="t")
    appended = threading.Event()

    def interleave() -> None:
        def other() -> None:
            with transaction.atomic():
                record(Run.objects.get(pk=run.pk), RunEvent.WOKEN, "user:r", reason="x")
            appended.set()

        in_other_thread(other)

    original = tick.steps["count"]

    def step(ctx: StepContext) -> Outcome:
        if ctx.state.get("i") == 1 and not appended.is_set():
            interleave()
        return original(ctx)

    tick.steps["count"] = step
    try:
        assert advance_run(run.run_id, "w", slice_seconds=60).outcome == "completed"
    finally:
        tick.steps["count"] = original
    assert appended.is_set()
    assert verify_stream(journal.run_stream(run.run_id)) is None


# --- a fresh step visit does not look for an earlier action ---------------------------------


def test_an_action_of_this_visit_that_exists_after_all_is_found_not_duplicated(
    tenant_a: Tenant,
) -> None:
    """The lookup is skipped for a visit that just began; if an action with its key exists
    anyway, the unique key refuses a second one and the step gets the first one's result —
    and the tool is not called again."""
    run = create_run(tenant_a, "perf-acts", {"steps": 1}, actor="t")
    forms = actionkeys.canonical_params({"n": 1, "pad": ""})
    text, fingerprint = forms.text, forms.fingerprint
    Action.objects.create(
        tenant=tenant_a,
        run=run,
        idempotency_key=actionkeys.idempotency_key(run, "act_1", 1),
        tool="perf.effect",
        params=text,
        fingerprint=fingerprint,
        requested_fingerprint=fingerprint,
        goal_rev=1,
        fence=0,
        step="act_1",
        call_index=1,
        status=ActionStatus.CONFIRMED,
        external_id="earlier",
    )
    assert advance_run(run.run_id, "w", slice_seconds=60).outcome == "completed"
    assert CALLS == []
    assert Action.objects.filter(run=run).count() == 1


# --- `sent` without the full re-check only when nothing can hold the action -----------------


def _one_action_run(tenant: Tenant, tool: str = "perf.effect") -> Run:
    return create_run(tenant, "perf-acts", {"steps": 1, "tool": tool}, actor="t")


# Before the send: for perf.effect-once between its prepare commit and its `sent` mark; for
# perf.effect (prepared and marked sent in one commit) before that commit.
BOTH_TOOLS = pytest.mark.parametrize("tool", ["perf.effect", "perf.effect-once"])


@BOTH_TOOLS
def test_a_policy_added_before_the_send_still_holds_the_action(tenant_a: Tenant, tool: str) -> None:
    BEFORE_SEND.append(
        lambda: ApprovalPolicy.objects.create(tenant=tenant_a, name="hold", tool=tool)
    )
    run = _one_action_run(tenant_a, tool)
    result = advance_run(run.run_id, "w", slice_seconds=60)
    run.refresh_from_db()
    action = Action.objects.get(run=run)
    assert (result.outcome, run.status) == ("waiting", RunStatus.WAITING_APPROVAL)
    assert action.status == ActionStatus.AWAITING_APPROVAL
    assert ApprovalRequest.objects.filter(action=action, status="pending").exists()
    assert CALLS == []


# A prepare written as one statement (PostgreSQL) guards on "no active policy names the
# tool"; any such policy sends it to the transaction, where `policy_for` judges it. Each case:
# whether the action waits, the statements the prepare took, and that nothing is left of the
# statement that did not write (one action, the run's stream intact).
POLICIES = {
    "holds": ({}, True),
    "inactive": ({"active": False}, False),
    "exempts": ({"required": False}, False),
    "holds another param": ({"condition": {"param": "n", "op": "gt", "value": 100}}, False),
    "holds this param": ({"condition": {"param": "n", "op": "eq", "value": 1}}, True),
}


@pytest.mark.parametrize("kind", list(POLICIES))
def test_a_policy_of_the_tool_is_judged_whichever_way_the_prepare_is_written(
    tenant_a: Tenant, kind: str
) -> None:
    fields, held = POLICIES[kind]
    ApprovalPolicy.objects.create(tenant=tenant_a, name="p", tool="perf.effect", **fields)
    run = _one_action_run(tenant_a)
    with counted() as seen:
        result = advance_run(run.run_id, "w", slice_seconds=60)
    [action] = Action.objects.filter(run=run)
    if held:
        assert result.outcome == "waiting" and CALLS == []
        assert action.status == ActionStatus.AWAITING_APPROVAL
    else:
        assert result.outcome == "completed" and len(CALLS) == 1
        assert action.status == ActionStatus.CONFIRMED
    assert verify_stream(journal.run_stream(run.run_id)) is None
    # PostgreSQL, a policy that names the tool: the one statement's guard refused it (nothing
    # of it was written: one action above), and the transaction inserted the action.
    tries = 2 if connection.vendor == "postgresql" and kind != "inactive" else 1
    assert sum('INSERT INTO "runtime_action"' in sql for sql in seen["sql"]) == tries
    # The next action of the tool goes straight to the transaction for a while (a hint: the
    # policy is judged there all the same).
    again = _one_action_run(tenant_a)
    with counted() as seen:
        advance_run(again.run_id, "w", slice_seconds=60)
    assert sum('INSERT INTO "runtime_action"' in sql for sql in seen["sql"]) == 1
    assert Action.objects.get(run=again).status == action.status


def test_a_policy_of_another_tenant_does_not_hold_the_action(
    tenant_a: Tenant, tenant_b: Tenant
) -> None:
    ApprovalPolicy.objects.create(tenant=tenant_b, name="hold", tool="perf.effect")
    run = _one_action_run(tenant_a)
    assert advance_run(run.run_id, "w", slice_seconds=60).outcome == "completed"
    assert len(CALLS) == 1


@BOTH_TOOLS
def test_a_takeover_before_the_send_stops_the_old_executor(tenant_a: Tenant, tool: str) -> None:
    run = _one_action_run(tenant_a, tool)

    def take_over() -> None:
        def other() -> None:
            expire_lease(run)
            take_lease(run.run_id, "w2", ttl=30)

        in_other_thread(other)

    BEFORE_SEND.append(take_over)
    result = advance_run(run.run_id, "w1", slice_seconds=60)
    assert result.outcome == "stale"
    assert CALLS == []
    # perf.effect-once's prepare committed, its send was refused; perf.effect's one commit
    # (prepare and sent) was refused whole.
    statuses = list(Action.objects.filter(run=run).values_list("status", flat=True))
    assert statuses == ([ActionStatus.PREPARED] if tool == "perf.effect-once" else [])


@BOTH_TOOLS
def test_a_goal_revision_before_the_send_sends_nothing(tenant_a: Tenant, tool: str) -> None:
    run = _one_action_run(tenant_a, tool)

    def revise() -> None:
        in_other_thread(
            lambda: revise_goal(
                Run.objects.get(pk=run.pk), {"steps": 1, "tool": tool}, 1, actor="user:t"
            )
        )

    BEFORE_SEND.append(revise)
    advance_run(run.run_id, "w1", slice_seconds=60)
    old = list(Action.objects.filter(run=run, goal_rev=1).values_list("status", flat=True))
    # perf.effect-once's prepared action is withdrawn; perf.effect's was never written
    assert old == ([ActionStatus.CANCELLED] if tool == "perf.effect-once" else [])
    assert all(not key.split(":")[1] == "1" for key in CALLS)  # nothing of goal_rev 1 sent
    if tool == "perf.effect":  # the refused commit was a revision to apply: it goes on at once
        assert Action.objects.get(run=run, goal_rev=2).status == ActionStatus.CONFIRMED


# --- a confirmation is written by the step's next commit --------------------------------------


def _journal(run: Run) -> list[tuple[str, Any]]:
    return [
        (e.type, e.payload.get("action_status"))
        for e in JournalEntry.objects.filter(stream=journal.run_stream(run.run_id)).order_by("seq")
    ]


def test_a_goal_revised_after_the_call_keeps_the_result_inert(tenant_a: Tenant) -> None:
    """The effect happened, then the goal moved before the step could commit: the step commit
    that would carry the confirmation is refused, the result is kept on the action as a late
    result (confirmed: it did happen) and advances nothing; the new revision acts anew."""
    run = _one_action_run(tenant_a)
    AFTER_CALL.append(
        lambda: in_other_thread(
            lambda: revise_goal(Run.objects.get(pk=run.pk), {"steps": 1}, 1, actor="user:t")
        )
    )
    assert advance_run(run.run_id, "w1", slice_seconds=60).outcome == "completed"
    old = Action.objects.get(run=run, goal_rev=1)
    assert old.status == ActionStatus.CONFIRMED and old.external_id == f"x-{old.idempotency_key}"
    new = Action.objects.get(run=run, goal_rev=2)
    assert new.status == ActionStatus.CONFIRMED and len(CALLS) == 2
    assert ("late_result_ignored", None) in _journal(run)
    # the old revision's step never committed: the run went on from the revision
    assert not Checkpoint.objects.filter(run=run, goal_rev=1, next_step="act_2").exists()
    assert verify_stream(journal.run_stream(run.run_id)) is None


def test_a_step_that_fails_after_its_action_commits_the_confirmation_with_the_failure(
    tenant_a: Tenant,
) -> None:
    """The failure's commit writes the confirmation: the retried step finds the action
    confirmed and the tool is not called again."""
    run = create_run(tenant_a, "perf-acts", {"steps": 1, "fail_once": True}, actor="t")
    assert advance_run(run.run_id, "w1", slice_seconds=60).outcome == "retrying"
    action = Action.objects.get(run=run)
    assert action.status == ActionStatus.CONFIRMED and len(CALLS) == 1
    run.refresh_from_db()
    assert run.status == RunStatus.RETRYING
    Run.objects.filter(pk=run.pk).update(wake_at=None, status=RunStatus.QUEUED)
    assert advance_run(run.run_id, "w2", slice_seconds=60).outcome == "completed"
    assert len(CALLS) == 1 and Action.objects.filter(run=run).count() == 1
    assert verify_stream(journal.run_stream(run.run_id)) is None


def test_actions_of_one_step_each_confirm_with_the_next_commit(tenant_a: Tenant) -> None:
    """Three actions in one step: the first two are confirmed by the next action's prepare
    commit, the last by the step commit — every one confirmed, in journal order, once."""
    run = create_run(tenant_a, "perf-acts", {"steps": 1, "more": 2}, actor="t")
    with counted() as seen:
        assert advance_run(run.run_id, "w1", slice_seconds=60).outcome == "completed"
    actions = list(Action.objects.filter(run=run).order_by("call_index"))
    assert [a.status for a in actions] == [ActionStatus.CONFIRMED] * 3 and len(CALLS) == 3
    statuses = [status for kind, status in _journal(run) if status is not None]
    assert statuses == ["prepared", "sent"] + ["confirmed", "prepared", "sent"] * 2 + [
        "confirmed"
    ], statuses
    assert seen["commits"] <= 3 + 2  # three prepares, the step, the lease taken and given up
    # the last confirmation is journalled ahead of the step commit it rode with
    assert [kind for kind, _ in _journal(run)][-2:] == ["action_outcome", "step_committed"]
    assert verify_stream(journal.run_stream(run.run_id)) is None


def test_a_confirmation_whose_action_moved_writes_nothing_of_its_commit(tenant_a: Tenant) -> None:
    """Someone moved the action out of `sent` between its call and the step commit that
    carries its confirmation: that commit writes nothing — no checkpoint, no journal entry,
    the action as the other writer left it — whether it goes as PostgreSQL's one statement
    (the confirmation a part of it: it writes no row, so the statement fails whole) or as a
    transaction; the chain still verifies."""
    run = create_run(tenant_a, "perf-acts", {"steps": 2}, actor="t")

    def move() -> None:
        in_other_thread(lambda: Action.objects.filter(run=run).update(status=ActionStatus.FAILED))

    AFTER_CALL.append(move)
    entries = len(_journal(run))
    result = advance_run(run.run_id, "w1", slice_seconds=60)
    assert result.outcome != "completed" and len(CALLS) == 1, result
    assert Action.objects.get(run=run).status == ActionStatus.FAILED
    assert not Checkpoint.objects.filter(run=run, next_step="act_2").exists()
    confirmed = [kind for kind, status in _journal(run)[entries:] if status == "confirmed"]
    assert confirmed == []
    assert verify_stream(journal.run_stream(run.run_id)) is None


def test_a_stale_fence_is_refused_by_mark_sent_itself(tenant_a: Tenant) -> None:
    """The ledger function on its own (no executor): the fast path must refuse as the full
    one does."""
    run = _one_action_run(tenant_a)
    lease = take_lease(run.run_id, "w1", ttl=30)
    forms = actionkeys.canonical_params({"n": 1})
    text, fingerprint = forms.text, forms.fingerprint
    action = Action.objects.create(
        tenant=tenant_a,
        run=run,
        idempotency_key="k-stale",
        tool="perf.effect",
        params=text,
        fingerprint=fingerprint,
        goal_rev=1,
        fence=lease.fence,
        step="act_1",
        call_index=1,
    )
    expire_lease(run)
    take_lease(run.run_id, "w2", ttl=30)
    with pytest.raises(StaleFence):
        ledger.mark_sent(action, lease.fence, 30, Ledgered(name="x"), lease.actor)
    action.refresh_from_db()
    assert action.status == ActionStatus.PREPARED and action.attempts == 0


# --- an unchanged state is checkpointed as one reference -------------------------------------


def test_checkpoints_around_an_action_refer_to_the_unchanged_state(tenant_a: Tenant) -> None:
    """A state of a few hundred bytes stays inline in a step's checkpoint; the checkpoints
    around the next step's action keep it as one reference to its blob, which decodes to
    the same state."""
    pad = "p" * 300
    run = create_run(tenant_a, "perf-acts", {"steps": 2, "pad": pad}, actor="t")
    assert advance_run(run.run_id, "w", slice_seconds=60).outcome == "completed"
    by_step = {}
    for c in Checkpoint.objects.filter(run=run).order_by("rev"):
        by_step.setdefault(c.step, []).append(c)
    step_commit, *_ = [c for c in by_step["act_1"] if c.next_step == "act_2"]
    assert step_commit.state == {"i": 1, "pad": pad}  # a new state: inline
    around = [c for c in by_step["act_2"] if c.next_step == "act_2"]
    assert len(around) == 1  # the prepare's (the outcome is written with the step commit)
    for checkpoint in around:
        assert set(checkpoint.state) == {"$ref"}
        assert resolve(tenant_a.id, checkpoint.state) == {"i": 1, "pad": pad}


# --- the faster canonical forms are the same bytes -------------------------------------------

_valid = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_scalars = st.one_of(
    st.text(),
    st.integers(min_value=-(2**60), max_value=2**60),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
)


_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.django_db(transaction=False)
@settings(max_examples=500, deadline=None)
@given(_json)
def test_the_fast_canonical_form_is_canonical_bytes(value: Any) -> None:
    """Journal hashes, checkpoint digests and artifact addresses go through a shortcut; it
    must give the very bytes of `canonical_bytes` — or refuse exactly what it refuses (NUL,
    lone surrogates, ints beyond ±2**53, NaN), else a chain written today fails to verify
    tomorrow and an artifact is stored under another address."""
    try:
        expected: bytes | type[CanonicalError] = canonical_bytes(value)
    except CanonicalError:
        expected = CanonicalError
    try:
        got: bytes | type[CanonicalError] = canonical(value)
    except CanonicalError:
        got = CanonicalError
    assert got == expected


@pytest.mark.django_db(transaction=False)
@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        # (a user key that looks like the encoder's own is boxed, always: not this property)
        st.text(_valid, max_size=40).filter(lambda k: k not in ("$ref", "$chunks", "$literal")),
        st.one_of(
            st.text(_valid, max_size=120),
            st.integers(-(2**53) + 1, 2**53 - 1),
            st.booleans(),
            st.none(),
        ),
        max_size=12,
    )
)
def test_a_state_is_inline_exactly_when_it_is_small(state: dict[str, Any]) -> None:
    """The encoder skips measuring objects it can bound: the result is still inline only
    when the canonical form fits INLINE_LIMIT, and a reference otherwise."""
    encoded = Encoder().encode(state)
    if len(canonical_bytes(state)) <= INLINE_LIMIT:
        assert encoded == state
    else:
        assert set(encoded) == {"$ref"}


# --- a growing list adds one link a step, not a rewritten chunk ------------------------------


def _decoded(encoder: Encoder, encoded: Any) -> Any:
    from runtime.artifacts import decode

    return decode(encoded, {d: json.loads(text) for d, text in encoder.stored.items()})


class _Keeping(Encoder):
    """An encoder that keeps every artifact it ever stored (the database, for this test)."""

    stored: dict[str, str]

    def committed(self) -> None:
        self.stored = {**getattr(self, "stored", {}), **self.new}
        super().committed()


def test_a_list_growing_by_one_item_a_step_stores_one_link_holding_the_item() -> None:
    """100 steps of a list of kilobyte items: each step stores one link — the new item and
    a reference to the link before it — and nothing else but, once every CHUNK items from the
    second full chunk on, the list of the chunks' references. The bytes a step adds do not
    grow with the list, no item is stored twice (not beside its link, not again when its
    chunk fills up), and every state decodes to the list."""
    encoder = _Keeping()
    items = [f"{n:04d}" + "k" * 1020 for n in range(100)]
    item_bytes = len(canonical_bytes(items[0]))
    for n in range(1, 101):
        encoded = encoder.encode({"log": items[:n]})
        new = dict(encoder.new)
        encoder.committed()
        assert _decoded(encoder, encoded) == {"log": items[:n]}
        links = [json.loads(t) for t in new.values() if t.startswith('{"item":')]
        lists = [t for t in new.values() if t.startswith("[")]
        assert [link["item"] for link in links] == [items[n - 1]], n
        assert len(lists) == (n % CHUNK == 0 and n >= 2 * CHUNK), (n, len(lists))
        assert len(new) == 1 + len(lists), (n, len(new))
        assert all(len(text) < 6 * 80 for text in lists)  # a few references
    stored = sum(map(len, encoder.stored.values()))
    assert stored <= 100 * (item_bytes + 100) + 2 * 6 * 80, stored
    every_item = "".join(encoder.stored.values())
    assert all(every_item.count(item) == 1 for item in items)  # each stored exactly once


def test_a_list_of_small_items_keeps_its_chunks_as_lists() -> None:
    """Small items are not worth a link each once their chunk is full: a full chunk of them
    is one stored list, and only the tail past the last full chunk is a chain."""
    encoder = _Keeping()
    items = [{"n": n, "pad": "s" * 40} for n in range(2 * CHUNK + 5)]
    for n in range(1, len(items) + 1):
        encoded = encoder.encode({"log": items[:n]})
        encoder.committed()
        assert _decoded(encoder, encoded) == {"log": items[:n]}
    log = encoded["log"]
    assert log["n"] == len(items) and set(log) == {"$chunks", "n", "$tail"}
    chunks = json.loads(encoder.stored[log["$chunks"]["$ref"]])
    assert [json.loads(encoder.stored[c["$ref"]])[0]["n"] for c in chunks] == [0, CHUNK]


def test_a_tail_whose_links_refer_to_items_stored_beside_them_still_reads() -> None:
    """The form before items moved into their links: `{"item": {"$ref": …}, "prev": …}`."""
    from runtime.artifacts import decode

    big = ["a" * 600, "b" * 600]
    load = {
        "i" * 64: big[0],
        "j" * 64: big[1],
        "l" * 64: {"item": {"$ref": "i" * 64}, "prev": None},
        "m" * 64: {"item": {"$ref": "j" * 64}, "prev": {"$ref": "l" * 64}},
        "c" * 64: list(range(CHUNK)),
    }
    old = {"$chunks": [{"$ref": "c" * 64}], "n": CHUNK + 2, "$tail": {"$ref": "m" * 64}}
    assert decode(old, load) == list(range(CHUNK)) + big


def test_a_list_stored_with_a_partial_last_chunk_still_reads() -> None:
    """The form before tails existed: a last chunk holding fewer than CHUNK items."""
    from runtime.artifacts import decode

    head, rest = list(range(CHUNK)), ["a", "b"]
    load = {"h" * 64: head, "r" * 64: rest}
    old = {"$chunks": [{"$ref": "h" * 64}, {"$ref": "r" * 64}], "n": CHUNK + 2}
    assert decode(old, load) == head + rest
