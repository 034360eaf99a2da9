"""The limiter's counters and logs: reserved units, the start log, bucket states, pauses and the remembered send delays."""
from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatcher import tables
from dispatcher.clock import db_now, to_us
from dispatcher.conf import dispatcher_settings
from dispatcher.limits.guard import (
    GUARD_MAX,
    LATE_MAX,
    DelayMemory,
    LateStart,
    delay_memory,
    late_starts,
    late_text,
    remember_delay,
)
from dispatcher.limits.locks import alias, lock_keys
from dispatcher.store import limit_sql, prepared, schema
from dispatcher.store.folded import Folded, can_fold

if TYPE_CHECKING:
    from dispatcher.limits.gate import StartRecord


def record_starts(
    at: datetime, record: StartRecord, call_id: int | None = None, using: str | None = None, start: int | None = None
) -> None:
    """Append a start's rows to the log and write its buckets, with the start's token (the ORM's
    path; totals move in ``adjust``)."""
    db = alias(using)
    tables.StartLog.objects.using(db).bulk_create(
        [tables.StartLog(key=k, started_at=at, units=u, cum=c, call_id=call_id) for k, u, c in record.log]
    )
    if record.buckets:
        tables.KeyBucket.objects.using(db).bulk_create(
            [tables.KeyBucket(key=k, period=p, tat_us=t, since=at, start=start) for k, p, t in record.buckets],
            update_conflicts=True, unique_fields=["key", "period"], update_fields=["tat_us", "start"],
        )


def adjust_reserved(
    by_key: dict[str, int], units: Mapping[str, int] | None = None, using: str | None = None, folded: Folded | None = None,
) -> None:
    """Add to the reserved counters (calls and units) of locked keys, each its own amount, in one
    statement; with ``folded``, the folded transaction's COMMIT goes with it (not prepared)."""
    units = units or by_key
    by_key = {key: n for key, n in by_key.items() if n}
    if not by_key:
        return
    params = [value for pair in by_key.items() for value in pair]
    params += [value for key in by_key for value in (key, units.get(key, by_key[key]))]
    params += list(by_key)
    db = alias(using)
    statement = limit_sql.adjust_reserved(len(by_key))
    if folded is not None:
        with connections[db].cursor() as cursor:
            cursor.execute(folded.commit(statement), params)
        return
    with prepared.cursor(db) as cursor:
        cursor.execute(statement, params)


def adjust(
    keys: Sequence[str],
    *,
    reserved: int = 0,
    units: Mapping[str, int] | None = None,
    totals: Mapping[str, int] | None = None,
    using: str | None = None,
) -> None:
    """Move the reserved counters of locked keys; ``units`` per key go with ``reserved`` (default 1 per call).

    ``totals`` sets the keys' running totals of units started (a start's new totals). Running
    calls have no counter: a capped key counts them from the calls at its check (``read_keys``).
    """
    if not keys or reserved == 0:
        return
    states = tables.KeyState.objects.using(alias(using))
    if units is None and not totals:
        states.filter(key__in=list(keys)).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + reserved,
        )
        return
    # Per key: each moves by its own units, and a start sets each key's own running total.
    sign = 1 if reserved > 0 else -1
    for key in keys:
        states.filter(key=key).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + sign * (units or {}).get(key, abs(reserved)),
            **({"total": totals[key]} if totals else {}),
        )




# The keys this process has marked answered, per database: a key costs one write per process,
# not one per call. Bounded; cleared when full (a key marked again costs one more write).
_answered: set[tuple[str, str]] = set()
MAX_ANSWERED = 10_000


def mark_answered(keys: Sequence[str], using: str | None = None) -> None:
    """Record that a call of these keys finished: from now on their calls may share messages."""
    db = alias(using)
    new = [key for key in keys if (db, key) not in _answered]
    if not new:
        return
    states = tables.KeyState.objects.using(db)
    # One statement per key, each its own transaction: a statement updating several rows locks
    # them in the order it finds them, and a start holding one while it waits for another would
    # deadlock with it (every locker of several keys takes them in key order); one row at a time
    # holds at most one lock.
    for key in sorted(new):
        states.filter(key=key, answered_at__isnull=True).update(answered_at=Now())
    if len(_answered) + len(new) > MAX_ANSWERED:
        _answered.clear()
    _answered.update((db, key) for key in new)


