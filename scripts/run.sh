#!/usr/bin/env bash
# Start Holdpoint for local use: web on 127.0.0.1:8000, one worker cluster, the sandbox task
# service. Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export DEBUG="${DEBUG:-1}"
export HOLDPOINT_TASKS_URL="${HOLDPOINT_TASKS_URL:-http://127.0.0.1:8765}"
mkdir -p var
$PY manage.py migrate --noinput
$PY manage.py seed_demo
pids=()
cleanup() {
  trap - INT TERM EXIT
  echo; echo "Stopping Holdpoint…"
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup INT TERM EXIT
setsid $PY manage.py sandbox_tasks --port 8765 --mode key & pids+=($!)
setsid $PY manage.py qcluster & pids+=($!)
setsid $PY manage.py runserver 127.0.0.1:8000 --noreload & pids+=($!)
sleep 2
cat <<MSG

  Holdpoint is running.
    Reviewer pages   http://127.0.0.1:8000/        (log in as demo-reviewer)
    Django admin     http://127.0.0.1:8000/admin/  (demo-admin: tenant "demo" only)
    Probes           http://127.0.0.1:8000/healthz  /readyz
    Sandbox tasks    $HOLDPOINT_TASKS_URL/tasks
  Passwords were printed by seed_demo above the first time it ran (or are
  HOLDPOINT_DEMO_PASSWORD). Agent tokens: .venv/bin/python manage.py agent_token issue demo-agent
  Ctrl-C stops everything.

MSG
wait -n "${pids[@]}"
