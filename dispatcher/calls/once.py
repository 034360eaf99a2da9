"""Send once: a call's unique key, held while the call waits or is in flight and for ``unique_for`` after it was sent.

A partial unique index (``dispatcher_call_unique_key_held``) admits one holder per key, so two
senders can never both store a call: the loser's INSERT skips the row (PostgreSQL's ``ON CONFLICT
DO NOTHING``, SQLite's savepoint), and it returns the holder instead. A call keeps holding its key
after it finished until its ``unique_until`` passes; the next send with that key then releases it
(a guarded UPDATE) and takes the key. Finishing a call writes nothing here, so the hot paths of the
worker are unchanged.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from django.db import connections
from django.db.models import Q
from django.db.models.functions import Now
from django.utils import timezone

from dispatcher.calls.rows import call_from_row
from dispatcher.durations import parse_positive_duration
from dispatcher.exceptions import InvalidCall
from dispatcher.states import CallStatus as Status
from dispatcher.store import call_sql, schema

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager
    from dispatcher.models import CallQueue
    from dispatcher.store.inserts import NewCall

# The calls that hold their unique key: the unique index's condition.
HOLDS_UNIQUE_KEY = Q(unique_key__isnull=False, unique_released=False)
MAX_UNIQUE_KEY = 255
ON_DUPLICATE = ("keep", "replace")
# Rounds of insert, release and retry: a round ends with every call stored or its holder found,
# unless a holder let its key go meanwhile (rolled back, released); three make that vanishingly rare.
ROUNDS = 3
FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)
# How far the app's clock may run behind the database's before a lapsed hold is missed at once
# (it is released by the next send after that).
CLOCK_SKEW = timedelta(seconds=5)
# Keys per statement when looking holders up (SQLite's variable limit is 999 on old builds).
KEYS_PER_QUERY = 500


class Unique(NamedTuple):
    """A call's unique key, how long it holds it after it was sent, and what a duplicate send does."""

    key: str
    hold_for: timedelta | None
    replace: bool


def clean_unique(unique_key: Any, unique_for: Any, on_duplicate: Any) -> Unique | None:
    """Return send()'s unique arguments checked (None without a key); raise InvalidCall if bad."""
    if on_duplicate not in ON_DUPLICATE:
        raise InvalidCall(f"on_duplicate must be 'keep' or 'replace', not {on_duplicate!r}")
    if unique_key is None:
        if unique_for is not None:
            raise InvalidCall("unique_for needs a unique_key")
        if on_duplicate != "keep":
            raise InvalidCall("on_duplicate='replace' needs a unique_key")
        return None
    if not isinstance(unique_key, str):
        raise InvalidCall(f"unique_key must be a string, not {type(unique_key).__name__}")
    if not unique_key.strip():
        raise InvalidCall("unique_key cannot be empty")
    if len(unique_key) > MAX_UNIQUE_KEY:
        raise InvalidCall(f"unique_key is {len(unique_key)} characters; the limit is {MAX_UNIQUE_KEY}")
    if not unique_key.isprintable():
        raise InvalidCall("unique_key must be printable text (no control characters)")
    hold_for = None
    if unique_for is not None:
        if isinstance(unique_for, bool) or not isinstance(unique_for, (str, timedelta, int, float)):
            raise InvalidCall(f"unique_for must be a timedelta or a duration like '10m', not {type(unique_for).__name__}")
        try:
            hold_for = parse_positive_duration(unique_for)
        except (ValueError, OverflowError) as exc:
            raise InvalidCall(f"unique_for: {exc}") from None
    return Unique(unique_key, hold_for, on_duplicate == "replace")


# Stores calls skipping those whose key is held: one stored row or None per call, in order.
Store = Callable[[list["NewCall"]], list["CallQueue | None"]]


