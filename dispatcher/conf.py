"""Typed, lazily read ``DISPATCHER_*`` settings: Django settings first, then the environment."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar, overload

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


T = TypeVar("T")


class Setting(Generic[T]):
    """One setting: its default, its parser and the line the README shows for it."""

    def __init__(self, default: Any, parse: Callable[[Any], T], doc: str):
        self.default = default
        self.parse = parse
        self.doc = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Setting[T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> Setting[T] | T:
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
    DEFAULT_RETRY_AFTER = Setting("5s", parse_duration, "Pause after a 429 that names no Retry-After.")
    DISPATCH_TIMEOUT = Setting("5m", parse_duration, "A call dispatched but not started for this long is rescued.")
    RUN_TIMEOUT = Setting("15m", parse_duration, "A call running for this long is rescued (its attempt counts).")
    RETENTION = Setting("7d", parse_duration, "Finished calls older than this are pruned.")
    CALLS_PER_MESSAGE = Setting(
        16, _as_int,
        "Most calls a dispenser puts in one Celery message: one while the backlog fits the workers' slots, more as "
        "it deepens; a worker starts a message's calls together and runs them at once (1: always one per message).",
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
    HTTP_ALLOW_INTERNAL_NAMES = Setting(
        False, _as_bool,
        "Let allow-listed host names resolve to loopback, private or link-local addresses (IPs listed literally always may).",
    )
    MAX_PAUSE = Setting("1h", parse_duration, "Longest a downstream's 429, Retry-After or rate-limit header may pause a key.")
    LEARNT_LIMIT_TTL = Setting("1h", parse_duration, "How long a limit learnt from an API's headers lasts unless repeated.")
    RATE_LIMITS = Setting((), list, "Policies seeded at migrate: [{'key', 'limit', 'period', 'burst'?, 'concurrency'?}].")
    API_TOKENS = Setting("", _as_list, "Bearer tokens accepted by the HTTP enqueue/status API (comma-separated).")
    METRICS_TOKENS = Setting("", _as_list, "Bearer tokens accepted by /metrics (comma-separated).")
    METRICS_PUBLIC = Setting(False, _as_bool, "Serve /metrics to anyone (otherwise: a token or staff with view permission).")

    def reload(self) -> None:
        """Forget every value read, so the next reads see the settings and the environment of now."""
        self.__dict__.clear()

    def tuned(self, name: str, constant: Any) -> Any:
        """Return an internal constant, or the value of its deprecated ``DISPATCHER_<name>`` setting.

        These were settings before 0.9; each is now a named constant beside the code it tunes. A
        site that still sets one keeps its value for one release, with a DeprecationWarning.
        """
        key = f"tuned:{name}"
        if key in self.__dict__:
            return self.__dict__[key]
        full = f"DISPATCHER_{name}"
        value = getattr(django_settings, full, _MISSING)
        if value is _MISSING:
            value = os.environ.get(full, _MISSING)
        if value is _MISSING:
            found = constant
        else:
            warnings.warn(
                f"{full} is deprecated and will be ignored in the next release: {DEPRECATED[name]}",
                DeprecationWarning, stacklevel=2,
            )
            found = _DEPRECATED_PARSERS[name](value)
        self.__dict__[key] = found
        return found


# Settings that became named constants (``DispatcherSettings.tuned``), and where each lives now.
DEPRECATED = {
    "DISPENSE_BATCH": "dispatcher.dispenser.DISPENSE_BATCH",
    "DISPATCH_AHEAD": "dispatcher.dispenser.DISPATCH_AHEAD",
    "RESCUE_BATCH": "dispatcher.calls.sweep.RESCUE_BATCH",
    "PRUNE_BATCH": "dispatcher.calls.sweep.PRUNE_BATCH (prune_calls --batch-size)",
    "RETRY_JITTER": "dispatcher.retry.JITTER",
    "ARRIVAL_GUARD_MAX": "dispatcher.limits.guard.GUARD_MAX",
    "HTTP_MAX_CONNECTIONS": "dispatcher.httpclient.MAX_CONNECTIONS",
    "HTTP_MAX_BODY": "dispatcher.handlers.MAX_BODY",
    "DISPENSE_INTERVAL": "beat's own schedule row dispatcher.dispense (seeded once, then edited in the admin)",
    "RESCUE_INTERVAL": "beat's own schedule row dispatcher.rescue (seeded once, then edited in the admin)",
    "PRUNE_CRONTAB": "beat's own schedule row dispatcher.prune (seeded once, then edited in the admin)",
}
_DEPRECATED_PARSERS: dict[str, Callable[[Any], Any]] = {
    "DISPENSE_BATCH": _as_int, "DISPATCH_AHEAD": parse_duration, "RESCUE_BATCH": _as_int, "PRUNE_BATCH": _as_int,
    "RETRY_JITTER": _as_float, "ARRIVAL_GUARD_MAX": _non_negative_duration, "HTTP_MAX_CONNECTIONS": _as_int,
    "HTTP_MAX_BODY": _as_int, "DISPENSE_INTERVAL": parse_duration, "RESCUE_INTERVAL": parse_duration, "PRUNE_CRONTAB": str,
}

dispatcher_settings = DispatcherSettings()


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting.startswith("DISPATCHER_"):
        dispatcher_settings.reload()


setting_changed.connect(_on_setting_changed, dispatch_uid="dispatcher.conf.reload")
