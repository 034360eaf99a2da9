"""Store new calls on PostgreSQL with hand-written INSERTs (``call_sql.insert_call``, ``call_sql.insert_calls``),
skipping the ORM's per-row SQL compilation."""
from __future__ import annotations

import functools
import json
import zoneinfo
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from dispatcher.store import call_sql

if TYPE_CHECKING:
    from dispatcher.calls.once import Unique
    from dispatcher.models import CallQueue

# The fields a new call starts with besides what send() sets: what the INSERTs write, or NULL.
_START = {
    "attempts": 0, "deferrals": 0, "dispatch_no": 0, "dispatched_at": None, "started_at": None,
    "finished_at": None, "result": None, "last_error": "", "last_traceback": "",
    "unique_key": None, "unique_until": None, "unique_released": False,
}

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_compact_json = json.JSONEncoder(separators=(",", ":"))


class NewCall(NamedTuple):
    """A validated call ready to store, its params also as the JSON text that is stored."""

    method: str
    params: dict[str, Any]
    params_json: str
    keys: list[str]
    key_set: str
    priority: int
    queue: str
    max_attempts: int
    run_at: datetime | None
    # Units per key when any differs from 1; None: 1 unit on every key.
    cost: dict[str, int] | None = None
    # The unique key send() was given (dispatcher.calls.once), or None.
    unique: Unique | None = None

    def fields(self, status: str) -> dict[str, Any]:
        """Return the model fields the call sets (run_at only if given: the database fills it)."""
        fields = {
            "method": self.method, "params": self.params, "keys": self.keys, "key_set": self.key_set,
            "priority": self.priority, "queue": self.queue, "max_attempts": self.max_attempts, "status": status,
        }
        if self.run_at is not None:
            fields["run_at"] = self.run_at
        if self.cost is not None:
            fields["cost"] = self.cost
        if self.unique is not None:
            fields["unique_key"] = self.unique.key
            if self.unique.hold_for is not None:
                fields["unique_until"] = timezone.now() + self.unique.hold_for
        return fields

    def hold_for_us(self) -> int | None:
        """Return how long the call holds its unique key after it was sent, in microseconds (None: while active)."""
        if self.unique is None or self.unique.hold_for is None:
            return None
        return self.unique.hold_for // timedelta(microseconds=1)


def insert_one(model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, call: NewCall, status: str) -> CallQueue:
    """Insert one call in the connection's current transaction (or autocommit); return it saved."""
    stored = _insert_one(model, db, connection, call, status, once=False)
    assert stored is not None  # only a unique key's holder skips a row
    return stored


def insert_one_once(
    model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, call: NewCall, status: str
) -> CallQueue | None:
    """Insert one call unless another call holds its unique key; return it saved, or None."""
    return _insert_one(model, db, connection, call, status, once=True)


def _insert_one(
    model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, call: NewCall, status: str, *, once: bool
) -> CallQueue | None:
    # created_at comes back as microseconds since the epoch, see insert_many().
    params: dict[str, Any] = {
        "method": call.method, "params": call.params_json, "keys": _compact_json.encode(call.keys),
        "key_set": call.key_set, "priority": call.priority, "queue": call.queue, "max_attempts": call.max_attempts,
        "run_at": call.run_at, "status": status, "cost": None if call.cost is None else _compact_json.encode(call.cost),
    }
    statement = call_sql.insert_call()
    if once:
        params["unique_key"] = call.unique.key if call.unique else None
        hold_for_us = call.hold_for_us()
        if hold_for_us is not None:
            params["hold_for_us"] = hold_for_us
        statement = call_sql.insert_call_once(hold_for_us is not None)
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        row = cursor.fetchone()
    if row is None:
        return None
    pk, created_us = row
    created_at = _from_epoch_us(connection, created_us)
    return _fresh_instance(model, db, call, status, pk, call.run_at or created_at, created_at)


