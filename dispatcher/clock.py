"""The one clock the limiter trusts: the database's."""
from __future__ import annotations

import threading
import time
from collections import deque
from datetime import UTC, datetime, timedelta

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from dispatcher.store.schema import READ_CLOCK


def db_now(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """Return the clock of the database ``using`` names, read now (not at transaction start)."""
    if connections[using].vendor == "postgresql":
        # clock_timestamp(), not now(): now() is frozen at transaction start, which would
        # predate any lock wait and let two dispensers judge one window at different times.
        return _read_clock(using, READ_CLOCK)
    # SQLite is a file on this machine, so its clock is this machine's clock.
    return timezone.now()


def _read_clock(using: str, statement: str) -> datetime:
    """Run a statement whose first column is the PostgreSQL clock; return it."""
    with connections[using].cursor() as cursor:
        cursor.execute(statement)
        moment: datetime = cursor.fetchone()[0]
        return moment


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(moment: datetime) -> int:
    """Return a moment as whole microseconds since the epoch (how bucket states are stored)."""
    return (moment - EPOCH) // timedelta(microseconds=1)


def from_us(value: int) -> datetime:
    """Return the moment of a count of microseconds since the epoch."""
    return EPOCH + timedelta(microseconds=value)


# How long this process keeps what its starts read of the database clock (``Offsets``): short
# enough that two clocks drifting apart (ppm) move it by microseconds.
OFFSET_WINDOW = 10.0


class Offsets:
    """Where the database's clock stands on this process's monotonic clock, read from its starts.

    A start's reading of the database clock happened between this process's monotonic time just
    before its query and just after it: the offset (monotonic less database time) lies between
    those two less the database's time. Just after bounds it from above, late by however long
    the answer took to come back and the thread to run again (a descheduled thread: several ms).
    The least upper bound of the recent starts is the closest one that is still safe: a request
    held to its moment on it leaves no sooner than its moment; it may leave later by as much as
    that bound lies above the greatest lower bound (the spread: tens of µs once a process has
    read the clock a few times, a whole round trip at its first start). A reading whose bounds
    contradict those kept (a clock stepped, either way) drops them.
    """

    def __init__(self) -> None:
        self._kept: deque[tuple[float, float, float]] = deque(maxlen=64)
        self._lock = threading.Lock()

    def note(self, before: float | None, after: float | None, clock: datetime) -> None:
        if before is None or after is None:
            return
        epoch = clock.timestamp()
        upper, lower = after - epoch, before - epoch
        with self._lock:
            if self._kept and (
                lower > min(kept for _, kept, _ in self._kept) or upper < max(kept for _, _, kept in self._kept)
            ):
                self._kept.clear()  # the readings contradict each other: a clock stepped
            self._kept.append((after, upper, lower))

    def at(self, clock: datetime, fallback: float) -> tuple[float, float]:
        """Return the database time ``clock`` on this process's monotonic clock, at the latest,
        and how much earlier it may be (``fallback`` and 0: nothing read lately)."""
        with self._lock:
            while self._kept and self._kept[0][0] < time.monotonic() - OFFSET_WINDOW:
                self._kept.popleft()
            if not self._kept:
                return fallback, 0.0
            least = min(upper for _, upper, _ in self._kept)
            greatest = max(lower for _, _, lower in self._kept)
        return clock.timestamp() + least, max(least - greatest, 0.0)
