"""Start: a worker moves a dispatched call to running under its keys' locks, counting the attempt."""
from __future__ import annotations

import enum
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.db.models import F

from dispatcher import arrivals, tables
from dispatcher.calls.rows import attempts, call_from_row, json_value
from dispatcher.clock import db_now, to_us
from dispatcher.keys import parse_key_set
from dispatcher.limits import gate, ledger, locks
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status
from dispatcher.store import call_sql, functions, limit_sql, prepared, schema
from dispatcher.store.folded import Folded, Unfoldable, can_fold, folding, start_transaction

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager
    from dispatcher.models import Attempt, CallQueue, KeyState

log = logging.getLogger("dispatcher")


# How long a start may wait for its slot while holding its keys' locks (see start()): a few
# milliseconds that no other start of these keys could use anyway.
HOLD_FOR_SLOT = timedelta(milliseconds=30)
# How much sooner than its clock reading a start woken for its slot may be judged (see start()):
# more than a loaded machine's usual overshoot of the wait and the clock's round trip (0.2-2 ms).
SLOT_GIVE = timedelta(milliseconds=5)


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
    # For a started call: per key, its buckets (period, the state its start left them in µs): a
    # late held request moves them on only while they stand (``arrivals.release``); and how far
    # a late request of before had moved them on since the start read them (its hold is longer).
    buckets: dict[str, list[tuple[timedelta, int]]] = field(default_factory=dict)
    moved: timedelta = timedelta(0)
    # The start's token, which its buckets keep until a later start charges them.
    start: int = 0


class _GroupRaced(Exception):
    """A call of a message's group was no longer the delivery's to start: start each on its own."""

    results: dict[int, Started]
    live: list[_Delivery]


def start(
    manager: CallQueueManager, call_id: int, dispatch_no: int, worker: str = "", *, may_wait: timedelta = timedelta(0)
) -> Started:
    """Move a dispatched call to running if its keys still have room; count the attempt.

    A call alone is a group of one (``start_many``). If the keys have no room now but will
    within ``may_wait``, nothing changes and the result says how long to wait before trying
    again ("early").
    """
    return start_many(manager, [(call_id, dispatch_no)], worker, may_wait=may_wait)[0]


def warm(manager: CallQueueManager) -> None:
    """Run a start's statements once on no calls, so that this thread's first start runs them warm.

    A new worker process's first start took 10-16 ms longer from its clock reading to its return
    than its later ones (a new database session's first use of the tables and their indexes, and
    this process's first building of the statements), and its request went out that much later:
    the largest delay a key's learnt guard then keeps for every later start (issue 28's notes).
    Each statement here matches no row; nothing is written. On PostgreSQL only (SQLite's
    statements are the ORM's, in-process, with no session of their own to warm).
    """
    if not schema.postgresql_path(manager.db):
        return
    db = manager.db
    _heads(manager, [])
    with connections[db].cursor() as cursor:
        cursor.execute(limit_sql.lock_key_states(), [[]])
        if can_fold(db):  # a folded start's first statements (``_start_deliveries``)
            cursor.execute(f"{limit_sql.lock_key_states_of_calls()}; {call_sql.call_heads()}", [[], []])
    # The first reads the policies with the clock and keeps them; the second is a start's
    # statement once they are kept.
    for _ in range(2):
        gate.policies_for_start([], {}, using=db)
    with connections[db].cursor() as cursor:
        params = _mark_running_params([], db_now(db), "", {}, {}, 0)[0]
        cursor.execute(functions.mark_statement(db, True), functions.bind(db, params))


def start_many(
    manager: CallQueueManager, deliveries: Sequence[tuple[int, int]], worker: str = "", *, may_wait: timedelta = timedelta(0)
) -> list[Started]:
    """Start calls together (a message's, or one); return one ``Started`` per delivery, in order.

    One transaction locks all their keys once and checks the calls against the limits as
    one group, in the given order (each admitted call counts against the next); a call
    that does not fit goes back to wait in its place (its run_at unchanged), unless its keys
    have room within ``may_wait``: then nothing changes for it ("early"). One statement marks
    the admitted calls running and writes their attempts, start logs, buckets and counters. If
    a duplicate delivery started one of them meanwhile, none of the group's starts is kept
    (the calls it deferred stay deferred in a folded start, ``dispatcher.folded``) and each
    is started as a group of one.
    """
    worker = worker[:200]
    try:
        return folding(lambda fold: _start_deliveries(manager, deliveries, worker, may_wait, fold=fold))
    except _GroupRaced as raced:
        results = raced.results
        for one in raced.live:
            results[one.index] = (
                Started(StartState.STALE, reason="claimed by another delivery") if len(raced.live) == 1
                else start(manager, one.call_id, one.dispatch_no, worker, may_wait=may_wait)
            )
        return [results[index] for index in range(len(deliveries))]


