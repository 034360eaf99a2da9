"""A fake database clock for the whole app, for tests that step time themselves."""
from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest

import dispatcher.clock
import dispatcher.limits.gate


def fake_db_clock(monkeypatch: pytest.MonkeyPatch, clock: Callable[..., datetime]) -> None:
    """Make ``db_now`` answer ``clock()`` in every module of the app that reads it.

    The statement that reads the clock with the keys' readings (``gate.clock_and_read``: a claim's,
    and a start's with kept policies) answers the fake clock and no readings: its caller then
    reads them at that clock (``gate.assess``), as on a database without that statement.
    """
    real = dispatcher.clock.db_now
    for name, module in list(sys.modules.items()):
        if (name == "dispatcher" or name.startswith("dispatcher.")) and getattr(module, "db_now", None) is real:
            monkeypatch.setattr(module, "db_now", clock)

    def clock_and_read(*args: Any, **kwargs: Any) -> tuple[datetime, None, None]:
        return clock(), None, None

    monkeypatch.setattr(dispatcher.limits.gate, "clock_and_read", clock_and_read)
