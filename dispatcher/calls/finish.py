"""Finish: record an attempt's outcome (done, retry, fail, 429 deferral) and correct a reported cost."""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction
from django.db.models import F, Q

from dispatcher import tables
from dispatcher.calls.rows import attempts
from dispatcher.clock import db_now, from_us, to_us
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import bounded_charge
from dispatcher.keys import parse_key_set
from dispatcher.limits import catalog, ledger, locks
from dispatcher.limits.guard import GUARD_MAX
from dispatcher.limits.shapes import SlidingWindow, TokenBucket
from dispatcher.retry import RetryPolicy
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status
from dispatcher.store import call_sql, functions, prepared, schema

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager
    from dispatcher.models import Attempt, CallQueue

log = logging.getLogger("dispatcher")


MAX_ERROR_CHARS = 10_000


def _finish(
    manager: CallQueueManager, call: CallQueue, attempt: Attempt, outcome: str, error: str, *, wake: bool = True, **changes: Any
) -> bool:
    keys = parse_key_set(call.key_set)
    error = error[:MAX_ERROR_CHARS]
    # No key is locked: running calls have no counter (a capped key counts its running calls
    # at each check, under its lock), so finishes never wait on the starts of their keys.
    if schema.postgresql_path(manager.db):
        won = _finish_postgresql(manager, call, attempt.id, keys, outcome, error, changes, wake)
    else:
        won = _finish_portable(manager, call, attempt.id, keys, outcome, error, changes, wake)
    if not won:
        # Rescued while it ran (the run took longer than DISPATCHER_RUN_TIMEOUT).
        log.warning("finish_lost call=%s attempt=%s outcome=%s", call.id, attempt.number, outcome)
    return won


def _finish_changes(
    changes: dict[str, Any], now: datetime, keys: list[str], wake: bool
) -> tuple[dict[str, Any], bool]:
    """Resolve the changes that depend on the finish time; say whether to wake dispensers."""
    changes = {k: (v(now) if callable(v) else v) for k, v in changes.items()}
    # Wake dispensers when the call waits again, or when it may free a concurrency slot.
    return changes, changes.get("status") == Status.PENDING or (wake and bool(keys))


def _finish_portable(
    manager: CallQueueManager, call: CallQueue, attempt_id: int, keys: list[str], outcome: str, error: str,
    changes: dict[str, Any], wake: bool,
) -> bool:
    """The guarded update, the attempt, the wake-up; no key is locked (see ``_finish``)."""
    with transaction.atomic(using=manager.db):
        now = db_now(manager.db)
        changes, wake = _finish_changes(changes, now, keys, wake)
        won = bool(manager.filter(id=call.id, status=Status.RUNNING, dispatch_no=call.dispatch_no).update(**changes))
        if won:
            attempts(manager).filter(id=attempt_id).update(
                finished_at=now, outcome=outcome, error=error
            )
            if wake:
                locks.wake_dispensers(using=manager.db)
    return won


def _finish_postgresql(
    manager: CallQueueManager, call: CallQueue, attempt_id: int, keys: list[str], outcome: str, error: str,
    changes: dict[str, Any], wake: bool,
) -> bool:
    """The same in one statement (``call_sql.finish``), atomic by itself."""
    now = db_now(manager.db)
    changes, wake = _finish_changes(changes, now, keys, wake)
    db = connections[manager.db]
    values = [manager.model._meta.get_field(name).get_db_prep_save(value, db) for name, value in changes.items()]
    params = [
        *values, call.id, Status.RUNNING, call.dispatch_no, now, outcome, error, attempt_id,
        locks.WAKE_CHANNEL, wake,
    ]
    with prepared.cursor(manager.db) as cursor:
        cursor.execute(call_sql.finish(tuple(changes)), params)
        return bool(cursor.fetchone()[0])


def finish_done(
    manager: CallQueueManager, call: CallQueue, attempt: Attempt, result: Any, *, wake: bool = True
) -> bool:
    """Record a successful attempt and its result; ``wake=False`` when no key has a concurrency cap.

    On PostgreSQL one statement on the database's clock (``finish_done_many``'s), with no
    clock read before it.
    """
    if schema.postgresql_path(manager.db):
        return finish_done_many(manager, [(call, attempt, result, wake)]) == 1
    return _finish(manager,
        call, attempt, Outcome.DONE, "", wake=wake, status=Status.DONE, result=result, finished_at=lambda now: now, last_error=""
    )


