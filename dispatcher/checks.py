"""System checks for dispatcher settings."""
from __future__ import annotations

from typing import Any

from django.core.checks import Error, register


@register()
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    """Report DISPATCHER_* settings that cannot be parsed."""
    from dispatcher.conf import Setting, dispatcher_settings

    errors = []
    for name, value in vars(type(dispatcher_settings)).items():
        if isinstance(value, Setting):
            try:
                getattr(dispatcher_settings, name)
            except (TypeError, ValueError) as exc:
                errors.append(Error(f"DISPATCHER_{name} is invalid: {exc}", id="dispatcher.E001"))
    return errors
