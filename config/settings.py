"""Holdpoint settings, read from the environment (see README, "Configuration")."""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import dj_database_url
import django_stubs_ext
from csp.constants import NONE, SELF

from config.env import (
    EnvError,
    env_bool,
    env_fernet_keys,
    env_int,
    env_list,
    env_str,
    env_token,
    stderr_is_terminal,
)

# The code names its admin and form classes' model for the type checker (`ModelAdmin[Run]`,
# `ModelForm[Membership]`), which needs Django's generic classes subscriptable at run time.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("HOLDPOINT_VAR_DIR", str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = env_bool("DEBUG", False)
TESTING = env_bool("HOLDPOINT_TESTING", False)

_secret = env_str("SECRET_KEY", "")
if not _secret:
    if not (DEBUG or TESTING):
        raise EnvError("SECRET_KEY is required when DEBUG is off")
    _secret = "insecure-development-key-" + "x" * 40
SECRET_KEY = _secret
SECRET_KEY_FALLBACKS = env_list("SECRET_KEY_FALLBACKS", [])
# Fernet keys for tool credentials at rest, newest first (runtime/crypto.py); derived from
# SECRET_KEY only in development and tests.
HOLDPOINT_SECRET_KEYS = env_fernet_keys(
    "HOLDPOINT_SECRET_KEYS", derive_from=SECRET_KEY if DEBUG or TESTING else None
)

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "guardian",
    "axes",
    "csp",
    "django_q",
    "audit",
    "runtime",
    "approvals",
    "chaos",  # only for `manage.py chaos` (the soak harness above both apps)
]

