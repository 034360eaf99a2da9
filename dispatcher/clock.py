"""The one clock the limiter trusts: the database's."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from django.db import DEFAULT_DB_ALIAS, connections
from django.utils import timezone

from dispatcher.store.schema import CLOCK, READ_CLOCK


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


def db_now_commit_unflushed(using: str = DEFAULT_DB_ALIAS) -> datetime:
    """Return the database clock (``db_now``), and on PostgreSQL let the transaction this runs in
    commit without waiting for its WAL to reach the disk (``synchronous_commit`` off for it
    alone), in the same round trip.

    Only for a transaction whose loss in a database crash leaves nothing wrong (a claim: see
    ``calls.dispense.claim_batch``). Other sessions see its commit at once as ever; a later
    durable commit flushes it with its own (the WAL is written in order).
    """
    if connections[using].vendor != "postgresql":
        return db_now(using)
    return _read_clock(using, f"SELECT {CLOCK}, set_config('synchronous_commit', 'off', true)")


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(moment: datetime) -> int:
    """Return a moment as whole microseconds since the epoch (how bucket states are stored)."""
    return (moment - EPOCH) // timedelta(microseconds=1)


def from_us(value: int) -> datetime:
    """Return the moment of a count of microseconds since the epoch."""
    return EPOCH + timedelta(microseconds=value)