def finish_done_many(manager: CallQueueManager, done: Sequence[tuple[CallQueue, Attempt, Any, bool]]) -> int:
    """Record successful attempts (call, attempt, result, wake) together; return how many were won.

    On PostgreSQL one statement, as ``finish_done`` for one; a call rescued while it ran is
    not won (and logged), as there.
    """
    db = connections[manager.db]
    if not schema.postgresql_path(manager.db):
        return sum(finish_done(manager, call, attempt, result, wake=wake) for call, attempt, result, wake in done)
    result_field = manager.model._meta.get_field("result")
    params: dict[str, Any] = {
        "ids": [call.id for call, _, _, _ in done], "nos": [call.dispatch_no for call, _, _, _ in done],
        "attempts": [attempt.id for _, attempt, _, _ in done],
        "results": [result_field.get_db_prep_save(result, db) for _, _, result, _ in done],
        "wakes": [bool(wake) and bool(call.key_set) for call, _, _, wake in done],
        "done": Status.DONE, "outcome": Outcome.DONE, "running": Status.RUNNING, "channel": locks.WAKE_CHANNEL,
    }
    with prepared.cursor(manager.db) as cursor:
        cursor.execute(functions.finish_done_statement(manager.db), functions.bind(manager.db, params))
        won = {row[0] for row in cursor.fetchall()}
    for call, attempt, _, _ in done:
        if call.id not in won:
            log.warning("finish_lost call=%s attempt=%s outcome=done", call.id, attempt.number)
    return len(won)


def finish_error(
    manager: CallQueueManager, call: CallQueue, attempt: Attempt, error: str, tb: str, *, permanent: bool, wake: bool = True
) -> bool:
    """Record a failed attempt: retry with backoff while attempts remain, else fail."""
    # The error's start names the exception's class; a traceback's end does.
    error = error[:MAX_ERROR_CHARS]
    if permanent or call.attempts >= call.max_attempts:
        return _finish(manager,
            call, attempt, Outcome.FAILED if permanent else Outcome.ERROR, error, wake=wake,
            status=Status.FAILED, finished_at=lambda now: now, last_error=error, last_traceback=tb[-MAX_ERROR_CHARS:],
        )
    delay = RetryPolicy.from_settings().delay(call.attempts)
    return _finish(manager,
        call, attempt, Outcome.ERROR, error, wake=wake,
        status=Status.PENDING, run_at=lambda now: now + delay, dispatched_at=None,
        last_error=error, last_traceback=tb[-MAX_ERROR_CHARS:],
    )


def finish_rate_limited(
    manager: CallQueueManager, call: CallQueue, attempt: Attempt, retry_after: float | None, key: str | None, error: str
) -> bool:
    """Record a 429: pause the key, put the call back to wait, refund the attempt."""
    wait = timedelta(seconds=retry_after) if retry_after is not None else dispatcher_settings.DEFAULT_RETRY_AFTER
    # A downstream may ask for any pause; none lasts longer than DISPATCHER_MAX_PAUSE.
    wait = min(max(wait, timedelta(0)), dispatcher_settings.MAX_PAUSE)
    keys = parse_key_set(call.key_set)
    paused = [key] if key else keys
    max_deferrals = dispatcher_settings.MAX_DEFERRALS
    gives_up = max_deferrals is not None and call.deferrals + 1 > max_deferrals
    with transaction.atomic(using=manager.db):
        locks.lock_keys(sorted(set(keys) | set(paused)), using=manager.db)
        now = db_now(manager.db)
        until = now + wait
        fields: dict[str, Any] = {"deferrals": F("deferrals") + 1, "attempts": F("attempts") - 1, "last_error": error}
        if gives_up:
            spent = call.deferrals + 1
            fields.update(status=Status.FAILED, finished_at=now,
                          last_error=f"{error} (gave up after {spent} deferral{'' if spent == 1 else 's'})")
        else:
            fields.update(status=Status.PENDING, run_at=until, dispatched_at=None)
        won = manager.filter(id=call.id, status=Status.RUNNING, dispatch_no=call.dispatch_no).update(**fields)
        if not won:
            log.warning("finish_lost call=%s attempt=%s outcome=rate_limited", call.id, attempt.number)
            return False
        attempts(manager).filter(id=attempt.id).update(
            finished_at=now, outcome=Outcome.RATE_LIMITED, error=error[:MAX_ERROR_CHARS]
        )
        ledger.pause(paused, until, reason=f"429 from call #{call.id}", using=manager.db)
    return True


