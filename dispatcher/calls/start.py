"""Start: a worker moves a dispatched call to running under its keys' locks, counting the attempt."""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import F

from dispatcher import arrivals, tables
from dispatcher.calls.rows import attempts, call_from_row, json_value
from dispatcher.clock import db_now
from dispatcher.keys import parse_key_set
from dispatcher.limits import gate, ledger, locks
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status
from dispatcher.store import call_sql, schema
from dispatcher.store.folded import Folded, folding, start_transaction

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager
    from dispatcher.models import Attempt, CallQueue

log = logging.getLogger("dispatcher")


# How long a start may wait for its slot while holding its keys' locks (see start()): a few
# milliseconds that no other start of these keys could use anyway.
HOLD_FOR_SLOT = timedelta(milliseconds=30)


class StartState(enum.StrEnum):
    """What a worker's attempt to start a delivery did."""

    STARTED = "started"
    """The call is running; its attempt is counted."""
    STALE = "stale"
    """The delivery is not the call's current one (a duplicate or late message): nothing changed."""
    DEFERRED = "deferred"
    """The call's keys had no room: it waits again until they do."""
    EARLY = "early"
    """The keys have room within the delivery's allowed wait: nothing changed; try again then."""


@dataclass
class Started:
    """The outcome of a worker's attempt to start a call."""

    state: StartState
    call: CallQueue | None = None
    attempt: Attempt | None = None
    reason: str = ""
    # Whether a key of the call has a concurrency cap, so its finish frees a slot to wake for.
    capped: bool = False
    # For an early delivery: how long until its keys have room.
    wait: timedelta = timedelta(0)


class _GroupRaced(Exception):
    """A call of a message's group was no longer the delivery's to start: start each on its own."""


def start(
    manager: CallQueueManager, call_id: int, dispatch_no: int, worker: str = "", *, may_wait: timedelta = timedelta(0)
) -> Started:
    """Move a dispatched call to running if its keys still have room; count the attempt.

    If the keys have no room now but will within ``may_wait``, nothing changes and the
    result says how long to wait before trying again ("early").
    """
    with connections[manager.db].cursor() as cursor:
        # Hand-written: read before any lock at every start, where the ORM's compilation
        # would cost more than the query.
        cursor.execute(call_sql.call_head(), [call_id])
        head = cursor.fetchone()
    if head is None:
        return Started(StartState.STALE, reason="no such call")
    if head[1] != Status.DISPATCHED or head[2] != dispatch_no:
        return Started(StartState.STALE, reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}")
    keys = parse_key_set(head[0])
    cost = json_value(head[3]) or {}
    costs = {key: cost.get(key, 1) for key in keys}
    return folding(lambda fold: _start_locked(manager, call_id, dispatch_no, keys, costs, worker, may_wait, fold=fold))