def unanswered(keys: Sequence[str], using: str | None = None) -> set[str]:
    """Return which of these keys no call has finished under yet (a key without a state row has none to wait for)."""
    if not keys:
        return set()
    states = tables.KeyState.objects.using(alias(using))
    return set(states.filter(key__in=list(keys), answered_at__isnull=True).values_list("key", flat=True))


def remember_send_delay(spans: Mapping[str, timedelta], delay: timedelta, using: str | None = None) -> int:
    """Keep a start-to-send delay measured on these keys (each with its memory span); return rows written.

    On PostgreSQL one statement (``limit_sql.remember_send_delay``) that writes only rows whose memory
    changes (a new largest delay, or a span gone by: at most a few per key and second); a worker
    calls it only when its start's reading says the memory changes. Several keys are locked
    first, in key order as every locker does: an UPDATE locks the rows it writes in the order it
    finds them (their place in the table), and a start holding one of them while waiting for the
    other would deadlock with it (the soak test met one a second).
    """
    return _remember_send_delay(spans, delay, using, kept=False)[0]


def remember_send_delay_kept(spans: Mapping[str, timedelta], delay: timedelta, using: str | None = None) -> dict[str, DelayMemory]:
    """Keep a start-to-send delay as ``remember_send_delay`` does; return each key's memory as it
    then stands, written or not (a worker's later calls then skip what it already covers)."""
    return _remember_send_delay(spans, delay, using, kept=True)[1]


def _remember_send_delay(
    spans: Mapping[str, timedelta], delay: timedelta, using: str | None, *, kept: bool
) -> tuple[int, dict[str, DelayMemory]]:
    """Return how many rows it wrote and (``kept``) every key's memory as it then stands."""
    if not spans:
        return 0, {}
    db = alias(using)
    if schema.postgresql_path(db):
        us = delay // timedelta(microseconds=1)
        several = len(spans) > 1
        with transaction.atomic(using=db) if several else contextlib.nullcontext():
            if several:
                lock_keys(list(spans), using=db)
            with connections[db].cursor() as cursor:
                params: dict[str, Any] = {"keys": list(spans), "spans": list(spans.values()), "us": us}
                cursor.execute(limit_sql.remember_send_delay(kept), params)
                if not kept:
                    return cursor.rowcount, {}
                rows = cursor.fetchall()
                return len(rows), {
                    key: DelayMemory(timedelta(microseconds=current), timedelta(microseconds=previous), since)
                    for key, current, previous, since in rows
                }
    written, memories = 0, {}
    states = tables.KeyState.objects.using(db)
    with transaction.atomic(using=db):
        now = db_now(db)
        for state in states.select_for_update().filter(key__in=list(spans)).order_by("key"):
            memory = remember_delay(delay_memory(state), now, spans[state.key], delay)
            if memory is not None:
                written += states.filter(key=state.key).update(
                    send_delay_us=memory.current // timedelta(microseconds=1),
                    send_delay_prev_us=memory.previous // timedelta(microseconds=1),
                    send_delay_since=memory.since,
                )
                if kept:
                    memories[state.key] = memory
            elif kept:
                memories[state.key] = delay_memory(state)
    return written, memories


def count_again(keys: Sequence[str], call_id: int, using: str | None = None) -> dict[str, int]:
    """Log the call's start again in the window logs of these keys, now, with the units its start
    logged there: its request went out later than any guard a window counts under, and counts
    from its send too. Under the key locks, at the database clock and after every start logged
    (the log's running totals stay in order); with no call of its own (a cost correction finds
    the call's start alone). Return the units logged per key."""
    db = alias(using)
    with transaction.atomic(using=db):
        states = lock_keys(list(keys), using=db)
        logged = dict(
            tables.StartLog.objects.using(db).filter(call_id=call_id, key__in=list(keys)).values_list("key", "units")
        )
        return log_now({key: logged.get(key, 1) for key in states}, using=db)


