"""Log past starts of a key as a worker would have: in time order, with the key's running total."""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from dispatcher.models import KeyState, StartLog


def log_starts(key: str, times: Iterable[datetime], units: int = 1) -> None:
    """Append starts at the given times (older than any logged yet) to the key's start log."""
    state, _ = KeyState.objects.get_or_create(key=key)
    total = state.total
    rows = []
    for moment in sorted(times):
        total += units
        rows.append(StartLog(key=key, started_at=moment, units=units, cum=total))
    StartLog.objects.bulk_create(rows)
    KeyState.objects.filter(key=key).update(total=total)