MIDDLEWARE = [
    "runtime.middleware.ClientHeaders",  # first: nothing stores a control character
    "runtime.tracing.TraceRequests",  # a span per request, continuing the agent's traceparent
    "runtime.logs.RequestContext",  # each request's log lines: its run, action, tenant
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "runtime.middleware.NoStore",
    "runtime.accounts.SessionTimeoutMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "runtime.tenancy.CurrentTenantMiddleware",
    "runtime.middleware.AdminQueryNul",  # a NUL in an admin URL's query: 400, not a 500
    "axes.middleware.AxesMiddleware",  # last: turns a lockout into the lockout page
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "runtime.tenancy.tenant_context",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------
# SQLite is the embedded default. WAL + synchronous=FULL: with NORMAL a power loss can undo
# the last commits, and a lost `sent` mark would break "prepared means certainly not sent".
# IMMEDIATE transactions take the write lock at BEGIN so concurrent writers queue (up to
# the busy timeout) instead of failing with "database is locked" on lock upgrade.
_SQLITE_INIT = (
    "PRAGMA journal_mode=WAL;"
    "PRAGMA synchronous=FULL;"
    "PRAGMA foreign_keys=ON;"
    "PRAGMA busy_timeout=30000;"
)
_default_db = f"sqlite:///{VAR_DIR / 'holdpoint.sqlite3'}"
# Set but empty (`DATABASE_URL=` in a shell, `${DATABASE_URL}` of an unset variable in a
# compose file) counts as unset, as dj-database-url's own `config()` takes it.
DATABASE_URL = env_str("DATABASE_URL", "").strip() or _default_db
try:
    _db = dj_database_url.parse(DATABASE_URL, conn_max_age=env_int("DB_CONN_MAX_AGE", 600))
except Exception as exc:  # dj_database_url raises several types for a bad URL
    raise EnvError(f"DATABASE_URL is not a valid database URL: {exc}") from None
if _db["ENGINE"] == "django.db.backends.sqlite3":
    _db["OPTIONS"] = {"transaction_mode": "IMMEDIATE", "init_command": _SQLITE_INIT, "timeout": 30}
    _db["CONN_MAX_AGE"] = 0 if TESTING else _db["CONN_MAX_AGE"]
    # Per process, so two test runs on one machine never share (and corrupt) a database.
    _db["TEST"] = {"NAME": str(VAR_DIR / f"test-holdpoint-{os.getpid()}.sqlite3")}
elif _db["ENGINE"] == "django.db.backends.postgresql":
    _db["CONN_HEALTH_CHECKS"] = True
    # Django opens connections with psycopg's prepare_threshold None, and then psycopg
    # ignores even an explicit prepare=True. 0 lets the worker's hot-path cursor prepare
    # (fastsql.cursor; HOLDPOINT_PG_PREPARE below); Django's own cursors bind on the
    # client and are never prepared, whatever the threshold.
    if env_bool("HOLDPOINT_PG_PREPARE", True):
        _db.setdefault("OPTIONS", {})["prepare_threshold"] = 0
DATABASES = {"default": _db}
# What the workers keep their connections for: the ASGI web process sets its own to 0
# (config/asgi.py), and doctor's "connections" check, served there by /readyz too, is about
# the workers (runtime.health.check_connections).
HOLDPOINT_WORKER_CONN_MAX_AGE = _db["CONN_MAX_AGE"]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Auth -------------------------------------------------------------------------------
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: a locked-out client is refused unchecked
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]
ANONYMOUS_USER_NAME = None  # guardian: no anonymous user row, nobody inherits its perms
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "inbox"
LOGOUT_REDIRECT_URL = "login"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Sessions end after SESSION_COOKIE_AGE seconds without a request the reviewer made (htmx's
# background polls do not count: runtime.accounts.SessionTimeoutMiddleware), and in any case
# HOLDPOINT_SESSION_MAX_AGE seconds after login (OWASP ASVS 3.3.2: 30 min idle, 12 h).
SESSION_COOKIE_AGE = env_int("SESSION_COOKIE_AGE", 30 * 60, minimum=60)
HOLDPOINT_SESSION_MAX_AGE = env_int("HOLDPOINT_SESSION_MAX_AGE", 12 * 3600, minimum=60)
SESSION_SAVE_EVERY_REQUEST = False  # the middleware above renews the expiry instead
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_SAMESITE = "Lax"
# django-axes: after AXES_FAILURE_LIMIT failed logins for one username from one client
# address, that pair is refused (HTTP 429, the lockout page) until COOLOFF minutes pass with
# no further failure. Keyed on the pair so nobody can lock a reviewer out from elsewhere.
AXES_ENABLED = env_bool("HOLDPOINT_LOGIN_LOCKOUT", True)
AXES_FAILURE_LIMIT = env_int("HOLDPOINT_LOGIN_FAILURE_LIMIT", 5, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("HOLDPOINT_LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_HTTP_RESPONSE_CODE = 429
AXES_LOCKOUT_CALLABLE = "runtime.accounts.locked_out"
AXES_CLIENT_IP_CALLABLE = "runtime.accounts.client_ip"
AXES_ENABLE_ADMIN = False  # attempts span tenants; `manage.py axes_reset_username` unlocks
# Failed logins of one person are journalled once per window with a count (runtime/accounts.py).
HOLDPOINT_LOGIN_FAILURE_WINDOW = timedelta(
    minutes=env_int("HOLDPOINT_LOGIN_FAILURE_WINDOW_MINUTES", 15, minimum=1)
)
# Decisions one reviewer may post on the request pages (the API has HOLDPOINT_API_RATE).
HOLDPOINT_DECISION_RATE = env_str("HOLDPOINT_DECISION_RATE", "60/minute")
if not re.fullmatch(r"[1-9]\d*/(second|minute|hour|day)", HOLDPOINT_DECISION_RATE):
    raise EnvError(
        "HOLDPOINT_DECISION_RATE must look like 60/minute (per second, minute, hour or day), "
        f"got {HOLDPOINT_DECISION_RATE!r}"
    )
# Reverse proxies in front of Holdpoint that append to X-Forwarded-For (0: clients connect
# directly and REMOTE_ADDR is the client; a forged header is then ignored).
HOLDPOINT_PROXY_COUNT = env_int("HOLDPOINT_PROXY_COUNT", 0, minimum=0)

# --- Security headers (production values unless DEBUG) -----------------------------------
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
# django-csp 4: only our own files run. No inline script, style or handler anywhere (htmx and
# triage.js are static files; htmx is told not to inject its indicator style); nothing may
# frame a page, and forms post only to Holdpoint. The Swagger UI page widens img-src alone.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF],
        "connect-src": [SELF],
        "font-src": [SELF],
        "object-src": [NONE],
        "base-uri": [NONE],
        "frame-src": [NONE],
        "frame-ancestors": [NONE],
        "form-action": [SELF],
    },
}
if not DEBUG:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # /healthz and /readyz are probed over plain HTTP by load balancers and supervisors.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]

# --- I18N / static ----------------------------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise scans it at start-up
WHITENOISE_USE_FINDERS = DEBUG or TESTING  # serve from app dirs without collectstatic
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": (
            "django.contrib.staticfiles.storage.StaticFilesStorage"
            if DEBUG or TESTING
            else "whitenoise.storage.CompressedManifestStaticFilesStorage"
        )
    },
}