def _start_deliveries(
    manager: CallQueueManager, deliveries: Sequence[tuple[int, int]], worker: str, may_wait: timedelta, *, fold: bool,
) -> list[Started]:
    """Read the deliveries' calls, then start the live ones as a group (see start_many()).

    Folded (``store.folded``), the calls' heads are read in the transaction's first round trip,
    with BEGIN and after the lock of their keys (``locks.lock_keys_of_calls``); else before the
    transaction, and its lock after."""
    ids = [call_id for call_id, _ in deliveries]
    db = manager.db
    fold = fold and can_fold(db)
    heads = None if fold else _heads(manager, ids)
    with start_transaction(db, fold) as folded:
        states = None
        if heads is None:
            assert folded is not None  # can_fold: start_transaction folds
            rows, states = locks.lock_keys_of_calls(ids, call_sql.call_heads(), db, folded)
            heads = {row[0]: row[1:] for row in rows}
        results, live = _live(deliveries, heads)
        if live:
            try:
                results.update(_start_group(manager, live, worker, may_wait, folded, states))
            except _GroupRaced as raced:
                raced.results, raced.live = results, live
                raise
    return [results[index] for index in range(len(deliveries))]


def _live(deliveries: Sequence[tuple[int, int]], heads: Mapping[int, Sequence[Any]]) -> tuple[dict[int, Started], list[_Delivery]]:
    """The stale deliveries' results (by their place in the message), and the live ones."""
    results: dict[int, Started] = {}
    live: list[_Delivery] = []
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
            live.append(_Delivery(index, call_id, dispatch_no, keys, {key: cost.get(key, 1) for key in keys}))
            seen.add(call_id)
    return results, live


@dataclass
class _Delivery:
    """A delivery still its call's to start: where it stands in the message, and its keys and costs."""

    index: int
    call_id: int
    dispatch_no: int
    keys: list[str]
    costs: dict[str, int]


def _heads(manager: CallQueueManager, ids: list[int]) -> dict[int, Sequence[Any]]:
    """Read what a start checks before any lock (key_set, status, dispatch_no, cost) per call id
    (an unfolded start's; a folded one reads them with its lock, ``locks.lock_keys_of_calls``).

    Hand-written: read at every start, where the ORM's compilation would cost more than the query.
    """
    with prepared.cursor(manager.db) as cursor:
        if schema.postgresql_path(manager.db):
            cursor.execute(call_sql.call_heads(), [ids])
            return {row[0]: row[1:] for row in cursor.fetchall()}
        heads = {}
        for call_id in ids:
            cursor.execute(call_sql.call_head(), [call_id])
            head = cursor.fetchone()
            if head is not None:
                heads[call_id] = head
        return heads


