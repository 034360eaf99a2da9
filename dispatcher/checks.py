"""System checks for dispatcher settings."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Warning, register

from dispatcher.conf import Setting, dispatcher_settings
from dispatcher.handlers import host_rules, secret_grants


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Report DISPATCHER_* settings that cannot be parsed."""
    errors = []
    for name, value in vars(type(dispatcher_settings)).items():
        if isinstance(value, Setting):
            try:
                getattr(dispatcher_settings, name)
            except (TypeError, ValueError) as exc:
                errors.append(Error(f"DISPATCHER_{name} is invalid: {exc}", id="dispatcher.E001"))
    try:
        if dispatcher_settings.CALLS_PER_MESSAGE < 1:
            errors.append(Error("DISPATCHER_CALLS_PER_MESSAGE must be at least 1", id="dispatcher.E002"))
    except (TypeError, ValueError):
        pass  # reported above
    errors += _http_errors()
    return errors


@register()
def check_wildcard_hosts(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """Warn about an allow-list entry that opens every host."""
    try:
        rules = host_rules(dispatcher_settings.HTTP_ALLOWED_HOSTS)
    except (TypeError, ValueError):
        return []  # reported by check_settings
    return [
        Warning(
            f"DISPATCHER_HTTP_ALLOWED_HOSTS has {rule.pattern}{':*' if rule.any_port else ''!s}: the http handler may call "
            "any public host (loopback, private, link-local and metadata addresses stay closed unless listed literally).",
            hint="List the APIs' hosts (api.example.com, .example.com) instead.",
            id="dispatcher.W002",
        )
        for rule in rules if rule.pattern == "*"
    ]


def _http_errors() -> list[Error]:
    """Report allow-list and secret entries the http handler cannot read."""
    errors = []
    for name, read in (("HTTP_ALLOWED_HOSTS", lambda: host_rules(dispatcher_settings.HTTP_ALLOWED_HOSTS)),
                       ("HTTP_SECRETS", secret_grants)):
        try:
            read()
        except (TypeError, ValueError) as exc:
            errors.append(Error(f"DISPATCHER_{name} is invalid: {exc}", id="dispatcher.E003"))
    return errors


@register()
def check_worker_connections(app_configs: Any = None, **kwargs: Any) -> list[Warning]:
    """Warn when Celery would open a new database connection for every call a worker runs."""
    if getattr(settings, "CELERY_DB_REUSE_MAX", None):
        return []
    return [
        Warning(
            "CELERY_DB_REUSE_MAX is not set: Celery's Django fixup closes the database connection "
            "before and after every task, so each call a worker runs opens a new connection.",
            hint="Set CELERY_DB_REUSE_MAX = 1000 (or your Celery namespace's equivalent).",
            id="dispatcher.W001",
        )
    ]