# --- REST framework ---------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "runtime.auth.AgentTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["runtime.api.parsers.StrictJSONParser"],
    "EXCEPTION_HANDLER": "runtime.api.problems.exception_handler",
    "DEFAULT_THROTTLE_RATES": {
        "agent": env_str("HOLDPOINT_API_RATE", "600/minute"),
        "user": env_str("HOLDPOINT_API_RATE", "600/minute"),
    },
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Holdpoint API",
    "VERSION": "1",
    "OAS_VERSION": "3.0.3",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",  # served from static/, no CDN
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    # No validator badge: it would send the schema's URL to validator.swagger.io (and the
    # CSP refuses the image anyway).
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "RunStatusEnum": "runtime.models.runs.RunStatus",
        "ActionStatusEnum": "runtime.models.actions.ActionStatus",
        "ApprovalStatusEnum": "approvals.models.ApprovalStatus",
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "runtime.api.problems.add_problem_responses",
    ],
}

# --- Worker: django-q2 ------------------------------------------------------------------
REDIS_URL = env_str("REDIS_URL", "")
# The queue is a doorbell, never the truth: a lost or duplicated task is harmless because the
# run row's lease and fence decide who executes. retry > timeout so the ORM broker does not
# redeliver a task that is still running.
Q_CLUSTER: dict[str, object] = {
    "name": "holdpoint",
    # One worker of each cluster spends most of each minute in the sweeper when it holds
    # the schedule; the others advance runs.
    "workers": env_int("HOLDPOINT_WORKERS", 3, minimum=2),
    "timeout": env_int("HOLDPOINT_TASK_TIMEOUT", 300, minimum=5),
    "retry": env_int("HOLDPOINT_TASK_TIMEOUT", 300, minimum=5) + 60,
    "max_attempts": 1,
    "ack_failures": True,
    "catch_up": False,
    # Successful tasks are kept, but pruned by the sweeper (HOLDPOINT_QUEUE_HISTORY), not by
    # django-q2: with a positive save_limit its monitor reads (and unpickles) every kept
    # result, under a row lock, for each task it records — 41% of a cluster's time in the
    # storm benchmark, one process that every task's result goes through.
    "save_limit": 0,
    "label": "Holdpoint queue",
    "poll": 0.2,
}
# django-q2 publishes each cluster's heartbeat (its Stat, refreshed every guard cycle with a
# 3 s expiry) to the "q" cache; /readyz reads it there. A per-process memory cache would hide
# the worker from the web process, so without Redis it is a file cache under var/.
if REDIS_URL:
    Q_CLUSTER["redis"] = REDIS_URL
    _q_cache = {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL}
else:
    Q_CLUSTER["orm"] = "default"
    _q_cache = {
        "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
        "LOCATION": str(VAR_DIR / "cache" / "q"),
    }
Q_CLUSTER["cache"] = "q"
# The API's and the decision pages' rate limits count in the default cache, so it is shared
# by every web process (Redis, or files under var/ on one host): with per-process memory,
# N web server processes would allow N times the limit.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "holdpoint",
    }
    if REDIS_URL
    else {
        "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
        "LOCATION": str(VAR_DIR / "cache" / "default"),
        "OPTIONS": {"MAX_ENTRIES": 10_000},  # one entry per active user and limit
    },
    "q": _q_cache,
}