def _start_locked(
    manager: CallQueueManager, call_id: int, dispatch_no: int, keys: list[str], costs: dict[str, int], worker: str,
    may_wait: timedelta, *, fold: bool,
) -> Started:
    """The transaction of ``start``: lock the keys, judge the call, mark it running or defer it."""
    capped = False
    record = None
    with start_transaction(manager.db, fold) as folded:
        if keys:
            states = locks.lock_keys(keys, using=manager.db, folded=folded)
            # Read after the lock wait, so a policy edit committed meanwhile binds this start;
            # with the policies this process kept, in the statement that reads the windows.
            policies, now, read = gate.policies_for_start(keys, states, using=manager.db)
            # Re-checked at the start itself: a message may have waited in the broker while
            # the window filled, a policy tightened or a pause began.
            assessment = gate.assess(
                keys, states, now, policies, for_start=True, costs=costs, read=read, using=manager.db
            )
            verdict = gate.combine(list(assessment.verdicts.values()))
            if (
                verdict.blocked and verdict.until is not None
                and verdict.until - now <= min(may_wait, HOLD_FOR_SLOT)
            ):
                # The slot frees within a few milliseconds: wait for it holding the key locks,
                # which no other start of these keys could use before then anyway, so the
                # start lands on its slot rather than a worker's round trip after it.
                time.sleep((verdict.until - now).total_seconds())
                # The start's clock is read again: its worker measures the send against this
                # reading (the wait for the slot is not a start-to-send delay).
                arrivals.mark_clock()
                now = db_now(manager.db)
                assessment = gate.assess(keys, states, now, policies, for_start=True, costs=costs, using=manager.db)
                verdict = gate.combine(list(assessment.verdicts.values()))
            if verdict.blocked and verdict.until is not None and verdict.until - now <= may_wait:
                return Started(StartState.EARLY, reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now)
            if verdict.blocked:
                # Back to wait in its place (its run_at unchanged): the dispensers' own check
                # finds no room either until the verdict's moment, so it is not claimed before.
                deferred = manager.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
                    status=Status.PENDING, dispatched_at=None
                )
                if not deferred:
                    return Started(StartState.STALE, reason="claimed by another delivery")
                ledger.adjust(keys, reserved=-1, units=costs, using=manager.db)
                return Started(StartState.DEFERRED, reason=f"{verdict.key}: {verdict.reason}")
            capped = any(p.concurrency for key in keys for p in policies.for_key(key))
            record = gate.start_record(keys, states, assessment, policies, now, costs)
        else:
            now = db_now(manager.db)
        started = _mark_running(manager, call_id, dispatch_no, keys, now, worker[:200], record, folded)
    if started is None:
        return Started(StartState.STALE, reason="claimed by another delivery")
    return Started(StartState.STARTED, call=started[0], attempt=started[1], capped=capped)


def start_many(
    manager: CallQueueManager, deliveries: Sequence[tuple[int, int]], worker: str = "", *, may_wait: timedelta = timedelta(0)
) -> list[Started]:
    """Start the calls of one message together; return one ``Started`` per delivery, in order.

    One transaction locks all their keys once and checks the calls against the limits as
    one group, in the message's order (each admitted call counts against the next); a call
    that does not fit goes back to wait, as ``start()`` defers one, unless its keys have
    room within ``may_wait``: then nothing changes for it ("early"). One statement marks the
    admitted calls running and writes their attempts, start logs, buckets and counters. If
    a duplicate delivery started one of them meanwhile, none of the group's starts is kept
    (the calls it deferred stay deferred in a folded start, ``dispatcher.folded``) and each
    is started on its own. SQLite starts them one by one.
    """
    worker = worker[:200]
    if not schema.postgresql_path(manager.db) or len(deliveries) < 2:
        return [
            start(manager, call_id, dispatch_no, worker, may_wait=may_wait) for call_id, dispatch_no in deliveries
        ]
    with connections[manager.db].cursor() as cursor:
        cursor.execute(call_sql.call_heads(), [[call_id for call_id, _ in deliveries]])
        heads = {row[0]: row[1:] for row in cursor.fetchall()}
    results: dict[int, Started] = {}
    live: list[tuple[int, int, int, list[str], dict[str, int]]] = []
    seen: set[int] = set()
    for index, (call_id, dispatch_no) in enumerate(deliveries):
        head = heads.get(call_id)
        if head is None or call_id in seen:
            results[index] = Started(StartState.STALE, reason="no such call" if head is None else "twice in one message")
        elif head[1] != Status.DISPATCHED or head[2] != dispatch_no:
            results[index] = Started(
                StartState.STALE, reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}"
            )
        else:
            keys = parse_key_set(head[0])
            cost = json_value(head[3]) or {}
            live.append((index, call_id, dispatch_no, keys, {key: cost.get(key, 1) for key in keys}))
            seen.add(call_id)
    try:
        results.update(folding(lambda fold: _start_group(manager, live, worker, may_wait, fold=fold)))
    except _GroupRaced:
        for index, call_id, dispatch_no, _, _ in live:
            results[index] = start(manager, call_id, dispatch_no, worker, may_wait=may_wait)
    return [results[index] for index in range(len(deliveries))]


