"""The hand-written SQL fast path, below both apps: cursor (fastsql.cursor), value preparation
(fastsql.prep) and the statements built from model metadata (fastsql.statements, over
fastsql.tables: each model's table, and the condition and SET lists, turned into SQL once).

THE RULE — when code uses this package instead of the ORM:

- Only for a statement on a worker's per-step or per-action path (the executor's step commit,
  taking a lease, the ledger's writes on an action, the journal's appends, the prepare-time
  policy question) whose ORM cost a benchmark showed (bench/README.md; the counts are held by
  tests/runtime/test_perf_invariants.py). A statement that runs once per request, per page,
  per sweep or per run uses the ORM, however hot it feels.
- Only the shapes offered here: equality / IN / IS NULL conditions on one table, SET lists of
  values, database-clock values and increments, multi-row inserts, and on PostgreSQL those
  joined into one statement. A query that needs more (a join, an aggregate, a filter of
  another kind) is an ORM query; grow this package only for a measured need.

What it promises, so that a caller can treat a statement from here as the ORM's:

- the ORM's semantics: the same columns, values (each through the field's own
  get_db_prep_save / get_db_prep_value), database-clock expressions compiled by Django's
  compiler, conditional UPDATEs with their row counts, read values through the same
  converters;
- it goes through Django's cursor wrapper: error translation, `connection.execute_wrapper`
  hooks and query capture (CaptureQueriesContext, DEBUG) see every statement — the tests that
  count statements and check tenant conditions (tests/security/test_worker_tenant_queries.py)
  count these too;
- tenant checks stay explicit: `Check(tenant_id)` in a `where`, or `tenant_check()` in an ORM
  filter, names the tenant beside a more selective key on every statement a worker sends.

It imports Django only — never `audit`, `runtime` or `approvals` — so every app may use it.
Reaching into Django's internals (backend cursor classes, `_prepare_cursor`, `Query` and its
compiler) happens here and nowhere else, each place commented.
"""