def _start_group(
    manager: CallQueueManager, live: list[_Delivery], worker: str, may_wait: timedelta, folded: Folded | None,
    locked: dict[str, KeyState] | None,
) -> dict[int, Started]:
    """Start (or defer) the live deliveries in the start's transaction, their keys ``locked``
    already or locked here; see start_many()."""
    results: dict[int, Started] = {}
    db = manager.db
    all_keys = sorted({key for one in live for key in one.keys})
    if locked is None:
        states = locks.lock_keys(all_keys, using=db, folded=folded)
    elif all(key in locked for key in all_keys):
        states = {key: locked[key] for key in all_keys}
    else:
        raise Unfoldable(f"no key row for {sorted(set(all_keys) - set(locked))}")
    policies, now, read = gate.policies_for_start(all_keys, states, using=db)
    # Read after the lock wait, so a policy edit committed meanwhile binds these starts; and
    # re-checked at the start itself: a message may have waited in the broker while the
    # window filled, a policy tightened or a pause began.
    group = gate.Group(states, policies, now, gate.assess(all_keys, states, now, policies, for_start=True, read=read, using=db))
    admitted: list[tuple[_Delivery, gate.StartRecord, bool]] = []
    for one in live:
        verdict = group.check(one.keys, one.costs)
        if verdict.blocked and not admitted and verdict.until is not None and verdict.until - now <= min(may_wait, HOLD_FOR_SLOT):
            # The slot frees within a few milliseconds and nothing of the group started yet:
            # wait for it holding the key locks, which no other start of these keys could
            # use before then anyway, so the start lands on its slot rather than a worker's
            # round trip after it. The start's clock is read again: its worker measures the
            # send against this reading (the wait for the slot is not a start-to-send delay).
            time.sleep((verdict.until - now).total_seconds())
            with arrivals.reading_clock():
                now = db_now(db)
            # Woken a little late (the sleep's overshoot, the clock's round trip): judged at
            # the slot still, up to SLOT_GIVE sooner than the clock read, so a held request
            # keeps its moment rather than the overshoot's (its hold counts from the slot).
            # Safe for every shape: nothing else started on these keys meanwhile (their locks),
            # a window judged earlier counts no fewer starts, and the start is recorded at
            # its own clock, which carries an unheld bucket's charge (call_sql._start_writes).
            slot = max(verdict.until, now - SLOT_GIVE)
            if slot < now:
                arrivals.judged_earlier(now - slot)
                now = slot
            group = gate.Group(states, policies, now, gate.assess(all_keys, states, now, policies, for_start=True, using=db))
            verdict = group.check(one.keys, one.costs)
        if not verdict.blocked:
            capped = any(p.concurrency for key in one.keys for p in policies.for_key(key))
            admitted.append((one, group.admit(one.keys, one.costs), capped))
            continue
        if verdict.until is not None and verdict.until - now <= may_wait:
            results[one.index] = Started(
                StartState.EARLY, reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now
            )
            continue
        # Back to wait in its place (its run_at unchanged): the dispensers' own check finds
        # no room either until the verdict's moment, so it is not claimed before.
        deferred = manager.filter(id=one.call_id, status=Status.DISPATCHED, dispatch_no=one.dispatch_no).update(
            status=Status.PENDING, dispatched_at=None
        )
        if not deferred:
            raise _GroupRaced
        ledger.adjust(one.keys, reserved=-1, units=one.costs, using=db)
        results[one.index] = Started(StartState.DEFERRED, reason=f"{verdict.key}: {verdict.reason}")
    if admitted:
        token = secrets.randbits(62)
        started = _mark_running(manager, admitted, now, worker, group, folded, token)
        if len(started) < len(admitted):
            raise _GroupRaced  # rolls back the whole group
        for one, _, capped in admitted:
            call, attempt, buckets, moved = started[one.call_id]
            results[one.index] = Started(
                StartState.STARTED, call=call, attempt=attempt, capped=capped,
                buckets={key: found for key in one.keys if (found := buckets.get(key))},
                moved=max((moved.get(key, timedelta(0)) for key in one.keys), default=timedelta(0)), start=token,
            )
    return results


# Per started call: the call, its attempt, per key its buckets' states (period, µs) and how far a
# late request had moved each key's buckets on since the start read them.
Marked = tuple["CallQueue", "Attempt", dict[str, list[tuple[timedelta, int]]], dict[str, timedelta]]


def _mark_running(
    manager: CallQueueManager, admitted: list[tuple[_Delivery, gate.StartRecord, bool]], now: datetime, worker: str,
    group: gate.Group, folded: Folded | None, token: int,
) -> dict[int, Marked]:
    """Mark the admitted calls running (at ``now``, or on PostgreSQL at the statement's own clock,
    never earlier), open their attempts, write their start logs,
    the buckets' last states and each key's counters; fewer calls returned than admitted: one
    was no longer its delivery's (and, on PostgreSQL, nothing was written)."""
    if schema.postgresql_path(manager.db):
        return _mark_running_postgresql(manager, admitted, now, worker, group, folded, token)
    return _mark_running_portable(manager, admitted, now, worker, token)


def _mark_running_postgresql(
    manager: CallQueueManager, admitted: list[tuple[_Delivery, gate.StartRecord, bool]], now: datetime, worker: str,
    group: gate.Group, folded: Folded | None, token: int,
) -> dict[int, Marked]:
    """One statement (``call_sql.mark_running_group``), all or nothing, with a folded start's COMMIT."""
    params, buckets, charged = _mark_running_params(admitted, now, worker, group.read_tats, group.states, token)
    statement = functions.mark_statement(manager.db, buckets=bool(buckets))
    if folded is not None and not prepared.preparing(manager.db):
        # A prepared statement goes alone: the folded start then sends its COMMIT on its own.
        statement = folded.commit(statement)
    with prepared.cursor(manager.db) as cursor:
        cursor.execute(statement, functions.bind(manager.db, params))
        rows = cursor.fetchall()
    started: dict[int, Marked] = {}
    for row in rows:
        call = call_from_row(manager.model, manager.db, row[3:])
        attempt = tables.Attempt(id=row[0], call=call, number=row[1], started_at=call.started_at or now, worker=worker)
        attempt._state.adding, attempt._state.db = False, manager.db
        # What each bucket holds now: as the statement returned it where it existed, else the
        # state judged, carried to the start's clock (call_sql._start_writes).
        at = to_us(call.started_at or now)
        written = {bucket: max(tat, at + charged[bucket]) for bucket, tat in buckets.items()}
        moves: dict[str, timedelta] = {}
        for place, tat, move in row[2] or ():
            bucket = list(buckets)[place - 1]
            written[bucket] = tat
            moves[bucket[0]] = max(moves.get(bucket[0], timedelta(0)), timedelta(microseconds=move))
        states: dict[str, list[tuple[timedelta, int]]] = {}
        for (key, period), tat in written.items():
            states.setdefault(key, []).append((period, tat))
        started[call.id] = (call, attempt, states, moves)
    return started