def _start_group(
    manager: CallQueueManager, live: list[tuple[int, int, int, list[str], dict[str, int]]], worker: str, may_wait: timedelta,
    *, fold: bool,
) -> dict[int, Started]:
    """Start (or defer) the live deliveries of a message in one transaction; see start_many()."""
    results: dict[int, Started] = {}
    if not live:
        return results
    all_keys = sorted({key for _, _, _, keys, _ in live for key in keys})
    with start_transaction(manager.db, fold) as folded:
        states = locks.lock_keys(all_keys, using=manager.db, folded=folded)
        policies, now, read = gate.policies_for_start(all_keys, states, using=manager.db)
        group = gate.Group(states, policies, now, gate.assess(
            all_keys, states, now, policies, for_start=True, read=read, using=manager.db
        ))
        admitted = []
        for index, call_id, dispatch_no, keys, costs in live:
            verdict = group.check(keys, costs)
            if not verdict.blocked:
                capped = any(p.concurrency for key in keys for p in policies.for_key(key))
                admitted.append((index, call_id, dispatch_no, group.admit(keys, costs), capped))
                continue
            if verdict.until is not None and verdict.until - now <= may_wait:
                results[index] = Started(
                    StartState.EARLY, reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now
                )
                continue
            # Back to wait in its place, as ``start`` sends one back.
            deferred = manager.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
                status=Status.PENDING, dispatched_at=None
            )
            if not deferred:
                raise _GroupRaced
            ledger.adjust(keys, reserved=-1, units=costs, using=manager.db)
            results[index] = Started(StartState.DEFERRED, reason=f"{verdict.key}: {verdict.reason}")
        if admitted:
            started = _mark_running_group(manager, admitted, now, worker, group, folded)
            if len(started) < len(admitted):
                raise _GroupRaced  # rolls back the whole group
            for index, call_id, _, _, capped in admitted:
                call, attempt = started[call_id]
                results[index] = Started(StartState.STARTED, call=call, attempt=attempt, capped=capped)
    return results


def _mark_running_group(
    manager: CallQueueManager, admitted: list[tuple[int, int, int, gate.StartRecord, bool]], now: datetime, worker: str,
    group: gate.Group, folded: Folded | None = None,
) -> dict[int, tuple[CallQueue, Attempt]]:
    """One statement (``call_sql.mark_running_group``): mark the admitted calls running, open their
    attempts, write their start logs, the buckets' last states and each key's counters (only
    if every call was won)."""
    log = [(key, units, cum, call_id) for _, call_id, _, record, _ in admitted for key, units, cum in record.log]
    buckets: dict[tuple[str, timedelta], int] = {}
    for _, _, _, record, _ in admitted:
        for key, period, tat in record.buckets:
            buckets[(key, period)] = tat  # each charge builds on the one before: the last is the state
    moved: dict[str, list[int]] = {}
    for key, units, _, _ in log:
        calls_units = moved.setdefault(key, [0, 0])
        calls_units[0] += 1
        calls_units[1] += units
    params: dict[str, Any] = {
        "running": Status.RUNNING, "outcome": Outcome.RUNNING, "dispatched": Status.DISPATCHED, "now": now,
        "worker": worker, "n": len(admitted),
        "ids": [call_id for _, call_id, _, _, _ in admitted], "nos": [no for _, _, no, _, _ in admitted],
        "log_keys": [row[0] for row in log], "log_units": [row[1] for row in log],
        "log_cums": [row[2] for row in log], "log_calls": [row[3] for row in log],
        "b_keys": [key for key, _ in buckets], "b_periods": [period for _, period in buckets],
        "b_tats": list(buckets.values()),
        # Started at the judged clock itself: each bucket's last state needs no carrying.
        "b_charged": [0 for _ in buckets],
        "c_keys": list(moved), "c_calls": [m[0] for m in moved.values()], "c_units": [m[1] for m in moved.values()],
        "c_totals": [group.states[key].total for key in moved],
    }
    statement = call_sql.mark_running_group()
    with connections[manager.db].cursor() as cursor:
        cursor.execute(folded.commit(statement) if folded else statement, params)
        rows = cursor.fetchall()
    started: dict[int, tuple[CallQueue, Attempt]] = {}
    for row in rows:
        call, attempt = _started_from_row(manager, row, now, worker)
        started[call.id] = (call, attempt)
    return started


