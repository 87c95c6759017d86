"""Settings for the Omni control plane.

Two modes, one code path. With no environment at all this is the *embedded* mode: SQLite under
``var/``, an in-memory channel layer and an in-process planner loop. Setting ``DATABASE_URL``
(PostgreSQL) and ``REDIS_URL`` switches to *production* mode: PostgreSQL, Celery with Redis as
broker, and the ``channels_redis`` layer shared by several ASGI processes. Every variable is
read through the strict helpers in ``omniweb.env``; a bad value stops start-up naming it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from omniweb.env import (
    EnvError,
    check_redis_url,
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_json_object,
    env_list,
    env_port_range,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("OMNI_VAR_DIR", str(BASE_DIR / "var")))

try:
    DEBUG = env_bool("DEBUG", default=False)
    _secret = env_str("SECRET_KEY")
    if _secret is None and not DEBUG and env_str("DATABASE_URL") is not None:
        raise EnvError("SECRET_KEY: must be set when DEBUG is off in production mode")
    # The embedded mode needs no environment: it gets a fixed, obviously-insecure key that
    # the deploy checks (manage.py check --deploy) flag.
    SECRET_KEY = _secret or "django-insecure-omni-embedded-mode-only"
    ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
    CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

    _database_url = env_str("DATABASE_URL")
    if _database_url:
        DATABASES = {"default": database_from_url("DATABASE_URL", _database_url)}
    else:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        DATABASES = {
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(VAR_DIR / "omni.sqlite3"),
                "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
            }
        }

    REDIS_URL = env_str("REDIS_URL")
    if REDIS_URL:
        check_redis_url("REDIS_URL", REDIS_URL)

    # Planner and control-loop knobs (defaults per shared/scenarios/FORMAT.md).
    OMNI_PLANNER_INTERVAL_S = env_float("OMNI_PLANNER_INTERVAL_S", 5.0, minimum=0.1)
    OMNI_HEARTBEAT_INTERVAL_S = env_float("OMNI_HEARTBEAT_INTERVAL_S", 5.0, minimum=0.1)
    OMNI_HEARTBEAT_MISSES = env_int("OMNI_HEARTBEAT_MISSES", 3, minimum=1)
    # This share of nodes (at least 2) silent at once is taken for a control-plane outage: they
    # stay suspect, not failed, for up to OMNI_HEARTBEAT_OUTAGE_PATIENCE x the failure delay
    # (docs/control-loop.md). 1 turns it off.
    OMNI_HEARTBEAT_MASS_SILENCE = env_float("OMNI_HEARTBEAT_MASS_SILENCE", 0.55, minimum=0.0)
    OMNI_HEARTBEAT_OUTAGE_PATIENCE = env_float("OMNI_HEARTBEAT_OUTAGE_PATIENCE", 10.0, minimum=1.0)
    OMNI_COMMAND_ACK_TIMEOUT_S = env_float("OMNI_COMMAND_ACK_TIMEOUT_S", 15.0, minimum=0.1)
    # Ports for jobs' torchrun rendezvous on their leader node (docs/workloads.md).
    OMNI_RDZV_PORTS = env_port_range("OMNI_RDZV_PORTS", "29400-29999")
    OMNI_COMMAND_MAX_ATTEMPTS = env_int("OMNI_COMMAND_MAX_ATTEMPTS", 3, minimum=1)
    # A start, resume or resize acknowledged but not reported done within this long (and past its
    # deadline, if it has one) expires and its job recovers (docs/control-loop.md). A resize's done
    # waits for a checkpoint save: keep it above the slowest save.
    OMNI_COMMAND_DONE_TIMEOUT_S = env_float("OMNI_COMMAND_DONE_TIMEOUT_S", 300.0, minimum=1.0)
    # Planner knob overrides as JSON, e.g. {"startup_s": 2, "reclaim_margin_s": 2} (tests, demo).
    OMNI_PLANNER_OVERRIDES = env_json_object("OMNI_PLANNER_OVERRIDES")
    # Fault injection for the control-loop tests: hold each planner pass's transaction open
    # this long after applying, so a test can kill the worker mid-pass. Always 0 in production.
    OMNI_PLANNER_PASS_HOLD_S = env_float("OMNI_PLANNER_PASS_HOLD_S", 0.0, minimum=0.0)
    # Run the periodic tasks in-process (embedded mode) instead of Celery beat.
    OMNI_INPROCESS_LOOP = env_bool("OMNI_INPROCESS_LOOP", default=REDIS_URL is None)
    # What a researcher sees of other people's jobs (jobs.roles.job_visibility, docs/live-ui.md):
    # "summary" (in lists: name, owner, class, state, GPUs; details only of their own, like
    # Slurm's PrivateData=jobs), "all" (everything), "own" (nothing of others' jobs).
    OMNI_JOB_VISIBILITY = env_str("OMNI_JOB_VISIBILITY", "summary")
    if OMNI_JOB_VISIBILITY not in ("summary", "all", "own"):
        raise EnvError(f"OMNI_JOB_VISIBILITY: expected summary/all/own, got {OMNI_JOB_VISIBILITY!r}")
    # --- checkpoint storage hygiene (docs/storage.md) ----------------------------------------
    # A node whose agent reports less free space than this in its runs dir takes no new work
    # (what runs there stays); 0 turns the check off.
    OMNI_MIN_FREE_DISK_BYTES = env_int("OMNI_MIN_FREE_DISK_BYTES", 2 * 1024**3, minimum=0)
    # --- teams (docs/teams.md) ------------------------------------------------------------------
    # Teams' past GPU usage decays with this half-life for fair share among borrowers (a week);
    # OMNI_PLANNER_OVERRIDES' fair_share_half_life_s still wins.
    OMNI_FAIR_SHARE_HALF_LIFE_S = env_float("OMNI_FAIR_SHARE_HALF_LIFE_S", 604800.0, minimum=0.0)
    # The run dirs of cancelled and failed jobs are removed this long after they finished.
    OMNI_RUN_DIR_RETENTION_S = env_float("OMNI_RUN_DIR_RETENTION_S", 7 * 86400.0, minimum=0.0)
    # How long the ranks' log lines are kept in the database (docs/logs.md); default 14 days.
    OMNI_LOG_RETENTION_S = env_int("OMNI_LOG_RETENTION_S", 14 * 86400, minimum=60)
    # --- telemetry (docs/telemetry.md) -------------------------------------------------------
    OMNI_TELEMETRY_RAW_RETENTION_H = env_int("OMNI_TELEMETRY_RAW_RETENTION_H", 48, minimum=1)
    OMNI_TELEMETRY_MINUTE_RETENTION_D = env_int("OMNI_TELEMETRY_MINUTE_RETENTION_D", 30, minimum=1)
    # 0 keeps hourly rollups forever.
    OMNI_TELEMETRY_HOUR_RETENTION_D = env_int("OMNI_TELEMETRY_HOUR_RETENTION_D", 0, minimum=0)
    OMNI_TELEMETRY_PARTITIONS_AHEAD_D = env_int("OMNI_TELEMETRY_PARTITIONS_AHEAD_D", 3, minimum=1)
    OMNI_TELEMETRY_MAX_BATCH = env_int("OMNI_TELEMETRY_MAX_BATCH", 10000, minimum=1)
    OMNI_TELEMETRY_MAX_FUTURE_S = env_float("OMNI_TELEMETRY_MAX_FUTURE_S", 300.0, minimum=0.0)
    # Telemetry commits skip the WAL flush wait: a database crash may lose the last ~0.6 s of
    # samples, never consistency. Set to 0 to wait for every flush.
    OMNI_TELEMETRY_ASYNC_COMMIT = env_bool("OMNI_TELEMETRY_ASYNC_COMMIT", default=True)
    OMNI_TELEMETRY_LIVE_INTERVAL_S = env_float("OMNI_TELEMETRY_LIVE_INTERVAL_S", 1.0, minimum=0.0)
    # The Cluster page's summary goes out at most once per this many seconds among all the
    # processes on one Redis (per process in embedded mode), the last state always
    # (docs/live-ui.md, "Throttling").
    OMNI_LIVE_SUMMARY_INTERVAL_S = env_float("OMNI_LIVE_SUMMARY_INTERVAL_S", 0.5, minimum=0.0)
    OMNI_TELEMETRY_ROLLUP_INTERVAL_S = env_float("OMNI_TELEMETRY_ROLLUP_INTERVAL_S", 30.0, minimum=1.0)
    OMNI_TELEMETRY_ROLLUP_GRACE_S = env_float("OMNI_TELEMETRY_ROLLUP_GRACE_S", 120.0, minimum=0.0)
    # /metrics answers operators' sessions, or this bearer token (for Prometheus).
    OMNI_METRICS_TOKEN = env_str("OMNI_METRICS_TOKEN")
    # --- end telemetry -------------------------------------------------------------------------
    # --- TLS behind a reverse proxy (docs/operators.md, "Deploying behind a TLS proxy") ------
    # The header the TLS-terminating proxy sets to "https", e.g. X-Forwarded-Proto. Setting it
    # turns on the HTTPS redirect and HSTS, which is what `manage.py check --deploy` asks for;
    # unset (embedded mode, tests, plain-HTTP setups) nothing changes.
    OMNI_TLS_PROXY_HEADER = env_str("OMNI_TLS_PROXY_HEADER")
    if OMNI_TLS_PROXY_HEADER is not None and not re.fullmatch(r"[A-Za-z0-9-]{1,64}", OMNI_TLS_PROXY_HEADER):
        raise EnvError(f"OMNI_TLS_PROXY_HEADER: expected a header name such as X-Forwarded-Proto, "
                       f"got {OMNI_TLS_PROXY_HEADER!r}")
    OMNI_HSTS_SECONDS = env_int("OMNI_HSTS_SECONDS", 365 * 86400, minimum=0)
    OMNI_HSTS_PRELOAD = env_bool("OMNI_HSTS_PRELOAD", default=True)
    # --- audit anchoring (docs/audit-log.md, "Why it can be trusted") ---------------------------
    # The key of every audit row's MAC, kept outside the database (OMNI_AUDIT_KEY_FILE names a file
    # holding it). Unset: rows get no MAC and only the published heads anchor the chain.
    _audit_key = env_str("OMNI_AUDIT_KEY")
    if _audit_key is not None and len(_audit_key) < 32:
        raise EnvError(f"OMNI_AUDIT_KEY: must be at least 32 characters, got {len(_audit_key)}")
    OMNI_AUDIT_KEY = _audit_key
    # The append-only file the chain's head is published to, and how often (skipped when unmoved).
    OMNI_AUDIT_HEADS = Path(env_str("OMNI_AUDIT_HEADS", str(VAR_DIR / "audit-heads.jsonl")))
    OMNI_AUDIT_HEAD_EVERY_S = env_float("OMNI_AUDIT_HEAD_EVERY_S", 300.0, minimum=1.0)
    # The PostgreSQL role the application runs as: after every migrate it is granted only SELECT and
    # INSERT on the audit table (manage.py grant_app_role). Unset: nothing is granted.
    OMNI_APP_DB_ROLE = env_str("OMNI_APP_DB_ROLE")
    if OMNI_APP_DB_ROLE is not None and not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", OMNI_APP_DB_ROLE):
        raise EnvError(f"OMNI_APP_DB_ROLE: expected a lower-case role name, got {OMNI_APP_DB_ROLE!r}")
    LOG_LEVEL = env_str("LOG_LEVEL", "INFO")
    if LOG_LEVEL not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise EnvError(f"LOG_LEVEL: expected DEBUG/INFO/WARNING/ERROR/CRITICAL, got {LOG_LEVEL!r}")
except EnvError as exc:
    sys.stderr.write(f"omni: bad environment: {exc}\n")
    raise SystemExit(2) from None

EMBEDDED = _database_url is None

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "jobs",
    "telemetry",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "omniweb.urls"
WSGI_APPLICATION = None
ASGI_APPLICATION = "omniweb.asgi.application"

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
            ],
        },
    },
]

# The "throttle" cache counts failed sign-ins and tokens (jobs/api/throttles.py) and remembers a
# control-plane outage for the heartbeat monitor (jobs/actions/nodes.py): in Redis in production,
# so every server and worker process counts together; in memory in embedded mode (one process).
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "throttle": (
        {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL, "KEY_PREFIX": "omni"}
        if REDIS_URL else
        {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "throttle"}
    ),
}

if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # A process's inbox takes one message per group send for all its sockets, and
            # channels_redis drops what comes beyond ``capacity`` (logged at INFO only): 100 by
            # default, a second of a busy cluster stream's batches under load (docs/load.md).
            "CONFIG": {"hosts": [REDIS_URL], "capacity": 1000},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

# Celery: Redis as broker in production; in embedded mode tasks run eagerly in-process, and the
# periodic ones are driven by omniweb.loop (the same task functions Celery would call).
# An eager call still takes a producer from the pool, so the in-memory broker names its host:
# "memory://" alone has kombu warn "No hostname was supplied" in the demo's log.
CELERY_BROKER_URL = REDIS_URL or "memory://localhost/"
CELERY_TASK_ALWAYS_EAGER = REDIS_URL is None
CELERY_TASK_EAGER_PROPAGATES = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
# Queues by task (omniweb.scheduled.Queue): the planner never waits behind control traffic.
CELERY_TASK_ROUTES = {
    "jobs.plan_tick": {"queue": "planner"},
    "jobs.monitor_heartbeats": {"queue": "control"},
    "jobs.sweep_commands": {"queue": "control"},
    "telemetry.roll_up": {"queue": "telemetry"},
    "telemetry.maintain_partitions": {"queue": "telemetry"},
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_SECURE = not DEBUG and not EMBEDDED
CSRF_COOKIE_SECURE = not DEBUG and not EMBEDDED
X_FRAME_OPTIONS = "DENY"

if OMNI_TLS_PROXY_HEADER:
    # Trust the proxy's word that the browser spoke HTTPS (the proxy must overwrite the header
    # on every request: a client must never be able to set it), redirect plain HTTP, and
    # tell browsers to come back only over HTTPS. /metrics is exempt: Prometheus scrapes each
    # process directly (docs/telemetry.md).
    SECURE_PROXY_SSL_HEADER = ("HTTP_" + OMNI_TLS_PROXY_HEADER.upper().replace("-", "_"), "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^metrics$"]
    SECURE_HSTS_SECONDS = OMNI_HSTS_SECONDS
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = OMNI_HSTS_PRELOAD

REST_FRAMEWORK = {
    # API tokens first (manage.py issue_api_token; no CSRF, like DRF's TokenAuthentication), so a
    # request without credentials is a 401 naming the Token scheme; the pages' session keeps CSRF.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "jobs.api.auth.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
        # No Basic: each Basic header costs a password hash, a CPU lever and a password oracle.
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON through the agent protocol's strict loader: deep nesting, 1e999, a lone surrogate: 400.
    "DEFAULT_PARSER_CLASSES": [
        "omniweb.parsers.StrictJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "jobs.api.pagination.ApiPagination",
    "PAGE_SIZE": 50,
    # Failed sign-ins and tokens per client address (jobs/api/throttles.py); only failures count.
    "DEFAULT_THROTTLE_RATES": {"login": "10/min", "api_token": "20/min", "agent_token": "20/min"},
    # The client address of a throttle: REMOTE_ADDR, or behind the TLS proxy (OMNI_TLS_PROXY_HEADER)
    # the address that proxy appended to X-Forwarded-For; a client's own X-Forwarded-For is ignored.
    "NUM_PROXIES": 1 if OMNI_TLS_PROXY_HEADER else 0,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "jobs.api.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Omni control plane API",
    "DESCRIPTION": "Jobs, nodes, reservations and the elastic-adjustment audit log.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
    },
}
