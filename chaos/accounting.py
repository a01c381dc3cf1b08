"""The oracle: what the soak counts, from the service's own task list and the database.

`tally` works on plain rows, so the arithmetic is checked without any process (a green soak
must mean "nothing happened", not "the checker cannot see"); `table` is what
`manage.py chaos` prints.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from runtime.models import TERMINAL, ActionStatus, RunStatus

# Not lost although not terminal: a human's turn. (A run waiting for approval is not lost
# either while one of its actions still awaits a decision: nobody may have been allowed
# to decide. Waiting with nothing left to decide, it is lost: nothing will wake it.)
NOT_LOST = TERMINAL | {RunStatus.NEEDS_RECONCILIATION}


@dataclass
class ChaosReport:
    runs: int
    mode: str
    workers: int
    seed: int
    kill_every: float
    rate: float = 0.0
    service_delay: float = 0.0
    completed: int = 0
    needs_reconciliation: int = 0
    waiting_approval: int = 0
    stuck: int = 0  # neither completed, nor needs_reconciliation, nor waiting for approval
    by_status: dict[str, int] = field(default_factory=dict)
    tasks_created: int = 0
    tasks_expected: int = 0
    tasks_in_service: int = 0
    duplicates: int = 0
    unexpected_tasks: int = 0  # carry one of our run ids but no key of our actions
    false_confirmations: int = 0
    false_run_completions: int = 0
    false_completions: int = 0
    lost: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    kills_total: int = 0
    armed: dict[str, int] = field(default_factory=dict)
    graceful: dict[str, int] = field(default_factory=dict)
    unexpected_exits: int = 0
    sweep_errors: dict[str, int] = field(default_factory=dict)
    worker_task_errors: dict[str, int] = field(default_factory=dict)
    human_resolutions: dict[str, int] = field(default_factory=dict)
    approvals: dict[str, int] = field(default_factory=dict)
    max_fence: int = 0
    max_fence_run: str = ""
    timed_out: bool = False
    elapsed_seconds: float = 0.0
    log_dir: str = ""
    # One line per run that broke an invariant or did not finish: where to start looking.
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.duplicates or self.false_completions or self.lost)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def tally(
    report: ChaosReport,
    runs: Sequence[Mapping[str, Any]],
    actions: Sequence[Mapping[str, Any]],
    tasks: Sequence[Mapping[str, Any]],
) -> ChaosReport:
    """The oracle's arithmetic, on plain rows (so it can be checked without processes).

    runs: run_id, status, fence; actions (tasks.create only): run_id, idempotency_key,
    status, external_id; tasks: GET /tasks rows (id, idempotency_key, run_id).
    """
    run_ids = {str(r["run_id"]) for r in runs}
    keys = {a["idempotency_key"] for a in actions}
    tasks_by_key: dict[str, list[str]] = {}
    mine = 0
    for task in tasks:
        key, run_id = task.get("idempotency_key"), str(task.get("run_id") or "")
        if isinstance(key, str) and key in keys:
            tasks_by_key.setdefault(key, []).append(str(task["id"]))
            mine += 1
        elif run_id in run_ids:
            mine += 1
            report.unexpected_tasks += 1
            report.problems.append({"kind": "unexpected_task", "run_id": run_id, "task": task})
    report.tasks_in_service = len(tasks)
    report.tasks_created = mine
    report.tasks_expected = len(runs)
    for key, ids in tasks_by_key.items():
        if len(ids) > 1:
            report.duplicates += len(ids) - 1
            run_id = next(str(a["run_id"]) for a in actions if a["idempotency_key"] == key)
            report.problems.append(
                {"kind": "duplicate", "run_id": run_id, "key": key, "tasks": ids}
            )

    actions_by_run: dict[str, list[Mapping[str, Any]]] = {}
    for action in actions:
        actions_by_run.setdefault(str(action["run_id"]), []).append(action)
        ids = tasks_by_key.get(action["idempotency_key"], [])
        # Confirmed must name an effect the service has under that key: no task, or a
        # different one, is a completion nobody can verify.
        if action["status"] == ActionStatus.CONFIRMED and action["external_id"] not in ids:
            report.false_confirmations += 1
            report.problems.append(
                {
                    "kind": "confirmed_without_task",
                    "run_id": str(action["run_id"]),
                    "key": action["idempotency_key"],
                    "external_id": action["external_id"],
                    "tasks": ids,
                }
            )

    statuses: Counter[str] = Counter()
    for run in runs:
        run_id, status = str(run["run_id"]), run["status"]
        statuses[status] += 1
        if run["fence"] > report.max_fence:
            report.max_fence, report.max_fence_run = run["fence"], run_id
        own = actions_by_run.get(run_id, [])
        has_task = any(tasks_by_key.get(a["idempotency_key"]) for a in own)
        if status == RunStatus.COMPLETED and not has_task:
            report.false_run_completions += 1
            report.problems.append(
                {
                    "kind": "completed_without_task",
                    "run_id": run_id,
                    "actions": [(a["idempotency_key"], a["status"]) for a in own],
                }
            )
        deciding = any(a["status"] == ActionStatus.AWAITING_APPROVAL for a in own)
        if status not in NOT_LOST and not (status == RunStatus.WAITING_APPROVAL and deciding):
            report.lost += 1
            report.problems.append(
                {
                    "kind": "lost",
                    "run_id": run_id,
                    "status": status,
                    "actions": [a["status"] for a in own],
                }
            )
    report.false_completions = report.false_confirmations + report.false_run_completions
    report.by_status = dict(sorted(statuses.items()))
    report.completed = statuses[RunStatus.COMPLETED]
    report.needs_reconciliation = statuses[RunStatus.NEEDS_RECONCILIATION]
    report.waiting_approval = statuses[RunStatus.WAITING_APPROVAL]
    report.stuck = len(runs) - (
        report.completed + report.needs_reconciliation + report.waiting_approval
    )
    return report


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"


def _errors(errors: Mapping[str, int]) -> str:
    if not errors:
        return "0"
    message, count = next(iter(errors.items()))
    return f"{sum(errors.values())}  (most often, {count}x: {message[:100]})"


def table(report: ChaosReport) -> str:
    """The report as an aligned two-column table (what the command prints)."""
    rows: list[tuple[str, str]] = [
        ("runs completed", f"{report.completed} / {report.runs}"),
        ("runs in needs_reconciliation", str(report.needs_reconciliation)),
        ("runs waiting for approval", str(report.waiting_approval)),
        ("runs stuck (other)", f"{report.stuck}  ({_counts(report.by_status)})"),
        ("tasks created / expected", f"{report.tasks_created} / {report.tasks_expected}"),
        ("duplicates", str(report.duplicates)),
        (
            "false completions",
            f"{report.false_completions}  (confirmed without task {report.false_confirmations}"
            f", completed run without task {report.false_run_completions})",
        ),
        ("lost", str(report.lost)),
        ("unexpected tasks", str(report.unexpected_tasks)),
        ("kills injected", f"{report.kills_total}  ({_counts(report.kills)})"),
        ("restarts armed", _counts(report.armed)),
        ("graceful stops", _counts(report.graceful)),
        ("unexpected worker exits", str(report.unexpected_exits)),
        ("driver sweep errors", _counts(report.sweep_errors)),
        ("worker task errors", _errors(report.worker_task_errors)),
        ("approvals given", _counts(report.approvals)),
        (
            "human resolutions",
            f"{sum(report.human_resolutions.values())}  ({_counts(report.human_resolutions)})",
        ),
        ("max fence", f"{report.max_fence}  (run {report.max_fence_run or '-'})"),
        ("timed out", "yes" if report.timed_out else "no"),
        ("elapsed", f"{report.elapsed_seconds:.1f} s"),
        ("seed", str(report.seed)),
        ("logs", report.log_dir),
    ]
    width = max(len(label) for label, _ in rows)
    head = (
        f"chaos: {report.runs} api-review runs, mode {report.mode}, {report.workers} workers, "
        f"a kill every ~{report.kill_every:g}s, "
        + (f"{report.rate:g} runs/s" if report.rate else "all runs at once")
        + (f", service delay {report.service_delay:g}s" if report.service_delay else "")
    )
    lines = [head, "-" * len(head)]
    lines += [f"{label:<{width}}  {value}" for label, value in rows]
    for problem in report.problems[:20]:
        lines.append("! " + json.dumps(problem, default=str))
    if len(report.problems) > 20:
        lines.append(f"! … {len(report.problems) - 20} more in {report.log_dir}/report.json")
    lines.append("result: " + ("OK" if report.ok else "FAILED"))
    return "\n".join(lines)