def insert_many(
    model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, calls: list[NewCall], status: str
) -> list[CallQueue]:
    """Insert calls in one statement (all or none); return them saved, in the order given."""
    return [row for row in _insert_many(model, db, connection, calls, status, once=False) if row is not None]


def insert_many_once(
    model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, calls: list[NewCall], status: str
) -> list[CallQueue | None]:
    """Insert calls (keys unique among them) in one statement, skipping those whose unique key another call
    holds; return one stored call or None per call, in order."""
    return _insert_many(model, db, connection, calls, status, once=True)


def _insert_many(
    model: type[CallQueue], db: str, connection: BaseDatabaseWrapper, calls: list[NewCall], status: str, *, once: bool
) -> list[CallQueue | None]:
    # The calls travel as two JSON documents that the server unpacks, and created_at comes
    # back as microseconds since the epoch: arrays (escaped item by item) or timestamps
    # (loaded one by one through Django's time zone loader) cost more than the insert itself.
    rows = _compact_json.encode([
        {
            "method": call.method, "keys": call.keys, "key_set": call.key_set, "priority": call.priority,
            "queue": call.queue, "max_attempts": call.max_attempts,
            "run_at": None if call.run_at is None else call.run_at.isoformat(), "cost": call.cost,
            **({"unique_key": call.unique and call.unique.key, "hold_for_us": call.hold_for_us()} if once else {}),
        }
        for call in calls
    ])
    params_json = "[" + ",".join(call.params_json for call in calls) + "]"
    with connection.cursor() as cursor:
        statement = call_sql.insert_calls_once() if once else call_sql.insert_calls()
        cursor.execute(statement, {"status": status, "rows": rows, "params": params_json})
        inserted = sorted(cursor.fetchall())
    # The rows enter the table in input order (ORDER BY c.ord) and each takes the next id as
    # it does, so the ids sorted are the calls' ids in input order; RETURNING promises no order.
    # A call with a unique key was stored if its key came back (keys are unique among the calls).
    created = {us: _from_epoch_us(connection, us) for us in {row[1] for row in inserted}}
    stored_keys = {row[2] for row in inserted} if once else set()
    rows_in_order = iter(inserted)
    out: list[CallQueue | None] = []
    for call in calls:
        if call.unique is not None and call.unique.key not in stored_keys:
            out.append(None)
            continue
        pk, us = next(rows_in_order)[:2]
        out.append(_fresh_instance(model, db, call, status, pk, call.run_at or created[us], created[us]))
    return out


def _fresh_instance(
    model: type[CallQueue], db: str, call: NewCall, status: str, pk: int, run_at: datetime, created_at: datetime
) -> CallQueue:
    """Return the instance of a just-inserted call, as a read from the database would."""
    values = {
        **_START, "id": pk, "method": call.method, "params": call.params, "keys": call.keys,
        "key_set": call.key_set, "priority": call.priority, "queue": call.queue, "status": status,
        "run_at": run_at, "max_attempts": call.max_attempts, "created_at": created_at, "cost": call.cost,
    }
    if call.unique is not None:
        # As the INSERT computed it: the statement's timestamp (created_at) plus the hold.
        values["unique_key"] = call.unique.key
        values["unique_until"] = None if call.unique.hold_for is None else created_at + call.unique.hold_for
    names = _attnames(model)
    return model.from_db(db, names, [values[name] for name in names])


def _from_epoch_us(connection: BaseDatabaseWrapper, microseconds: int) -> datetime:
    """Return a time given in microseconds since the epoch as the connection reads timestamps."""
    moment = _EPOCH + timedelta(microseconds=microseconds)
    if connection.timezone is None:  # USE_TZ = False: naive, in the connection's time zone
        return timezone.make_naive(moment, zoneinfo.ZoneInfo(connection.timezone_name))
    return moment.astimezone(connection.timezone)


@functools.cache
def _attnames(model: type[CallQueue]) -> tuple[str, ...]:
    """Return the model's column attributes in the order its constructor takes them."""
    return tuple(field.attname for field in model._meta.concrete_fields)
