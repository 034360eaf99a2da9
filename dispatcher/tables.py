"""The app's models for the modules the models themselves import, looked up in Django's app registry.

``models.py`` imports its managers (``managers.py``), and they the limiter; those modules, and
the few that ``import dispatcher`` loads before the app registry is ready (``learning.py``) or
that Django may load then (``backends.py``), reach the models through this module rather than
importing ``models.py`` back: ``tables.KeyState`` is the model class itself, so the import graph
of the app has no cycle and no module hides an import inside a function to dodge one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.apps import apps

if TYPE_CHECKING:
    from dispatcher.models import (
        Attempt,
        CallQueue,
        FairShare,
        Heartbeat,
        KeyBucket,
        KeyState,
        LearntLimit,
        RateLimit,
        StartLog,
    )

__all__ = ["Attempt", "CallQueue", "FairShare", "Heartbeat", "KeyBucket", "KeyState", "LearntLimit", "RateLimit", "StartLog"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return apps.get_model("dispatcher", name)
