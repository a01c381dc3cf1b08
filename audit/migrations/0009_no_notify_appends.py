"""No NOTIFY on appends: the live event streams poll the stream heads (runtime.live).

0006's trigger on the stream head sent `pg_notify('holdpoint_journal', …)` on every journal
append, that is on every durable step commit of every run, for the few web processes that
may be listening. Measured on the bench machine:

- its cost in the step's one-statement commit: 0.049 ms of 0.265 ms execution (EXPLAIN
  ANALYZE); an interleaved A/B, trigger dropped against present, gave the database
  backend's CPU per step -5% (0.285 -> 0.271 ms) and steps/s +2%;
- a transaction that has notified takes a cluster-wide lock at commit (PreCommit_Notify:
  `LockSharedObject(DatabaseRelationId, InvalidOid, 0, AccessExclusiveLock)`), held until
  its commit is flushed, so every appending commit of every worker was serialized across
  the cluster, fsync included: a 2-worker bench showed `Lock/object` waits on the step's
  statement in pg_stat_activity;
- LISTEN does not work through a pooler in transaction mode, and it held a connection per
  web process.

The web process now reads the watched stream heads every `runtime.live.POLL_SECONDS`, as
it did on SQLite: one indexed query per process per interval, only while it has streams
open. The reverse puts 0006's function and trigger back as they were.
"""

import importlib

from django.db import migrations

notify = importlib.import_module("audit.migrations.0006_notify_appends")  # its SQL, both ways


class Migration(migrations.Migration):
    dependencies = [("audit", "0008_append_only_gate_by_schema")]
    operations = [migrations.RunPython(notify.uninstall, notify.install)]
