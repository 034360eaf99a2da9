"""The per-key locks every claim, start and edit takes (sorted, so two lockers never deadlock), and the wake-up of dispensers."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import DataError, connections, router

from dispatcher import tables
from dispatcher.store import limit_sql, prepared, schema
from dispatcher.store.folded import Folded, Unfoldable

if TYPE_CHECKING:
    from dispatcher.models import KeyState


# The channel on which send(), finishes and policy edits wake long-running dispensers.
WAKE_CHANNEL = "dispatcher_wake"


def alias(using: str | None = None) -> str:
    """Return the database alias the limiter's statements run on: the caller's manager's, else the router's.

    The routing rule of the app: every statement runs on ``connections[alias]`` with the alias
    of the manager it serves (``self.db``), never on the default ``connection``.
    """
    return using or router.db_for_write(tables.KeyState)


def lock_keys(keys: Sequence[str], using: str | None = None, folded: Folded | None = None) -> dict[str, KeyState]:
    """Lock the KeyState rows of the keys, creating missing ones; call inside a transaction.

    In a folded start (``dispatcher.folded``) the lock opens the transaction, and missing rows
    raise ``Unfoldable``: creating them needs Django's transaction.
    """
    if not keys:
        return {}
    db = alias(using)
    ordered = sorted(set(keys))
    states = _select_for_update(ordered, db, folded)
    if len(states) < len(ordered):
        if folded is not None:
            raise Unfoldable(f"no key row for {sorted(set(ordered) - set(states))}")
        tables.KeyState.objects.using(db).bulk_create(
            [tables.KeyState(key=k) for k in ordered if k not in states], ignore_conflicts=True
        )
        states = _select_for_update(ordered, db)
    return states


def _select_for_update(ordered: list[str], db: str, folded: Folded | None = None) -> dict[str, KeyState]:
    if not schema.postgresql_path(db):
        return {s.key: s for s in tables.KeyState.objects.using(db).select_for_update().filter(key__in=ordered).order_by("key")}
    # Hand-written on PostgreSQL: this runs at every claim, start and finish, and compiling
    # the ORM's locking query costs more than running it.
    if folded is not None and not folded.begun:
        with connections[db].cursor() as cursor:
            cursor.execute(folded.begin(limit_sql.lock_key_states()), [ordered])
            cursor.nextset()  # past BEGIN's result, to the rows
            rows = cursor.fetchall()
    else:
        with prepared.cursor(db) as cursor:
            cursor.execute(limit_sql.lock_key_states(), [ordered])
            rows = cursor.fetchall()
    return _states(rows, db)


def _states(rows: list[tuple[Any, ...]], db: str) -> dict[str, KeyState]:
    """Whole KeyState rows as read (``limit_sql.lock_key_states``' columns), by key."""
    names = [f.attname for f in tables.KeyState._meta.concrete_fields]
    return {row[0]: tables.KeyState.from_db(db, names, row) for row in rows}


def lock_keys_of_calls(
    ids: list[int], heads: str, db: str, folded: Folded,
) -> tuple[list[tuple[Any, ...]], dict[str, KeyState]]:
    """A folded start's first round trip: ``BEGIN``, the lock of every key of the calls ``ids``
    (their KeyState rows), then the ``heads`` statement of those calls, its rows returned as
    they are: read once the locks are held, so a start of the same calls elsewhere (the same
    keys) has committed or not begun.

    The caller checks that the rows cover the keys of the calls it starts: a key without a row
    raises ``Unfoldable`` (creating it needs Django's transaction), as does a key set the
    database cannot read as a JSON array (the plain start then reads it and says why).
    """
    with connections[db].cursor() as cursor:
        try:
            cursor.execute(folded.begin(f"{limit_sql.lock_key_states_of_calls()}; {heads}"), [ids, ids])
        except DataError as exc:
            raise Unfoldable(f"a key set not read as a JSON array: {exc}") from None
        cursor.nextset()  # past BEGIN's result, to the locked rows
        locked = cursor.fetchall()
        cursor.nextset()
        rows = cursor.fetchall()
    return rows, _states(locked, db)


def wake_dispensers(using: str | None = None) -> None:
    """Wake long-running dispensers (on PostgreSQL, delivered when the transaction commits)."""
    connection = connections[alias(using)]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(schema.NOTIFY, [WAKE_CHANNEL])
