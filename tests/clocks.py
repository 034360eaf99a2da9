"""A fake database clock for the whole app, for tests that step time themselves."""
from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime

import pytest

import dispatcher.clock


def fake_db_clock(monkeypatch: pytest.MonkeyPatch, clock: Callable[..., datetime]) -> None:
    """Make ``db_now`` answer ``clock()`` in every module of the app that reads it."""
    real = dispatcher.clock.db_now
    for name, module in list(sys.modules.items()):
        if (name == "dispatcher" or name.startswith("dispatcher.")) and getattr(module, "db_now", None) is real:
            monkeypatch.setattr(module, "db_now", clock)