def finish_missed(manager: CallQueueManager, call: CallQueue, attempt: Attempt, error: str) -> bool:
    """Record a held request that was not sent (``arrivals.SendMissed``): the call waits again at
    once, its attempt refunded, counted as a deferral; no key is paused (its start's room is spent)."""
    # The guarded update (still running, same dispatch) makes the started row's counts current.
    return _finish(
        manager, call, attempt, Outcome.MISSED, error,
        status=Status.PENDING, run_at=lambda now: now, dispatched_at=None,
        attempts=call.attempts - 1, deferrals=call.deferrals + 1, last_error=error[:MAX_ERROR_CHARS],
    )


def correct_cost(
    manager: CallQueueManager, call: CallQueue, reported: int | Mapping[str, int], *, late: bool = False
) -> dict[str, int]:
    """Correct the keys' usage to what a started call really cost; return the change per key.

    The call's rows in the start log take the reported units (and every later running
    total of the key moves with them); its buckets are charged or refunded the difference.

    ``late``: its request went out later than its start was counted under, and its windows
    count it from its send too, with the units known then (logged again or kept as a late
    start, ``delaywriter``). A cost found higher is then logged again too, its extra units from
    now: a window judged after the correction counts them until a period after now, past the
    period after its arrival that the API counts them for. A cost found lower leaves what was
    counted from the send as it is (it only holds calls back).
    """
    keys = parse_key_set(call.key_set)
    if isinstance(reported, Mapping):
        actual = {key: int(reported.get(key, call.cost_of(key))) for key in keys}
    else:
        actual = dict.fromkeys(keys, int(reported))
    deltas = {key: actual[key] - call.cost_of(key) for key in keys if actual[key] != call.cost_of(key)}
    if not deltas or call.started_at is None:
        return {}
    with transaction.atomic(using=manager.db):
        locks.lock_keys(keys, using=manager.db)
        policies = catalog.Policies.load(manager.db)
        now = db_now(manager.db)
        starts = tables.StartLog.objects.using(manager.db)
        buckets = tables.KeyBucket.objects.using(manager.db)
        for key, delta in deltas.items():
            start = starts.filter(key=key, started_at=call.started_at, call_id=call.id).first()
            if start is not None:
                # Every start after it in the log's order moves: a start of 0 units (refunded)
                # right after it shares its running total, and comes after it by id.
                after = Q(cum__gt=start.cum) | Q(cum=start.cum, id__gt=start.id)
                starts.filter(after, key=key).update(cum=F("cum") + delta)
                starts.filter(id=start.id).update(units=F("units") + delta, cum=F("cum") + delta)
            tables.KeyState.objects.using(manager.db).filter(key=key).update(total=F("total") + delta)
            later: list[tuple[datetime, int]] | None = None
            for policy in policies.for_key(key):
                if not isinstance(policy, TokenBucket):
                    continue
                bucket = buckets.filter(key=key, period=policy.period).first()
                if bucket is None or bucket.since > call.started_at:
                    # This bucket (new, or a new shape) never charged the start: nothing to
                    # give back, and an extra charge would count a start it did not see.
                    continue
                if delta < 0 and later is None:
                    later = _starts_after(manager, key, call, start)
                tat = policy.refund(from_us(bucket.tat_us), now, -bounded_charge(delta, policy.capacity()), later or ())
                if tat is not None:
                    buckets.filter(id=bucket.id).update(tat_us=to_us(tat))
        windows = {
            key: delta for key, delta in deltas.items()
            if late and delta > 0 and any(isinstance(p, SlidingWindow) for p in policies.for_key(key))
        }
        if windows:
            ledger.log_now(windows, using=manager.db)
        if any(delta < 0 for delta in deltas.values()):
            locks.wake_dispensers(using=manager.db)
    return deltas


def _starts_after(
    manager: CallQueueManager, key: str, call: CallQueue, start: models.Model | None
) -> list[tuple[datetime, int]]:
    """Return (time, units) of the key's starts after ``call``'s, in order, for a bucket's refund.

    Starts at the same instant are included whatever their order: they can only make the
    refund smaller, never give back units a later start still holds. Each is put at the latest
    moment its bucket may have been charged for (a held request's send moment: at most the
    largest guard after its start), for the same reason.
    """
    later = tables.StartLog.objects.using(manager.db).filter(key=key, started_at__gte=call.started_at)
    if start is not None:
        later = later.exclude(id=start.pk)
    held = dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX)
    return [(at + held, units) for at, units in later.order_by("started_at", "id").values_list("started_at", "units")]