# --- Holdpoint --------------------------------------------------------------------------
# A task tracker every tenant gets as built-in tools (tasks.create, tasks.close,
# agent.tasks.create: runtime/tooldata/tasks.json pointed here); empty: none. A tenant's own
# definitions (`manage.py tools import`, the admin, POST tools/) are independent of it.
HOLDPOINT_TASKS_URL = env_str("HOLDPOINT_TASKS_URL", "")
# How that tracker deduplicates: key (honours Idempotency-Key), lookup (can be searched by
# key), none. It decides how unknown outcomes of the built-in tasks.* are reconciled.
HOLDPOINT_TASKS_DEDUP = env_str("HOLDPOINT_TASKS_DEDUP", "key")
if HOLDPOINT_TASKS_DEDUP not in {"key", "lookup", "none"}:
    raise EnvError(
        f"HOLDPOINT_TASKS_DEDUP must be key, lookup or none, got {HOLDPOINT_TASKS_DEDUP!r}"
    )
# Reconciliation attempts of one unknown outcome before a human is asked.
HOLDPOINT_RECONCILE_ATTEMPTS = env_int("HOLDPOINT_RECONCILE_ATTEMPTS", 5, minimum=1)
HOLDPOINT_DEMO_PASSWORD = env_str("HOLDPOINT_DEMO_PASSWORD", "")
HOLDPOINT_LEASE_TTL = env_int("HOLDPOINT_LEASE_TTL", 20, minimum=2)
# The longest lease an external executor may take or heartbeat to (issue 16 H1: a long lease
# is how a lost agent would keep its run stuck for an hour).
HOLDPOINT_MAX_LEASE_TTL = env_int("HOLDPOINT_MAX_LEASE_TTL", 300, minimum=2)
# How long after an external executor's lease expired, unrenewed, the sweeper says the
# executor is lost (needs_attention, attention_reason "executor_lost").
HOLDPOINT_EXECUTOR_GRACE = env_int("HOLDPOINT_EXECUTOR_GRACE", 10, minimum=0)
# Heartbeat from a side thread during long steps (every TTL/3). Tests that run the executor
# inside pytest's open transaction switch it off: the side connection would wait on it.
HOLDPOINT_HEARTBEAT_THREAD = env_bool("HOLDPOINT_HEARTBEAT_THREAD", True)
# PostgreSQL: the worker's hot-path statements are bound on the server and prepared once per
# connection (fastsql.cursor). Turn off behind a pooler in transaction mode.
HOLDPOINT_PG_PREPARE = env_bool("HOLDPOINT_PG_PREPARE", True)
# PostgreSQL (with HOLDPOINT_PG_PREPARE): a step's commit is sent and the next step runs while
# it is on its way; nothing else leaves the worker until its answer is in (runtime.executor).
HOLDPOINT_OVERLAP_COMMITS = env_bool("HOLDPOINT_OVERLAP_COMMITS", True)
HOLDPOINT_SLICE_SECONDS = env_int("HOLDPOINT_SLICE_SECONDS", 60, minimum=1)
# Live event streams (runtime/live.py): a comment line after this many seconds of quiet, for
# proxies' idle timeouts and clients' read timeouts. API.md promises one at least every 15 s,
# so it may be shorter (tests), never longer.
HOLDPOINT_SSE_KEEPALIVE = env_int("HOLDPOINT_SSE_KEEPALIVE", 15, minimum=1)
if HOLDPOINT_SSE_KEEPALIVE > 15:
    raise EnvError(
        f"HOLDPOINT_SSE_KEEPALIVE must be <= 15 (API.md: a comment line at least every 15 s), "
        f"got {HOLDPOINT_SSE_KEEPALIVE}"
    )
