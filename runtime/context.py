"""What a step sees: state, goal, input — and the calls that must not be paid twice."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from audit.canonical import CanonicalError, canonical_bytes
from fastsql.statements import tenant_check
from runtime import observe
from runtime.errors import InvalidParams
from runtime.events import RunEvent, record
from runtime.faults import FaultPoint, fault
from runtime.models import RecordedCall, Run

if TYPE_CHECKING:
    from runtime.leases import Lease


class RecordedCalls(dict[str, Any]):
    """A run's recorded call results, read on first use: a step that records nothing (most
    steps) never pays for the query."""

    def __init__(self, run_id: Any, tenant_id: int) -> None:
        super().__init__()
        self._source: tuple[Any, int] | None = (run_id, tenant_id)

    def _load(self) -> None:
        if self._source is not None:
            run_id, tenant_id = self._source
            self._source = None
            rows = RecordedCall.objects.filter(tenant_check(tenant_id), run_id=run_id)
            self.update(rows.values_list("key", "result"))

    def __contains__(self, key: object) -> bool:
        self._load()
        return super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        self._load()
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: Any) -> None:
        self._load()
        super().__setitem__(key, value)


@dataclass
class StepContext:
    run_id: Any
    tenant_id: int
    step: str
    state: dict[str, Any]
    goal: Any
    goal_rev: int
    checkpoint_rev: int
    lease: Lease
    input: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    now: datetime | None = None
    recorded: dict[str, Any] = field(default_factory=dict)
    # Counters a test or a bench can read: calls really made vs answered from the record.
    calls_made: int = 0
    calls_reused: int = 0
    runner: Any = None  # the executor's ActionRunner
    # This execution began the step visit (no checkpoint since the visit began): nothing of
    # it can have been prepared before, so `act` need not look for an earlier action.
    fresh: bool = False
    # The checkpoint rev the step visit began at (the run's step_rev): re-executions of one
    # visit — after a side-effect checkpoint, a retry, a crash or a graph migration — share
    # it, so a call recorded under the default key is found again, never paid twice.
    visit_rev: int | None = None
    _index: int = 0
    _act_index: int = 0

    def record(self, key: str | None, call: Callable[[], Any]) -> Any:
        """Return the recorded result for `key`, or make the call once and record it.

        Use a key that names the evidence ("spec:shop-v1") to reuse it across goal
        revisions; with None the key is its position in this step visit, reused whenever the
        visit runs again (after a side-effect checkpoint, a retry, a crash, a migration).
        """
        self._index += 1
        return self._record(key or f"{self.step}@{self._visit}#{self._index}", call, "record")

    def _record(self, key: str, call: Callable[[], Any], kind: str) -> Any:
        if self.runner is not None:  # the step's own commit, if still on its way, lands first
            self.runner.host.settled()
        with observe.recording(self, key, kind) as span:
            return self._recorded(key, call, span)

    def _recorded(self, key: str, call: Callable[[], Any], span: Any) -> Any:
        reused = key in self.recorded
        observe.reused(span, reused)
        if reused:
            self.calls_reused += 1
            return self.recorded[key]
        result = call()
        try:
            canonical_bytes(result)
        except CanonicalError as exc:
            raise InvalidParams(f"recorded result of {key!r} is not storable JSON: {exc}") from None
        stored = self._store(key, result)
        self.calls_made += 1
        self.recorded[key] = stored
        fault(FaultPoint.AFTER_RECORD)
        return stored

    def model(self, name: str, call: Callable[[], Any], *, key: str | None = None) -> Any:
        """A paid model call: recorded like any other call, under `model:<name>`."""
        return self._record(key or f"model:{name}@{self.step}@{self._visit}", call, "model")

    @property
    def _visit(self) -> int:
        return self.checkpoint_rev if self.visit_rev is None else self.visit_rev

    def act(self, tool: str, params: dict[str, Any], *, reason: str = "", target: str = "") -> Any:
        """Perform a side effect through the ledger, exactly once, and return its proof.

        Prepared (checkpointed) with a stable idempotency key, `sent` committed before the
        request leaves, confirmed only on a verifiable result. Re-executed after a crash, the
        same call returns the recorded outcome instead of acting again. May park the run: for
        an approval, for reconciliation of an unknown outcome, or for a human.
        """
        self._act_index += 1
        if self.runner is None:
            raise RuntimeError("ctx.act needs an executor")
        return self.runner.act(
            self, tool, params, reason=reason, target=target, call_index=self._act_index
        )

    def _store(self, key: str, result: Any) -> Any:
        """Commit the result now, fenced: a stale executor's result is not recorded."""
        from runtime.leases import refuse_stale

        try:
            with transaction.atomic(durable=True):
                mine = Run.objects.filter(
                    pk=self.run_id, tenant_id=self.tenant_id, fence=self.lease.fence
                )
                if mine.update(updated_at=Now()) != 1:
                    raise _Stale()
                RecordedCall.objects.create(
                    run_id=self.run_id,
                    tenant_id=self.tenant_id,
                    key=key,
                    goal_rev=self.goal_rev,
                    result=result,
                    fence=self.lease.fence,
                )
                run = Run(run_id=self.run_id, tenant_id=self.tenant_id)
                record(run, RunEvent.CALL_RECORDED, self.lease.actor, key=key)
        except _Stale:
            refuse_stale(self.lease, f"record {key}")
        except IntegrityError:
            # Recorded meanwhile (same key): the first result stands, for everyone.
            found = RecordedCall.objects.get(run_id=self.run_id, tenant_id=self.tenant_id, key=key)
            return found.result
        return result


class _Stale(Exception):
    pass
