"""A key's start log kept in memory, as the database keeps it: the oracle the window arithmetic is checked against."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class LogEntry:
    """One start in a key's log: when, how many units, and the key's running total after it."""

    at: datetime
    units: int
    cum: int


def used_from_log(total: int, first_in_window: LogEntry | None) -> int:
    """Return the units in a window from the key's running total and the window's first entry."""
    if first_in_window is None:
        return 0
    return total - (first_in_window.cum - first_in_window.units)


def first_in_window(log: Sequence[LogEntry], since: datetime) -> LogEntry | None:
    """Return the oldest entry at or after ``since`` (what the database's index probe returns)."""
    return next((e for e in log if e.at >= since), None)


def leaves_at_from_log(log: Sequence[LogEntry], base: int, n: int) -> datetime | None:
    """Return the start time of the entry holding the n-th unit after ``base`` (the window's start)."""
    return next((e.at for e in log if e.cum >= base + n), None)
