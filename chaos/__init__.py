"""Chaos soak: real workers killed at random and named points while api-review runs create
tasks; the sandbox's own list of tasks is the oracle (TEST-MATRIX.md, A1/A2).

The driver is the calling process (`manage.py chaos`, or a test): it starts a sandbox task
service (unless it is pointed at an operator's own), K `qcluster` workers each in its own
process group, creates N runs, and then, until every run has settled or time is up:

- every ~S seconds (seeded jitter) kills a worker: SIGKILL of its whole group at once (a
  crash at a random instruction), or SIGKILL and a restart armed with HOLDPOINT_FAULTS so the
  replacement dies at a named point; every 10th kill is a graceful SIGTERM, with SIGKILL
  after a grace (a redeploy). Dead workers are restarted at once;
- rings due runs itself every ~0.5 s (the scheduled sweeper has minute granularity);
- plays the reviewer: approves every pending hold point of its runs as soon as it appears
  (a reviewer watching the inbox), through the approvals app's own `decide`;
- plays the human for runs in needs_reconciliation: looks the idempotency key up in the
  service and resolves applied (with the task id) or, once the sender can no longer be in
  flight, not applied. Apart from these two human acts, nothing is moved by hand.

Then it stops every process it started and counts, from GET /tasks and the database:
duplicates, false completions, lost and stuck runs. Nothing here asserts; the caller
decides what a failure is (the command exits 1, the test asserts).

A harness above both apps, beside `bench/`: it may import `runtime` and `approvals`, and
neither imports it. It is a Django app only so that `manage.py chaos` is found.

- `config`: what a soak is asked to do (`ChaosConfig`) and its fixed workload.
- `processes`: child processes — spawning, killing whole groups, the worker fleet.
- `humans`: the two human acts (approving hold points, settling unknown outcomes).
- `accounting`: the oracle's arithmetic and the report (`tally`, `table`).
- `driver`: the loop that ties them together (`run_chaos`).
"""
