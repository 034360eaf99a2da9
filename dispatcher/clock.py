"""The one clock the limiter trusts: the database's."""
from __future__ import annotations

from datetime import datetime

from django.db import connection
from django.utils import timezone

from dispatcher.sql import READ_CLOCK


def db_now() -> datetime:
    """Return the database's current time, read now (not at transaction start)."""
    from dispatcher.arrivals import mark_clock

    mark_clock()  # a start's recorded time: the worker measures its send against this moment
    if connection.vendor == "postgresql":
        # clock_timestamp(), not now(): now() is frozen at transaction start, which would
        # predate any lock wait and let two dispensers judge one window at different times.
        with connection.cursor() as cursor:
            cursor.execute(READ_CLOCK)
            return cursor.fetchone()[0]
    # SQLite is a file on this machine, so its clock is this machine's clock.
    return timezone.now()