# Live event streams one account (an agent's token, a reviewer) may hold open at once in one
# web process (runtime.live.Slots): each holds a file descriptor while it lives. Beyond it a
# new one is 429 `throttled`.
HOLDPOINT_STREAMS_PER_TOKEN = env_int("HOLDPOINT_STREAMS_PER_TOKEN", 10, minimum=1)
HOLDPOINT_SWEEP_BATCH = env_int("HOLDPOINT_SWEEP_BATCH", 200, minimum=1)
HOLDPOINT_SWEEP_PER_TENANT = env_int("HOLDPOINT_SWEEP_PER_TENANT", 50, minimum=1)
# The scheduled sweep task ticks every INTERVAL seconds for WINDOW seconds each minute.
# How long an Idempotency-Key's stored response is replayed (hours).
HOLDPOINT_IDEMPOTENCY_HOURS = env_int("HOLDPOINT_IDEMPOTENCY_HOURS", 24, minimum=1)
# How long a request holds its Idempotency-Key before a retry may take it over (seconds):
# longer than any creating POST takes (SQLite's 30 s busy timeout, more than once), short
# enough that a key whose request died is free again soon. A request still running past
# it loses its effect, not its uniqueness (runtime.api.idempotency).
HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS = env_int("HOLDPOINT_IDEMPOTENCY_CLAIM_SECONDS", 120, minimum=1)
# Runs per transaction of the retention purge: the artifact table is locked against step
# commits that store artifacts while one batch's orphans go, never for the whole purge.
HOLDPOINT_PURGE_BATCH = env_int("HOLDPOINT_PURGE_BATCH", 500, minimum=1)
HOLDPOINT_SWEEP_INTERVAL = env_int("HOLDPOINT_SWEEP_INTERVAL", 2, minimum=1)
# While the queue is backed up, a run the sweeper rang and nobody has taken since is not rung
# again for this long (a storm would otherwise fill the queue with doorbells for the same
# runs); with a short queue every tick rings every due run (runtime/sweeper.py).
HOLDPOINT_SWEEP_REDRIVE = env_int("HOLDPOINT_SWEEP_REDRIVE", 60, minimum=0)
HOLDPOINT_SWEEP_WINDOW = env_int("HOLDPOINT_SWEEP_WINDOW", 20, minimum=0)
# Each worker process also runs a sweeper loop (every INTERVAL, taking turns with the rest of
# the fleet), so a crashed worker's run resumes within TTL + INTERVAL of the crash even right
# after a cluster starts (django-q2's scheduler first fires 30 s after start).
HOLDPOINT_SWEEP_THREAD = env_bool("HOLDPOINT_SWEEP_THREAD", True)
# Successful queue tasks kept for the admin's "Successful tasks" (failures are all kept).
HOLDPOINT_QUEUE_HISTORY = env_int("HOLDPOINT_QUEUE_HISTORY", 250, minimum=0)
HOLDPOINT_GRAPH_MODULES = env_list("HOLDPOINT_GRAPH_MODULES", ["runtime.agents.api_review.graph"])
# Bearer tokens the sandbox tracker requires; seed_demo stores the first for tenant demo.
HOLDPOINT_SANDBOX_TOKENS = env_list("HOLDPOINT_SANDBOX_TOKENS", [])