def send_once(
    manager: CallQueueManager, calls: Sequence[NewCall], store: Store, tried: list[CallQueue | None] | None = None
) -> list[CallQueue]:
    """Store the calls whose unique key is free; return one call per input (``created`` says which).

    ``tried``: what ``store`` returned for these calls (keys unique among them) if the caller already ran it.
    """
    results: list[CallQueue | None] = [None] * len(calls)
    first: dict[str, int] = {}
    todo: list[int] = []
    for index, call in enumerate(calls):
        if call.unique is None:
            todo.append(index)
        elif call.unique.key not in first:  # a duplicate inside the batch: the first wins
            first[call.unique.key] = index
            todo.append(index)
    for _ in range(ROUNDS):
        missed = []
        if tried is not None:
            stored, tried = tried, None
        else:
            stored = store([calls[i] for i in todo]) if todo else []
        for index, row in zip(todo, stored, strict=True):
            if row is None:
                missed.append(index)
            else:
                row.created = True
                results[index] = row
        if not missed:
            todo = []
            break
        holders = _holders(manager, [_key(calls[i]) for i in missed])
        todo = []
        for index in missed:
            holder = holders.get(_key(calls[index]))
            if holder is None:  # released or rolled back meanwhile: try again
                todo.append(index)
            else:
                results[index] = _duplicate(manager, holder, calls[index])
        if not todo:
            break
    if todo:
        raise InvalidCall(f"unique_key {_key(calls[todo[0]])!r}: its holder kept changing; send again")
    for index, call in enumerate(calls):
        if results[index] is None:
            results[index] = _as_duplicate(results[first[_key(call)]])
    return results  # type: ignore[return-value]  # every entry was filled above


def _key(call: NewCall) -> str:
    assert call.unique is not None
    return call.unique.key


def _as_duplicate(row: CallQueue | None) -> CallQueue:
    assert row is not None
    twin = copy.copy(row)
    twin.created = False
    return twin


def _holders(manager: CallQueueManager, keys: list[str]) -> dict[str, CallQueue]:
    """Return the calls holding these keys, after releasing those whose holder finished and whose window passed."""
    holders: dict[str, CallQueue] = {}
    unique = sorted(set(keys))
    for start in range(0, len(unique), KEYS_PER_QUERY):
        chunk = unique[start:start + KEYS_PER_QUERY]
        rows = _held_by(manager, chunk)
        # The app's clock only picks the candidates; the guarded UPDATE decides on the database's.
        now = timezone.now()
        lapsed = [
            row.pk for row in rows
            if row.status in FINISHED and (row.unique_until is None or row.unique_until <= now + CLOCK_SKEW)
        ]
        if lapsed and manager.filter(HOLDS_UNIQUE_KEY, id__in=lapsed, status__in=FINISHED).filter(
            Q(unique_until__isnull=True) | Q(unique_until__lte=Now())
        ).update(unique_released=True):
            rows = _held_by(manager, chunk)  # again: the released ones are gone
        holders.update((row.unique_key, row) for row in rows if row.unique_key is not None)
    return holders


def _held_by(manager: CallQueueManager, keys: list[str]) -> list[CallQueue]:
    """Return the calls holding these keys (at most KEYS_PER_QUERY)."""
    if schema.postgresql_path(manager.db):
        # Written by hand: compiling the ORM's query took more of a duplicate send than its two statements.
        with connections[manager.db].cursor() as cursor:
            cursor.execute(call_sql.unique_holders(), {"keys": keys})
            return [call_from_row(manager.model, manager.db, row) for row in cursor.fetchall()]
    return list(manager.filter(HOLDS_UNIQUE_KEY, unique_key__in=keys))


def held_keys(manager: CallQueueManager, keys: list[str]) -> set[str]:
    """Return which of these unique keys a call holds."""
    unique = sorted(set(keys))
    return {
        key
        for start in range(0, len(unique), KEYS_PER_QUERY)
        for key in manager.filter(HOLDS_UNIQUE_KEY, unique_key__in=unique[start:start + KEYS_PER_QUERY])
        .values_list("unique_key", flat=True)
        if key is not None
    }


def _duplicate(manager: CallQueueManager, holder: CallQueue, call: NewCall) -> CallQueue:
    """Return the holder of the call's key; with replace, a waiting holder takes the call's params and run_at."""
    assert call.unique is not None
    if call.unique.replace:
        if holder.method != call.method:
            raise InvalidCall(
                f"unique_key {call.unique.key!r} is held by call #{holder.pk} of method {holder.method!r};"
                f" on_duplicate='replace' needs the same method"
            )
        # Guarded: a call claimed in the meantime is in flight and is left as it is (as keep).
        replaced = manager.filter(id=holder.pk, status=Status.PENDING).update(
            params=call.params, keys=call.keys, key_set=call.key_set, cost=call.cost,
            run_at=Now() if call.run_at is None else call.run_at,
        )
        if replaced:
            holder.refresh_from_db(using=manager.db)
    holder.created = False
    return holder
