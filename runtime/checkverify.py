"""Checking that every checkpoint is what its step committed, and that a run can be read back.

The journal's chain proves the journal; a run resumes from its checkpoints and their
artifacts, which are rows beside it. Each step's journal entry records its checkpoint's
digest, so an edit of a checkpoint row, one deleted, or an artifact changed or lost is found
by recomputing: the row's fields hash to its digest (`stepcommit.checkpoint_digest`, in any
of `audit.canonical.digests`' forms, as checkpoints written before RFC 8785 keep theirs), the
journal recorded that same digest for that rev, the revs run 1 … the run's `checkpoint_rev`
with none missing, and every artifact a checkpoint reaches is present and its content
hashes to its address. PostgreSQL's triggers refuse these writes to the application; this
is for the edit made around them (a superuser, a restored backup, a disk) and runs where the
operator's `audit_verify` does, from cron (README, "Audit trail").

It reads, never writes: the runs are walked one at a time, their artifacts read in batched
rounds, each artifact once per run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.db.models import Exists, Min, OuterRef

from audit import journal
from audit.canonical import digests, sha256_hex
from audit.models import JournalEntry
from runtime.artifacts import collect_refs
from runtime.models import Artifact, Checkpoint, Run
from runtime.stepcommit import stored_fields


@dataclass(frozen=True)
class CheckpointBreak:
    run_id: str
    rev: int
    problem: str


def _recorded(run_id: UUID) -> dict[int, str]:
    """rev → the digest its step's journal entry recorded."""
    entries = JournalEntry.objects.filter(
        stream=journal.run_stream(run_id), payload__has_keys=["rev", "digest"]
    ).values_list("payload", flat=True)
    found: dict[int, str] = {}
    for payload in entries:
        rev, digest = payload.get("rev"), payload.get("digest")
        if isinstance(rev, int) and isinstance(digest, str):
            found[rev] = digest
    return found


class _Artifacts:
    """A run's artifacts, each read and checked once: what a checkpoint reaches must be
    there, and its content must hash to its address (the address is sha256 of the content,
    in the form it was written in, so no form needs recomputing)."""

    def __init__(self, tenant_id: int) -> None:
        self.tenant_id = tenant_id
        self.seen: set[str] = set()
        self.problems: dict[str, str] = {}

    def reach(self, encoded: Any) -> list[str]:
        """The problems of every artifact `encoded` reaches, directly or through others."""
        reached: set[str] = set()
        wanted = collect_refs(encoded, set())
        while wanted:
            reached |= wanted
            fresh = wanted - self.seen
            self.seen |= fresh
            wanted = set()
            rows = Artifact.objects.filter(tenant_id=self.tenant_id, digest__in=fresh)
            present: set[str] = set()
            for digest, content in rows.values_list("digest", "content"):
                present.add(digest)
                if sha256_hex(content.encode("utf-8")) != digest:
                    self.problems[digest] = f"artifact {digest[:12]} does not hash to its address"
                    continue
                try:
                    wanted |= collect_refs(json.loads(content), set())
                except ValueError:
                    self.problems[digest] = f"artifact {digest[:12]} is not JSON"
            for digest in fresh - present:
                self.problems[digest] = f"artifact {digest[:12]} is missing"
            wanted -= reached
        return [self.problems[d] for d in sorted(reached) if d in self.problems]


def verify_run(run: Run) -> tuple[int, list[CheckpointBreak]]:
    """(checkpoints checked, what is wrong with them) for one run."""
    name = str(run.run_id)
    recorded = _recorded(run.run_id)
    artifacts = _Artifacts(run.tenant_id)
    breaks: list[CheckpointBreak] = []
    revs: set[int] = set()
    rows = Checkpoint.objects.filter(run_id=run.run_id).order_by("rev")
    for row in rows.iterator(chunk_size=100):
        revs.add(row.rev)
        if row.tenant_id != run.tenant_id:  # no database key checks it (migration 0035)
            breaks.append(CheckpointBreak(name, row.rev, "its tenant is not its run's"))
        if row.digest not in digests({"run": name, **stored_fields(row)}):
            breaks.append(CheckpointBreak(name, row.rev, "its fields do not hash to its digest"))
        journalled = recorded.get(row.rev)
        if journalled is None:
            breaks.append(CheckpointBreak(name, row.rev, "no journal entry records it"))
        elif journalled != row.digest:
            breaks.append(
                CheckpointBreak(name, row.rev, "its digest is not the one its step journalled")
            )
        breaks.extend(CheckpointBreak(name, row.rev, p) for p in artifacts.reach(row.state))
    missing = sorted(set(range(1, run.checkpoint_rev + 1)) - revs)
    breaks.extend(CheckpointBreak(name, rev, "missing") for rev in missing[:10])
    if len(missing) > 10:
        breaks.append(CheckpointBreak(name, missing[10], f"and {len(missing) - 10} more missing"))
    return len(revs), breaks


def runs(tenant_id: int | None = None, run_id: UUID | None = None) -> Iterator[Run]:
    found = Run.objects.only("run_id", "tenant_id", "checkpoint_rev").order_by("created_at")
    if tenant_id is not None:
        found = found.filter(tenant_id=tenant_id)
    if run_id is not None:
        found = found.filter(run_id=run_id)
    return found.iterator(chunk_size=500)


def orphans(tenant_id: int | None = None) -> list[CheckpointBreak]:
    """Checkpoints whose run is gone: no database key keeps a run from being deleted under
    its checkpoints (runtime migration 0035), and the walk by runs cannot meet them. One
    break per run id, at its lowest rev. `tenant_id`: the checkpoints that say they are
    that tenant's."""
    rows = Checkpoint.objects.filter(~Exists(Run.objects.filter(run_id=OuterRef("run_id"))))
    if tenant_id is not None:
        rows = rows.filter(tenant_id=tenant_id)
    lowest = rows.values("run_id").annotate(rev=Min("rev")).order_by("run_id")
    return [CheckpointBreak(str(r["run_id"]), r["rev"], "its run is missing") for r in lowest]


def verify_checkpoints(
    these: Iterable[Run], *, tenant_id: int | None = None, whole: bool = True
) -> tuple[int, int, list[CheckpointBreak]]:
    """(runs checked, checkpoints checked, breaks) over `these` runs — and, when `whole`
    (not one run), the checkpoints left without a run (of `tenant_id`'s, when given)."""
    checked_runs = checked = 0
    breaks: list[CheckpointBreak] = []
    for run in these:
        count, found = verify_run(run)
        checked_runs += 1
        checked += count
        breaks.extend(found)
    if whole:
        breaks.extend(orphans(tenant_id))
    return checked_runs, checked, breaks