def log_now(units: Mapping[str, int], using: str | None = None) -> dict[str, int]:
    """Log ``units`` per key in the keys' window logs, now (at the database clock, after every
    start logged, each running total the key's next), with no call of their own: what a start
    counts again from later than it was judged. Under the key locks; return what was logged."""
    db = alias(using)
    now = db_now(db)
    totals = dict(tables.KeyState.objects.using(db).filter(key__in=list(units)).values_list("key", "total"))
    rows = []
    for key in sorted(units):
        total = totals.get(key) or 0
        latest = tables.StartLog.objects.using(db).filter(key=key).order_by("-cum", "-id").values_list("started_at", flat=True).first()
        at = max(now, latest) if latest is not None else now
        rows.append(tables.StartLog(key=key, started_at=at, units=units[key], cum=total + units[key], call_id=None))
        tables.KeyState.objects.using(db).filter(key=key).update(total=total + units[key])
    tables.StartLog.objects.using(db).bulk_create(rows)
    return {row.key: row.units for row in rows}


def keep_late(spans: Mapping[str, timedelta], call_id: int, reach: timedelta, using: str | None = None) -> list[str]:
    """Keep the call's start as a late start on the keys of ``spans`` (``guard.LateStart``): its
    request arrived up to ``reach`` after it. Under the key locks, with the start time and units its
    start logged; a key's late starts older than its memory span are dropped. Return the
    keys that keep ``LATE_MAX`` already, where it is not kept (a key whose log holds no start of
    the call, a refunded one, needs nothing)."""
    db = alias(using)
    full = []
    with transaction.atomic(using=db):
        states = lock_keys(list(spans), using=db)
        now = db_now(db)
        logged = {
            key: (at, units) for key, at, units in
            tables.StartLog.objects.using(db).filter(call_id=call_id, key__in=list(spans))
            .order_by("started_at").values_list("key", "started_at", "units")
        }  # a call started again (a retry): its latest start
        for key in sorted(states):
            if key not in logged:
                continue
            starts = [s for s in late_starts(states[key]) if s.arrives_by() + spans[key] >= now]
            if len(starts) >= LATE_MAX:
                full.append(key)
                continue
            at, units = logged[key]
            starts.append(LateStart(at, reach, units))
            tables.KeyState.objects.using(db).filter(key=key).update(late_starts=late_text(starts))
    return full


def push_buckets(overdue: Mapping[str, tuple[Sequence[timedelta], timedelta]], using: str | None = None) -> None:
    """Move the buckets of keys on by how much later than their guard allowed a request went out.

    A bucket's state is charged at the start with the guard known then; a request sent later
    arrives later, and GCRA's state moves at most as much as an arrival does, so moving it on by
    the difference keeps it at or past the API's. Under the key locks: a start reads and writes
    the bucket under them.
    """
    db = alias(using)
    with transaction.atomic(using=db):
        lock_keys(list(overdue), using=db)
        for key, (periods, late) in overdue.items():
            tables.KeyBucket.objects.using(db).filter(key=key, period__in=list(periods)).update(
                tat_us=models.F("tat_us") + late // timedelta(microseconds=1)
            )


