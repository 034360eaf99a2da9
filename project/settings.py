"""Settings for the dispatcher project, read from the environment.

With no environment set, the project runs on the embedded default: a SQLite file and
kombu's filesystem broker under ``var/``, so a newcomer needs no server. Production sets
``DATABASE_URL`` (PostgreSQL) and ``CELERY_BROKER_URL`` (Redis or RabbitMQ).
"""
import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DISPATCHER_VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_list(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in os.environ.get(name, default).split(",") if item.strip()]


DEBUG = env_bool("DJANGO_DEBUG", False)
# The insecure fallback key only serves the embedded default (SQLite, no DATABASE_URL or a
# sqlite:// one): `make demo`, `make run` and a first look need no setup. A configuration on a
# database server is production, and refuses to start without a key of its own.
DEVELOPMENT_SECRET_KEY = "insecure-dev-key-change-me"
PLACEHOLDER_SECRET_KEYS = {DEVELOPMENT_SECRET_KEY, "change-me-in-production", "change-me", "changeme", "secret"}
# A key `django-admin startproject` generated says by its prefix that it was never meant to serve
# (Django's own deploy check, W009, names it too); one of fewer than 5 distinct characters guards
# nothing.
INSECURE_PREFIX = "django-insecure-"
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "").strip()
if (
    not SECRET_KEY or SECRET_KEY in PLACEHOLDER_SECRET_KEYS or SECRET_KEY.startswith(INSECURE_PREFIX)
    or len(set(SECRET_KEY)) < 5
):
    if not os.environ.get("DATABASE_URL", "sqlite:").startswith("sqlite:"):
        raise ImproperlyConfigured(
            "DJANGO_SECRET_KEY is not set (or is a placeholder: a known default, a django-insecure- key, "
            "fewer than 5 distinct characters) while DATABASE_URL names a database "
            "server: production needs a key of its own. Generate one with "
            "`python -c 'from django.core.management.utils import get_random_secret_key as k; print(k())'` "
            "and set it in the environment."
        )
    SECRET_KEY = DEVELOPMENT_SECRET_KEY
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost")
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS")

# Behind HTTPS in production set DJANGO_SECURE_HTTPS=true: secure cookies, HSTS and the redirect
# that `manage.py check --deploy` asks for. Off by default so the embedded default runs on plain HTTP.
if env_bool("DJANGO_SECURE_HTTPS", False):
    SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_SECURE_HSTS_SECONDS", "31536000"))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_beat",
    "dispatcher",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files (the admin's CSS and JS, the dashboard's) with DEBUG off: WhiteNoise serves
    # what `collectstatic` gathered into STATIC_ROOT, from any WSGI server.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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

WSGI_APPLICATION = "project.wsgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "60")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # IMMEDIATE takes SQLite's write lock when a transaction begins, so the limiter's
    # check-and-claim is atomic across processes; WAL lets readers run alongside.
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(os.environ.get("DJANGO_STATIC_ROOT", VAR_DIR / "static"))
# Hashed, compressed copies made by `collectstatic`, cached forever by browsers. Tests that
# render templates without running collectstatic use the plain storage (tests/settings.py).
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# One handler, on the root logger: every line (the dispatcher's, Django's, Celery's) is written
# once. A handler on "dispatcher" as well printed its lines twice in a worker, where Celery gives
# a root logger without handlers one of its own (CELERY_WORKER_HIJACK_ROOT_LOGGER=False keeps ours).
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "filters": {
        # Beat sends dispense every 5 s (rescue every 30 s): at INFO, three lines each time.
        "routine_tasks": {"()": "dispatcher.logfilters.QuietTasks", "tasks": ["dispatcher.dispense", "dispatcher.rescue"]},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {
        "dispatcher": {"level": os.environ.get("DISPATCHER_LOG_LEVEL", "INFO")},
        # Django's own default prints to the console only with DEBUG on (and mails ADMINS, which is
        # empty): a 500 in production would leave no trace. Here its errors (a 500's traceback
        # from django.request) reach the console, DEBUG on or off.
        "django": {"level": os.environ.get("DJANGO_LOG_LEVEL", "INFO")},
        # The http handler's client logs every request at INFO; the call's row and attempt say it.
        "httpx": {"level": "WARNING"},
        "httpcore": {"level": "WARNING"},
        "celery.beat": {"filters": ["routine_tasks"]},
        "celery.worker.strategy": {"filters": ["routine_tasks"]},
        "celery.app.trace": {"filters": ["routine_tasks"]},
    },
}

# --- Celery -----------------------------------------------------------------------------
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    # The embedded broker: messages are files in one folder that every process shares.
    _broker_dir = Path(os.environ.get("EMBEDDED_BROKER_DIR", VAR_DIR / "broker"))
    _broker_dir.mkdir(parents=True, exist_ok=True)
    # kombu's filesystem transport with atomic writes (see project/broker.py).
    CELERY_BROKER_TRANSPORT = "project.broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir),
        "data_folder_out": str(_broker_dir),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
        "polling_interval": 0.05,
    }
CELERY_TASK_DEFAULT_QUEUE = os.environ.get("CELERY_TASK_DEFAULT_QUEUE", "celery")
# Celery's Django fixup closes the database connection before and after every task unless this
# is set: a new PostgreSQL connection per call would cost more than the call's own queries. The
# connection is kept for this many tasks; dispatcher.run_call drops one that failed or aged past
# CONN_MAX_AGE before each task (Django's close_old_connections).
CELERY_DB_REUSE_MAX = int(os.environ.get("CELERY_DB_REUSE_MAX", "1000"))
CELERY_TASK_IGNORE_RESULT = True
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# The database, not the broker, is the record of every call: a message lost with a
# crashed worker is recovered by the rescue sweep, so early acknowledgement is safe.
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = int(os.environ.get("CELERY_WORKER_PREFETCH_MULTIPLIER", "4"))
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
CELERY_TIMEZONE = "UTC"

# --- dispatcher ---------------------------------------------------------------------------
# Every DISPATCHER_* setting may also come from an environment variable of the same name;
# dispatcher.conf reads both at access time. Set here only what the project overrides.
