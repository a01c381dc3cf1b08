#!/usr/bin/env bash
# Start Holdpoint for local use: the web (reviewer pages, Django admin, API), one worker
# cluster and the sandbox task service, on SQLite under var/. Ctrl-C stops all three, each
# within STOP_GRACE seconds.
#
# Ports and place (README, "Configuration"): HOLDPOINT_WEB_PORT (8000), HOLDPOINT_SANDBOX_PORT
# (8765), HOLDPOINT_VAR_DIR (./var), HOLDPOINT_LOG_FORMAT (console).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VAR_DIR="${HOLDPOINT_VAR_DIR:-var}"
WEB_PORT="${HOLDPOINT_WEB_PORT:-8000}"
SANDBOX_PORT="${HOLDPOINT_SANDBOX_PORT:-8765}"
SANDBOX_URL="http://127.0.0.1:$SANDBOX_PORT"
export HOLDPOINT_BASE_URL="${HOLDPOINT_BASE_URL:-http://127.0.0.1:$WEB_PORT}"
# Readable log lines in a terminal; production writes JSON (README, "Metrics and logs").
export HOLDPOINT_LOG_FORMAT="${HOLDPOINT_LOG_FORMAT:-console}"
# Seconds the processes get to stop by themselves before their process groups are killed.
STOP_GRACE=3

# $VAR_DIR/local.env: DEBUG=1 and a SECRET_KEY generated on the first run and kept after.
# manage.py reads it (config/env.py: only variables the environment does not set), so the
# README's manage.py lines work as written in any new shell.
write_local_env() {
  local file="$VAR_DIR/local.env"
  mkdir -p "$VAR_DIR"
  if [ ! -f "$file" ]; then
    (
      umask 077
      printf '%s\n' \
        "# Local settings for manage.py, written once by \`make run\` (scripts/run.sh)." \
        "# A variable set in the environment wins; with DEBUG=0 there this file is not read." \
        "# Production never reads it: it takes real secrets from its environment." \
        "DEBUG=1" >"$file.tmp"
    )
    mv "$file.tmp" "$file"
  fi
  chmod 600 "$file"
  if ! grep -q '^SECRET_KEY=' "$file"; then
    echo "SECRET_KEY=$($PY -c 'import secrets; print(secrets.token_urlsafe(50))')" >>"$file"
  fi
}

write_local_env
$PY manage.py migrate --noinput
$PY manage.py seed_demo --tracker-url "$SANDBOX_URL"

# Each service runs in a session (and process group) of its own, so the terminal's Ctrl-C
# reaches only this script, which then stops them in order: SIGTERM to each MAIN process
# (SIGTERM to a django-q2 cluster's whole group hangs it: NOTES.md), a bounded wait, then
# SIGKILL to every group still there (a cluster's worker children included).
pids=()
names=()
stop() {
  local code=$1 i pid alive left
  trap - EXIT
  trap '' INT TERM # an impatient second Ctrl-C must not cut the stop short: it is bounded
  echo
  echo "Stopping Holdpoint…"
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for ((i = 0; i < STOP_GRACE * 10; i++)); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  left=()
  for i in "${!pids[@]}"; do
    if kill -KILL -- "-${pids[$i]}" 2>/dev/null; then left+=("${names[$i]}"); fi
  done
  if [ "${#left[@]}" -gt 0 ]; then
    echo "Killed after ${STOP_GRACE} s: ${left[*]} (a run it held resumes when its lease ends)."
  fi
  wait 2>/dev/null || true
  exit "$code"
}
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop $?' EXIT
start() {
  local name=$1
  shift
  setsid "$@" &
  pids+=($!)
  names+=("$name")
}
start sandbox $PY manage.py sandbox_tasks --port "$SANDBOX_PORT" --mode key
start worker $PY manage.py qcluster
start web $PY manage.py serve --port "$WEB_PORT"
sleep 2
cat <<MSG

  Holdpoint is running.
    Reviewer pages   $HOLDPOINT_BASE_URL/        (log in as demo-reviewer)
    Django admin     $HOLDPOINT_BASE_URL/admin/  (demo-admin: tenant "demo" only)
    Probes           $HOLDPOINT_BASE_URL/healthz  /readyz
    Sandbox tasks    $SANDBOX_URL/tasks
  Passwords were printed by seed_demo above the first time it ran (or are
  HOLDPOINT_DEMO_PASSWORD). Agent tokens: .venv/bin/python manage.py agent_token issue demo-agent
  Local settings (DEBUG, SECRET_KEY) for manage.py: $VAR_DIR/local.env
  Ctrl-C stops everything.

MSG
wait -n "${pids[@]}"