def move_on(
    moved: Mapping[str, Sequence[tuple[timedelta, int]]], start: int, deadline: datetime | None, pad: timedelta,
    using: str | None = None,
) -> timedelta | None:
    """Move the buckets of held keys (per key: each bucket's period and the state its start left
    it in, µs) on, for a request that goes out later than they allowed (its ``deadline``, on the
    database's clock): to that state plus its lateness when the move is made and ``pad`` for
    the rest of its way out (plus ``pad`` alone without a deadline: an answer that says the API
    saw the request late, ``arrivals.answered``), never back. Return how far past that state the
    buckets stand (the first's), or None if they did not move.

    Only while each bucket still holds the token of the request's ``start``: a later start
    charged on it was judged on it as it was, and its request may already be on its way. The
    requests of one start (a message's calls, a burst) each move it as far as they need: the
    latest wins. A start judged before the move and written after it carries the move and holds
    its request that much longer (``call_sql._start_writes``). All or none. On PostgreSQL one
    statement that locks the bucket rows alone (a start waiting for its slot holds its keys'
    locks), its commit not waiting for the disk: the request waits for it (a durable commit took
    4-7 ms on a loaded machine). Other transactions see it at once; a database crash right after
    may forget it, with the request it was for.
    """
    rows = [(key, period, tat) for key in sorted(moved) for period, tat in sorted(moved[key])]
    if not rows:
        return timedelta(0)
    db = alias(using)
    deadline_us, pad_us = None if deadline is None else to_us(deadline), pad // timedelta(microseconds=1)
    if schema.postgresql_path(db):
        connection = connections[db]
        if connection.in_atomic_block:
            return None  # a handler's own transaction: the move would be seen only once it commits
        if len(rows) == 1:
            (key, period, tat), = rows
            statement = limit_sql.move_on_one()
            params: dict[str, Any] = {"key": key, "period": period, "tat": tat}
        else:
            statement = limit_sql.move_on()
            params = {"keys": [r[0] for r in rows], "periods": [r[1] for r in rows], "tats": [r[2] for r in rows]}
        params.update(start=start, deadline=deadline_us, pad=pad_us)
        with connection.cursor() as cursor:
            if can_fold(db):
                cursor.execute(f"BEGIN; SET LOCAL synchronous_commit = off; {statement}; COMMIT", params)
                cursor.nextset()
                cursor.nextset()
            else:
                cursor.execute(statement, params)
            found = cursor.fetchone()
        return None if found is None or found[0] is None else timedelta(microseconds=found[0])
    buckets = tables.KeyBucket.objects.using(db)
    # SQLite's write lock, taken as the transaction begins (IMMEDIATE), keeps starts out meanwhile.
    with transaction.atomic(using=db):
        for key, period, _ in rows:
            if not buckets.filter(key=key, period=period, start=start).exists():
                return None
        late = 0 if deadline_us is None else max(to_us(db_now(db)) - deadline_us, 0)
        stands: list[int] = []
        for key, period, tat in rows:
            current = buckets.filter(key=key, period=period).values_list("tat_us", flat=True).get()
            target = max(current, tat + late + pad_us)
            buckets.filter(key=key, period=period).update(tat_us=target)
            stands.append(target - tat)
    return timedelta(microseconds=stands[0])


def pause(keys: Sequence[str], until: datetime, reason: str = "", using: str | None = None) -> None:
    """Pause keys until the given time, never shortening a longer pause already set."""
    states = tables.KeyState.objects.using(alias(using))
    # In key order, as every locker of several keys (a caller's transaction keeps each row locked).
    for key in sorted(set(keys)):
        states.bulk_create([tables.KeyState(key=key)], ignore_conflicts=True)
        states.filter(Q(key=key) & (Q(paused_until__isnull=True) | Q(paused_until__lt=until))).update(
            paused_until=until, pause_reason=reason[:200]
        )


def prune_starts(batch: int = 5000, using: str | None = None) -> int:
    """Delete window-log rows older than the longest policy period (at least an hour)."""
    # Kept as long as the longest window counts (its period and the largest arrival guard).
    db = alias(using)
    longest = max([timedelta(hours=1), *tables.RateLimit.objects.using(db).values_list("period", flat=True)])
    cutoff = db_now(db) - longest - max(dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX))
    deleted = 0
    while True:
        with transaction.atomic(using=db):
            starts = tables.StartLog.objects.using(db)
            ids = list(starts.filter(started_at__lt=cutoff).values_list("id", flat=True)[:batch])
            if not ids:
                return deleted
            deleted += starts.filter(id__in=ids)._raw_delete(db)
