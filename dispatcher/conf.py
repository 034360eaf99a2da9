"""Typed, lazily read ``DISPATCHER_*`` settings: Django settings first, then the environment."""
from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings as django_settings
from django.core.signals import setting_changed

from dispatcher.durations import parse_duration

_MISSING = object()


def _as_int(value: Any) -> int:
    return int(value)


def _as_float(value: Any) -> float:
    return float(value)


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return [str(item) for item in value]


def _as_optional_int(value: Any) -> int | None:
    if value in (None, "", "none", "None"):
        return None
    return int(value)


class Setting:
    """One setting: its default, its parser and the line the README shows for it."""

    def __init__(self, default: Any, parse: Callable[[Any], Any], doc: str):
        self.default = default
        self.parse = parse
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        full = f"DISPATCHER_{self.name}"
        value = getattr(django_settings, full, _MISSING)
        if value is _MISSING:
            value = os.environ.get(full, _MISSING)
        if value is _MISSING:
            value = self.default
        parsed = self.parse(value)  # a value that does not parse raises at every read, never cached
        # Read once per process: the next reads find the value in the instance's own attributes
        # (this descriptor defines no __set__), until ``reload()`` (Django's setting_changed).
        instance.__dict__[self.name] = parsed
        return parsed


def _non_negative_duration(value: Any) -> timedelta:
    duration = parse_duration(value)
    if duration < timedelta(0):
        raise ValueError(f"duration cannot be negative: {value!r}")
    return duration


class DispatcherSettings:
    """Every setting the dispatcher reads, with its default."""

    MAX_ATTEMPTS = Setting(3, _as_int, "Attempts a call gets before it is marked failed.")
    MAX_PARAMS_BYTES = Setting(65536, _as_int, "Largest params accepted by send(), as JSON bytes.")
    MAX_DEFERRALS = Setting(None, _as_optional_int, "429 deferrals before a call fails (empty: never).")
    RETRY_BASE = Setting("2s", parse_duration, "First retry delay; doubles with each attempt.")
    RETRY_MAX = Setting("1h", parse_duration, "Longest retry delay.")
    RETRY_JITTER = Setting(0.25, _as_float, "Random share added to a retry delay (0.25 = up to +25%).")
    DEFAULT_RETRY_AFTER = Setting("5s", parse_duration, "Pause after a 429 that names no Retry-After.")
    DISPATCH_TIMEOUT = Setting("5m", parse_duration, "A call dispatched but not started for this long is rescued.")
    RUN_TIMEOUT = Setting("15m", parse_duration, "A call running for this long is rescued (its attempt counts).")
    RETENTION = Setting("7d", parse_duration, "Finished calls older than this are pruned.")
    DISPENSE_BATCH = Setting(500, _as_int, "Most calls one dispense pass moves.")
    DISPENSE_INTERVAL = Setting("5s", parse_duration, "How often beat runs a dispense pass.")
    RESCUE_INTERVAL = Setting("30s", parse_duration, "How often beat runs the rescue sweep.")
    PRUNE_CRONTAB = Setting("0 3 * * *", str, "When beat runs prune_calls (cron: minute hour dom month dow).")
    CALLS_PER_MESSAGE = Setting(
        1, _as_int,
        "Calls a dispenser puts in one Celery message; a worker starts them together and runs them at once (PostgreSQL).",
    )
    DISPATCH_AHEAD = Setting(
        "100ms", parse_duration,
        "How early a dispenser may claim a call for a slot about to free; its worker waits for the slot.",
    )
    HEARTBEAT_TIMEOUT = Setting(
        "1m", parse_duration,
        "A dispenser or worker silent for this long is reported as not running (heartbeats every quarter of it)."
    )
    ARRIVAL_GUARD = Setting(
        "20ms", _non_negative_duration,
        "Least spread between a call's recorded start and its arrival at the API that every policy absorbs "
        "(a window counts over period + guard; a bucket holds back burst, or slows its rate); a key's "
        "guard adds the start-to-send delay its workers measure.",
    )
    ARRIVAL_GUARD_MAX = Setting(
        "250ms", _non_negative_duration,
        "Largest guard a key's measured start-to-send delays may raise it to (set it to DISPATCHER_ARRIVAL_GUARD "
        "to use the configured guard alone).",
    )
    POLL_INTERVAL = Setting("1s", parse_duration, "Longest sleep of `dispense --loop` between passes.")
    QUEUE = Setting("", str, "Celery queue for calls that name none (empty: Celery's default queue).")
    HTTP_ALLOWED_HOSTS = Setting(
        "", _as_list, "Hosts the built-in http handler may call (Django ALLOWED_HOSTS syntax, plus `:port` or `:*`).",
    )
    HTTP_SECRETS = Setting(
        "", _as_list,
        "Settings/env names http headers may reference as {'secret': NAME}; NAME[:Header]@host[:port] binds one to hosts.",
    )
    HTTP_TIMEOUT = Setting(30.0, _as_float, "Default timeout of the http handler, in seconds.")
    HTTP_MAX_CONNECTIONS = Setting(
        100, _as_int,
        "Connections the http handler's client of a worker process opens and keeps alive at most (read when it is created).",
    )
    HTTP_MAX_BODY = Setting(4096, _as_int, "Characters of a response body the http handler stores (and about all it reads).")
    HTTP_ALLOW_INTERNAL_NAMES = Setting(
        False, _as_bool,
        "Let allow-listed host names resolve to loopback, private or link-local addresses (IPs listed literally always may).",
    )
    MAX_PAUSE = Setting("1h", parse_duration, "Longest a downstream's 429, Retry-After or rate-limit header may pause a key.")
    LEARNT_LIMIT_TTL = Setting("1h", parse_duration, "How long a limit learnt from an API's headers lasts unless repeated.")
    RATE_LIMITS = Setting((), list, "Policies seeded at migrate: [{'key', 'limit', 'period', 'burst'?, 'concurrency'?}].")
    PRUNE_BATCH = Setting(1000, _as_int, "Rows prune_calls deletes per transaction.")
    RESCUE_BATCH = Setting(200, _as_int, "Calls the rescue sweep returns per transaction.")
    API_TOKENS = Setting("", _as_list, "Bearer tokens accepted by the HTTP enqueue/status API (comma-separated).")
    METRICS_TOKENS = Setting("", _as_list, "Bearer tokens accepted by /metrics (comma-separated).")
    METRICS_PUBLIC = Setting(False, _as_bool, "Serve /metrics to anyone (otherwise: a token or staff with view permission).")

    def reload(self) -> None:
        """Forget every value read, so the next reads see the settings and the environment of now."""
        self.__dict__.clear()

    def as_rows(self) -> list[tuple[str, str, str]]:
        """Return (name, default, description) for every setting, for docs."""
        rows = []
        for name, value in vars(type(self)).items():
            if isinstance(value, Setting):
                rows.append((f"DISPATCHER_{name}", repr(value.default), value.doc))
        return rows


dispatcher_settings = DispatcherSettings()


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith("DISPATCHER_"):
        dispatcher_settings.reload()


setting_changed.connect(_on_setting_changed, dispatch_uid="dispatcher.conf.reload")