# --- Notifications ----------------------------------------------------------------------
# Email through Django's backend: printed to the console in development, SMTP otherwise.
# Mail is sent by a queued task after commit, never inside the request's transaction; the
# timeout keeps a dead SMTP server from holding a worker until the task timeout.
EMAIL_BACKEND = env_str(
    "EMAIL_BACKEND",
    "django.core.mail.backends.console.EmailBackend"
    if DEBUG
    else "django.core.mail.backends.smtp.EmailBackend",
)
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_TIMEOUT = env_int("EMAIL_TIMEOUT", 10, minimum=1)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "holdpoint@localhost")
# Absolute links in emails and webhook payloads. A link only opens a page (mail scanners
# open links before people do); deciding is a POST from that page.
HOLDPOINT_BASE_URL = env_str("HOLDPOINT_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
if not HOLDPOINT_BASE_URL.startswith(("http://", "https://")):
    raise EnvError(
        f"HOLDPOINT_BASE_URL must start with http:// or https://, got {HOLDPOINT_BASE_URL!r}"
    )
# Webhook URLs are typed in by tenant admins: a URL resolving to a loopback, private or
# link-local address is refused at send time (no probing of internal services) unless it is
# inside one of the networks listed, or private addresses are allowed altogether.
HOLDPOINT_WEBHOOK_ALLOW_PRIVATE = env_bool("HOLDPOINT_WEBHOOK_ALLOW_PRIVATE", DEBUG)
HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS = env_list("HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS", [])

# --- Tools as data: outbound requests (runtime/outbound.py) -----------------------------
# Tenant admins define HTTP tools; the workers send them from inside this network. Only
# these hosts may be named (exactly, or *.example.com for subdomains; never `*`), and a
# host's addresses must be public unless inside one of the private networks listed.
# Development allows the sandbox tracker on this machine.
HOLDPOINT_TOOL_HOSTS = env_list("HOLDPOINT_TOOL_HOSTS", ["127.0.0.1", "localhost"] if DEBUG else [])
HOLDPOINT_TOOL_PRIVATE_NETWORKS = env_list(
    "HOLDPOINT_TOOL_PRIVATE_NETWORKS", ["127.0.0.0/8", "::1/128"] if DEBUG else []
)
# The largest answer read from a tool's service; past it the connection is dropped.
HOLDPOINT_TOOL_MAX_RESPONSE_BYTES = env_int(
    "HOLDPOINT_TOOL_MAX_RESPONSE_BYTES", 1024 * 1024, minimum=1
)
# MCP upstreams over stdio are commands Holdpoint starts on its own host with its own
# environment: registering one runs code on the operator's machine. Off unless an operator
# of a local, single-user setup turns it on (runtime/models/mcp.py).
HOLDPOINT_MCP_STDIO = env_bool("HOLDPOINT_MCP_STDIO", False)
# The MCP gateway (gateway/, README "MCP gateway"). How long one tools/call waits for a
# reviewer (with progress notifications when the client asked for them) before it answers
# "pending approval" with the request's link; the same call later gets the decision.
HOLDPOINT_MCP_WAIT_SECONDS = env_int("HOLDPOINT_MCP_WAIT_SECONDS", 30, minimum=0)
# A session no call has touched for this long is closed by the sweeper (most hosts never send
# the DELETE): its uncollected decisions stay in the ledger, its approved-but-unsent calls are
# withdrawn; a call still waiting for a reviewer, a reconciliation or a person keeps it. 0: never.
HOLDPOINT_MCP_SESSION_IDLE_HOURS = env_int("HOLDPOINT_MCP_SESSION_IDLE_HOURS", 24, minimum=0)
# A call's arguments (canonical JSON) larger than this are refused with an MCP error,
# nothing stored; a request body larger than HOLDPOINT_MCP_MAX_BODY_BYTES gets HTTP 413.
HOLDPOINT_MCP_MAX_ARGUMENT_BYTES = env_int("HOLDPOINT_MCP_MAX_ARGUMENT_BYTES", 64 * 1024, minimum=1)
HOLDPOINT_MCP_MAX_BODY_BYTES = env_int("HOLDPOINT_MCP_MAX_BODY_BYTES", 1024 * 1024, minimum=1024)
# Checked by the functions that apply them at send time, so both agree on what is valid.
from runtime.outbound import check_patterns, host_allowed, parse_networks  # noqa: E402

for _name, _check in (
    ("HOLDPOINT_TOOL_HOSTS", check_patterns),
    ("HOLDPOINT_TOOL_PRIVATE_NETWORKS", parse_networks),
    ("HOLDPOINT_WEBHOOK_PRIVATE_NETWORKS", parse_networks),
):
    try:
        _check(globals()[_name])
    except ValueError as exc:
        raise EnvError(f"{_name}: {exc}") from None
# The built-in tracker tools are sent like any other: their host must be allowed too (said
# at start-up, not as a refusal on every send).
if HOLDPOINT_TASKS_URL:
    from urllib.parse import urlsplit  # noqa: E402

    _tracker = urlsplit(HOLDPOINT_TASKS_URL)
    _tracker_host = _tracker.hostname or ""
    _tracker_port: int | None = None
    try:
        _tracker_port = _tracker.port or (443 if _tracker.scheme == "https" else 80)
    except ValueError:
        pass  # no port: refused below
    if not host_allowed(_tracker_host, HOLDPOINT_TOOL_HOSTS, _tracker_port):
        raise EnvError(
            f"HOLDPOINT_TASKS_URL: its host {_tracker_host!r} (port {_tracker_port}) is not"
            " in HOLDPOINT_TOOL_HOSTS"
        )

if TESTING:
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# --- Metrics and logs (README, "Metrics and logs") --------------------------------------
# /metrics answers only with this bearer token when it is set (stripped: a secrets file's
# trailing newline is not part of it).
HOLDPOINT_METRICS_TOKEN = env_token("HOLDPOINT_METRICS_TOKEN")
# prometheus-client's multiprocess mode: every process (web, each qcluster worker) writes its
# histograms to files here and a scrape sums them. prometheus-client reads the variable when
# it is first imported, so it is put in the environment here, before anything imports it.
PROMETHEUS_MULTIPROC_DIR = env_str("PROMETHEUS_MULTIPROC_DIR", str(VAR_DIR / "metrics"))
os.environ["PROMETHEUS_MULTIPROC_DIR"] = PROMETHEUS_MULTIPROC_DIR
Path(PROMETHEUS_MULTIPROC_DIR).mkdir(parents=True, exist_ok=True)
# Distinct `tool` values of holdpoint_action_duration_seconds per host (tenants define
# tools: each value is a series in every process and in Prometheus); the rest are `_other`.
HOLDPOINT_METRICS_TOOL_LABELS = env_int("HOLDPOINT_METRICS_TOOL_LABELS", 100, minimum=0)
# One line per record: JSON (production: a file, a pipe, a collector) or a readable line —
# the default when nothing says and the log goes to a terminal (a person typing manage.py).
HOLDPOINT_LOG_FORMAT = env_str(
    "HOLDPOINT_LOG_FORMAT", "console" if stderr_is_terminal() else "json"
)
if HOLDPOINT_LOG_FORMAT not in {"json", "console"}:
    raise EnvError(f"HOLDPOINT_LOG_FORMAT must be json or console, got {HOLDPOINT_LOG_FORMAT!r}")
LOG_LEVEL = env_str("LOG_LEVEL", "INFO")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "holdpoint": {"()": "runtime.logs.formatter", "format": HOLDPOINT_LOG_FORMAT},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "holdpoint"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # Django's own console handler (DEBUG only) would print every django.* line a second
        # time beside the root's: in `make run` each refused request showed two tracebacks.
        "django": {"handlers": []},
        "django.db.backends": {"level": "INFO"},
        # django-axes says its version at every process start (every manage.py command).
        "axes.apps": {"level": "WARNING"},
        # httpx (httpx2 as the mcp SDK carries it: the MCP client's transport) writes each
        # request's whole URL at INFO: a key an admin put in an MCP server's URL
        # (`?api_key=…`) would be in every log line.
        "httpx": {"level": "WARNING"},
        "httpx2": {"level": "WARNING"},
        # The mcp SDK's own lines: the endpoint's whole URL (DEBUG), each session's id, which
        # the server takes as the session's credential (INFO), every message a server sent —
        # tools' answers, tenant data — (DEBUG). Holdpoint logs what an MCP call did itself.
        "mcp": {"level": "WARNING"},
        # django-q2 gives its logger a handler of its own in its own format unless it has one
        # already: this one, so its lines come out like every other.
        "django-q": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
        # uvicorn (the web) gives its loggers handlers in its own format before it imports
        # the app; the app's start (django.setup) replaces them by this one, so its start-up,
        # access and error lines come out like every other.
        "uvicorn": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": False},
        "uvicorn.error": {"handlers": [], "level": LOG_LEVEL, "propagate": True},
        "uvicorn.access": {"handlers": [], "level": LOG_LEVEL, "propagate": True},
    },
}