def _mark_running_params(
    admitted: list[tuple[_Delivery, gate.StartRecord, bool]], now: datetime, worker: str,
    read_tats: Mapping[tuple[str, timedelta], int | None], states: Mapping[str, KeyState], token: int,
) -> tuple[dict[str, Any], dict[tuple[str, timedelta], int], dict[tuple[str, timedelta], int]]:
    """The parameters of ``call_sql.mark_running_group`` for the admitted calls (none: ``warm``), and
    the state each bucket is charged to and by how much beyond the state it was judged on."""
    log = [(key, units, cum, one.call_id) for one, record, _ in admitted for key, units, cum in record.log]
    buckets: dict[tuple[str, timedelta], int] = {}
    charged: dict[tuple[str, timedelta], int] = {}
    for _, record, _ in admitted:
        for (key, period, tat), beyond in zip(record.buckets, record.charged, strict=True):
            buckets[(key, period)] = tat  # each charge builds on the one before: the last is the state
            charged[(key, period)] = charged.get((key, period), 0) + beyond
    moved: dict[str, list[int]] = {}
    for key, units, _, _ in log:
        calls_units = moved.setdefault(key, [0, 0])
        calls_units[0] += 1
        calls_units[1] += units
    params = {
        "running": Status.RUNNING, "outcome": Outcome.RUNNING, "dispatched": Status.DISPATCHED, "now": now,
        "worker": worker, "n": len(admitted),
        "ids": [one.call_id for one, _, _ in admitted], "nos": [one.dispatch_no for one, _, _ in admitted],
        "log_keys": [row[0] for row in log], "log_units": [row[1] for row in log],
        "log_cums": [row[2] for row in log], "log_calls": [row[3] for row in log],
        "b_keys": [key for key, _ in buckets], "b_periods": [period for _, period in buckets],
        "b_tats": list(buckets.values()),
        "b_charged": [charged[bucket] for bucket in buckets],
        "b_read": [read_tats.get(bucket) for bucket in buckets], "b_start": token,
        "c_keys": list(moved), "c_calls": [m[0] for m in moved.values()], "c_units": [m[1] for m in moved.values()],
        "c_totals": [states[key].total for key in moved],
    }
    return params, buckets, charged


def _mark_running_portable(
    manager: CallQueueManager, admitted: list[tuple[_Delivery, gate.StartRecord, bool]], now: datetime, worker: str,
    token: int,
) -> dict[int, Marked]:
    """The same through the ORM, call by call (in the group's transaction): the guarded update,
    the call read back, its attempt, the start log and buckets, the counters. No late request
    moves a bucket meanwhile: the transaction holds SQLite's write lock from its start."""
    started: dict[int, Marked] = {}
    states: dict[str, list[tuple[timedelta, int]]] = {}
    for one, record, _ in admitted:
        won = manager.filter(id=one.call_id, status=Status.DISPATCHED, dispatch_no=one.dispatch_no).update(
            status=Status.RUNNING, started_at=now, attempts=F("attempts") + 1
        )
        if not won:
            return started  # fewer than admitted: the group rolls back
        call = manager.get(id=one.call_id)
        attempt = attempts(manager).create(
            call=call, number=call.attempts + call.deferrals, started_at=now, worker=worker
        )
        ledger.record_starts(now, record, one.call_id, using=manager.db, start=token)
        ledger.adjust(
            one.keys, reserved=-1, units={key: units for key, units, _ in record.log},
            totals={key: cum for key, _, cum in record.log}, using=manager.db,
        )
        for key, period, tat in record.buckets:
            states[key] = [*(b for b in states.get(key, []) if b[0] != period), (period, tat)]
        started[one.call_id] = (call, attempt, states, {})
    # Every call of the group sees its buckets as the group left them.
    return {call_id: (call, attempt, dict(states), moves) for call_id, (call, attempt, _, moves) in started.items()}