def _started_from_row(
    manager: CallQueueManager, row: Sequence[Any], now: datetime, worker: str
) -> tuple[CallQueue, Attempt]:
    """The call and attempt a start statement returned (the attempt's id and number, then the call).

    The start's time is the call's ``started_at``: the statement's own clock, never before ``now``.
    """
    call = call_from_row(manager.model, manager.db, row[2:])
    attempt = tables.Attempt(id=row[0], call=call, number=row[1], started_at=call.started_at or now, worker=worker)
    attempt._state.adding, attempt._state.db = False, manager.db
    return call, attempt


def _mark_running(
    manager: CallQueueManager, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
    record: gate.StartRecord | None, folded: Folded | None = None,
) -> tuple[CallQueue, Attempt] | None:
    """Mark the call running, log its starts and open its attempt; None if the delivery is stale."""
    record = record or gate.StartRecord()
    if schema.postgresql_path(manager.db):
        return _mark_running_postgresql(manager, call_id, dispatch_no, keys, now, worker, record, folded)
    return _mark_running_portable(manager, call_id, dispatch_no, keys, now, worker, record)


def _mark_running_portable(
    manager: CallQueueManager, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
    record: gate.StartRecord,
) -> tuple[CallQueue, Attempt] | None:
    """The guarded update, then the call read back, its attempt, the start log and buckets, the counters."""
    won = manager.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
        status=Status.RUNNING, started_at=now, attempts=F("attempts") + 1
    )
    if not won:
        return None
    call = manager.get(id=call_id)
    attempt = attempts(manager).create(
        call=call, number=call.attempts + call.deferrals, started_at=now, worker=worker
    )
    ledger.record_starts(now, record, call_id, using=manager.db)
    ledger.adjust(
        keys, reserved=-1, units={key: units for key, units, _ in record.log},
        totals={key: cum for key, _, cum in record.log}, using=manager.db,
    )
    return call, attempt


def _mark_running_postgresql(
    manager: CallQueueManager, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
    record: gate.StartRecord, folded: Folded | None,
) -> tuple[CallQueue, Attempt] | None:
    """The same as one statement (``call_sql.mark_running``), with a folded start's COMMIT."""
    params: dict[str, Any] = {
        "running": Status.RUNNING, "outcome": Outcome.RUNNING, "dispatched": Status.DISPATCHED, "now": now, "id": call_id,
        "dispatch_no": dispatch_no, "worker": worker,
        "log_keys": [k for k, _, _ in record.log], "log_units": [u for _, u, _ in record.log],
        "log_cums": [c for _, _, c in record.log], "log_calls": [call_id for _ in record.log],
        "b_keys": [k for k, _, _ in record.buckets], "b_periods": [p for _, p, _ in record.buckets],
        "b_tats": [t for _, _, t in record.buckets],
        # What each start charged its bucket beyond max(tat, now), to carry to the later clock.
        "b_charged": record.charged,
    }
    statement = call_sql.mark_running()
    with connections[manager.db].cursor() as cursor:
        cursor.execute(folded.commit(statement) if folded else statement, params)
        row = cursor.fetchone()
    if row is None:
        return None
    return _started_from_row(manager, row, now, worker)
