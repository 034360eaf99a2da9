"""The worker side: start a dispatched call, run its handler outside any transaction, record it."""
from __future__ import annotations

import json
import logging
import os
import reprlib
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any, TypeVar

from celery.signals import worker_process_init
from django.db import DatabaseError, InterfaceError, OperationalError, close_old_connections, connections

from dispatcher import arrivals, delaywriter, handlerpool
from dispatcher.calls.dispense import DISPATCH_AHEAD
from dispatcher.calls.start import StartState
from dispatcher.calls.start import warm as warm_start
from dispatcher.combiner import StartCombiner
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import take_reported
from dispatcher.exceptions import PermanentError, RateLimited, UnknownMethod
from dispatcher.limits import ledger
from dispatcher.models import Attempt, CallQueue
from dispatcher.neterrors import network_cause
from dispatcher.registry import get_handler
from dispatcher.running import running
from dispatcher.states import AttemptOutcome
from dispatcher.validation import bounded_seconds, check_json

log = logging.getLogger("dispatcher")

T = TypeVar("T")

# Waits for a slot a call was claimed ahead of, before the start defers it.
EARLY_TRIES = 3
# How much before its slot a worker that came early tries again: half the time a start waits
# for its slot holding the key locks (calls.start.HOLD_FOR_SLOT, 30 ms).
EARLY_WAKE = 0.015
# About 6 s of retries in all: long enough to ride out a failover or a killed connection.
RECORD_TRIES = 6


def _record(finish: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Record a start or an attempt's outcome, retrying if the database connection was lost
    or PostgreSQL ended the transaction to break a deadlock.

    Giving up would leave the call dispatched or running until the rescue sweep returns it
    (after a finish, with its handler already run). Starts and finishes are guarded updates,
    so a retry is safe.
    """
    for tries in range(1, RECORD_TRIES + 1):
        try:
            return finish(*args, **kwargs)
        except (OperationalError, InterfaceError) as exc:
            if tries == RECORD_TRIES:
                raise
            log.warning("record_retry finish=%s try=%s error=%r", finish.__name__, tries, exc)
            connections[CallQueue.objects.db].close()
            time.sleep(min(0.2 * 2 ** (tries - 1), 2.0))
    raise AssertionError("unreachable")


def _jsonable(value: Any) -> Any:
    """Return a handler's result if it stores as JSON within the bounds, else a short repr of it."""
    try:
        check_json(value, what="results")
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):  # OutOfBounds is a ValueError
        return {"repr": reprlib.repr(value)[:4096]}


_combiners: dict[str, StartCombiner] = {}
_combiners_lock = threading.Lock()


def _combined_start(call_id: int, dispatch_no: int, worker: str, *, may_wait: timedelta = timedelta(0)) -> Any:
    """Start a call together with the starts other threads of this process make meanwhile."""
    manager = CallQueue.objects
    combiner = _combiners.get(manager.db)
    if combiner is None:
        with _combiners_lock:
            combiner = _combiners.setdefault(manager.db, StartCombiner(manager.start_many))
    return combiner.start(call_id, dispatch_no, worker, may_wait=may_wait)


def warm_process(**_: Any) -> None:
    """Run a start's statements once on no calls (``calls.start.warm``), so that this process's
    first start is not slower than its later ones; never fails the worker (a database not yet up
    is met again by the first start)."""
    try:
        warm_start(CallQueue.objects)
    except DatabaseError as exc:
        log.warning("warm_start_failed error=%r", exc)
        connections[CallQueue.objects.db].close()


def warm_worker(**_: Any) -> None:
    """At worker_init, before the pool starts: warm this process (a prefork pool's children are
    forked from it with what it built; a pool's threads share it), then close its connection, so
    that no child is forked with it open; and have each prefork child warm its own database
    session, and open its delay writer's (``delaywriter``), as it starts. A threads pool's threads
    each open a session of their own, cold; its writer opens its own at its first late request.

    Connected at worker_init, so it runs after the worker_process_init receiver of Celery's Django
    fixup (connected as the worker initialises), which closes a new child's connections.
    """
    warm_process()
    connections[CallQueue.objects.db].close()
    worker_process_init.connect(warm_process, weak=False, dispatch_uid="dispatcher.worker.warm_process")
    opening = partial(delaywriter.open_connection, CallQueue.objects.db)
    worker_process_init.connect(opening, weak=False, dispatch_uid="dispatcher.worker.open_writer")


def execute(call_id: int, dispatch_no: int) -> str:
    """Run one delivery of a call; return what happened (started calls end done, retry or failed)."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    # A dispenser may claim a call up to DISPATCH_AHEAD before its slot frees: wait
    # for the slot here (briefly, holding no lock) rather than send the call back to wait.
    ahead = dispatcher_settings.tuned("DISPATCH_AHEAD", DISPATCH_AHEAD)
    for _ in range(EARLY_TRIES):
        started = _record(_combined_start, call_id, dispatch_no, worker=worker, may_wait=ahead)
        if started.state != StartState.EARLY:
            break
        # Wake a little before the slot: the next start then finds it within HOLD_FOR_SLOT and
        # waits for it holding the key locks, so it lands on the slot rather than a sleep's
        # overshoot and a start's round trips after it (measured: 8-76 ms, 20 ms typical).
        time.sleep(max(started.wait.total_seconds() - EARLY_WAKE, 0.0))
    else:
        started = _record(_combined_start, call_id, dispatch_no, worker=worker)
    if started.state != StartState.STARTED:
        log.info("run_skipped call=%s dispatch=%s state=%s reason=%s", call_id, dispatch_no, started.state, started.reason)
        return str(started.state)
    call, attempt = started.call, started.attempt
    assert call is not None and attempt is not None
    # DEBUG, as run_done: the attempt's row keeps the same (number, worker, start and finish) and
    # Celery logs each task's receipt and success. At INFO the two lines (formatted, redacted,
    # written) were ~5% of a `-P threads` worker's CPU. Skips, failures and retries stay INFO.
    log.debug("run_started call=%s method=%s attempt=%s", call.id, call.method, attempt.number)
    take_reported()  # a cost reported by an earlier call of this thread is not this call's
    move_on, tell = _tellers()
    clock_read, noted = arrivals.begin(call.keys, started.buckets, started.moved, move_on, started.start, tell)
    try:
        return _run(call, attempt, started.capped)
    finally:
        reported = take_reported()
        _remember_delay(call.id, clock_read, noted)
        _mark_answered(call.keys)
        if reported is not None:
            deltas = _record(CallQueue.objects.correct_cost, call, reported.units, late=reported.late)
            log.info("run_cost_corrected call=%s change=%s", call.id, deltas)


def _mark_answered(keys: Any) -> None:
    """Note that calls of these keys have finished (dispensers then group them); never fails the call."""
    try:
        ledger.mark_answered(list(keys))
    except DatabaseError as exc:
        log.warning("answered_not_kept keys=%s error=%r", ",".join(keys)[:200], exc)
        connections[CallQueue.objects.db].close()


def _remember_delay(call_id: int, clock_read: float | None, noted: Any) -> None:
    """Keep the measured start-to-send delay for the keys' arrival guard; never fails the call."""
    _keep_delay(call_id, clock_read, noted, arrivals.sent_after(clock_read))


def _keep_delay(call_id: int, clock_read: float | None, noted: Any, sent: arrivals.Sent | None) -> None:
    """Keep a start-to-send delay measured on this thread or a message's handler thread."""
    if sent is None:
        return
    overdue = arrivals.overdue(noted, sent)
    writes = arrivals.to_write(clock_read, noted, sent)
    if not writes and not overdue:
        return
    try:
        if overdue:
            ledger.push_buckets(overdue)
            log.info("send_late call=%s buckets=%s", call_id, {k: str(late) for k, (_, late) in overdue.items()})
        for delay, spans in writes.items():
            if ledger.remember_send_delay(spans, delay):
                log.info("send_delay call=%s delay_ms=%.1f", call_id, delay.total_seconds() * 1000)
    except (OperationalError, InterfaceError) as exc:
        log.warning("send_delay_not_kept call=%s error=%r", call_id, exc)
        connections[CallQueue.objects.db].close()


def _run(call: Any, attempt: Any, capped: bool) -> str:
    """Run the handler of a started call and record its outcome."""
    return _record_outcome(call, attempt, capped, _call_handler(call))


@dataclass
class Outcome:
    """What a handler did: "done" with its result, or the exception it raised and its traceback."""

    kind: AttemptOutcome  # DONE, RATE_LIMITED, MISSED, FAILED or ERROR
    result: Any = None
    error: BaseException | None = None
    traceback: str = ""


def begin_task() -> None:
    """Ready this thread's database connections for a task, as Django readies them for a request
    (``close_old_connections``: one that failed or outlived CONN_MAX_AGE is closed), but without
    the health check (CONN_HEALTH_CHECKS) Django would then make before the first query.

    That query is the call's start, or its finish, which ``_record`` retries on a new connection
    if this one was lost; the check's ``SELECT 1`` was a round trip per task (send -> API p50
    0.4-0.5 ms lower without it, in paired runs: docs/performance.md). A handler's own queries are still checked (``_checked``).
    """
    close_old_connections()
    _set_checked(True)


def _set_checked(done: bool) -> None:
    """Mark this thread's open connections checked (our statements) or due for a check (a handler's)."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None:
            conn.health_check_done = done  # type: ignore[attr-defined]  # Django >= 4.1; not in the stubs


@contextmanager
def _checked() -> Iterator[None]:
    """Around a handler: its first query on each kept connection is health-checked first, as a
    request's is (CONN_HEALTH_CHECKS on); what we record after it is not (``begin_task``)."""
    _set_checked(False)
    try:
        yield
    finally:
        _set_checked(True)


def _move_on(moved: arrivals.Buckets, start: int, deadline: datetime | None, pad: timedelta) -> timedelta | None:
    """Move a late held request's buckets on (``ledger.move_on``) from inside its handler, as our
    own statement: without the health check a handler's first query gets (``_checked``)."""
    _set_checked(True)
    try:
        return ledger.move_on(moved, start, deadline, pad, using=CallQueue.objects.db)
    finally:
        _set_checked(False)


def _move_on_aside(moved: arrivals.Buckets, start: int, deadline: datetime | None, pad: timedelta) -> timedelta | None:
    """``_move_on``, or inside the handler's own transaction (where the move would be seen only
    once the handler commits), on the process's delay writer's connection, waiting for it."""
    if connections[CallQueue.objects.db].in_atomic_block:
        return delaywriter.move_on(moved, start, deadline, pad, db=CallQueue.objects.db)
    return _move_on(moved, start, deadline, pad)


def _tellers() -> tuple[arrivals.MoveOn, arrivals.Remember | None]:
    """How the request of a call just started moves its held buckets on and tells its keys as it
    goes out: on the process's delay writer's connection where its own cannot (``_move_on_aside``,
    ``delaywriter.remember_ahead``), unless its start is not committed yet (inside a caller's
    transaction, the writer would wait for the start's locks until that commits): its keys then
    learn after its answer, on its own connection, and its held buckets move on there or not at all."""
    db = CallQueue.objects.db
    if connections[db].in_atomic_block:
        return _move_on, None
    return _move_on_aside, partial(delaywriter.remember_ahead, db=db)


def _call_handler(call: Any) -> Outcome:
    """Run a started call's handler; return what it did (never raises an Exception)."""
    try:
        fn = get_handler(call.method).fn
        with running(call), _checked():  # what the handler reports (cost, send, the API's signals) applies to
            arrivals.mark_invoked(fn)
            result = fn(**call.params)
    except RateLimited as exc:
        return Outcome(AttemptOutcome.RATE_LIMITED, error=exc)
    except arrivals.SendMissed as exc:
        return Outcome(AttemptOutcome.MISSED, error=exc)
    except (PermanentError, UnknownMethod) as exc:
        return Outcome(AttemptOutcome.FAILED, error=exc, traceback=traceback.format_exc())
    except Exception as exc:
        return Outcome(AttemptOutcome.ERROR, error=exc, traceback=traceback.format_exc())
    except BaseException as exc:  # SystemExit (exit()), KeyboardInterrupt: this call failed, the worker lives on
        return Outcome(AttemptOutcome.FAILED, error=exc, traceback=traceback.format_exc())
    return Outcome(AttemptOutcome.DONE, result=_jsonable(result))


def _class_path(exc: BaseException | None) -> str:
    """Return the dotted path of an exception's class, bare for a builtin (``ValueError``)."""
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _record_outcome(call: Any, attempt: Any, capped: bool, outcome: Outcome) -> str:
    """Record what a started call's handler did; return the run's state."""
    exc = outcome.error
    if outcome.kind == AttemptOutcome.MISSED:
        _record(CallQueue.objects.finish_missed, call, attempt, f"SendMissed: {exc}")
        log.info("run_missed call=%s reason=%s", call.id, exc)
        return str(AttemptOutcome.MISSED)
    if outcome.kind == AttemptOutcome.RATE_LIMITED:
        assert isinstance(exc, RateLimited)
        # A handler's retry_after may be anything (1e20, NaN): bounded, so the record cannot overflow.
        retry_after = bounded_seconds(exc.retry_after)
        _record(CallQueue.objects.finish_rate_limited, call, attempt, retry_after, exc.key, f"RateLimited: {exc}")
        log.info("run_rate_limited call=%s retry_after=%s key=%s", call.id, exc.retry_after, exc.key)
        return str(AttemptOutcome.RATE_LIMITED)
    if outcome.kind in (AttemptOutcome.FAILED, AttemptOutcome.ERROR):
        _record(
            CallQueue.objects.finish_error, call, attempt, f"{_class_path(exc)}: {exc}", outcome.traceback,
            permanent=outcome.kind == AttemptOutcome.FAILED, wake=capped,
        )
        # The kind of network failure, for the operator (the call's error names it for listed endpoints only).
        cause = network_cause(exc)
        because = f" cause={cause.replace(' ', '_')}" if cause else ""
        if outcome.kind == AttemptOutcome.FAILED:
            log.info("run_failed call=%s error=%r%s", call.id, exc, because)
        else:
            log.info("run_error call=%s attempt=%s error=%r%s", call.id, attempt.number, exc, because)
        return str(outcome.kind)
    _record(CallQueue.objects.finish_done, call, attempt, outcome.result, wake=capped)
    log.debug("run_done call=%s attempt=%s", call.id, attempt.number)
    return str(AttemptOutcome.DONE)


@dataclass
class Run:
    """A call of a message that started, with its attempt."""

    call: CallQueue
    attempt: Attempt
    capped: bool
    # What its start noted for the send-delay measurement (``arrivals.snapshot``), and what it
    # left the call's buckets (``Started.buckets``, ``Started.moved``).
    noted: Any = None
    buckets: dict[str, list[tuple[timedelta, int]]] | None = None
    moved: timedelta = timedelta(0)
    start: int = 0
    # How its request moves its held buckets on and tells its keys as it goes out (``_tellers``).
    tellers: tuple[arrivals.MoveOn, arrivals.Remember | None] = (_move_on, None)


# After a handler of a message returns, how long (seconds) the worker waits for the others
# before it records what has finished: handlers that return together (no-op ones, or requests
# answered at once) are recorded in one statement, and a slow call holds back no other's result
# by more than this.
GATHER = 0.005

# What a handler thread returns: the outcome, the cost it reported, its send measurement.
Ran = tuple[Outcome, Any, tuple[float | None, Any, arrivals.Sent | None]]


def execute_many(deliveries: list[tuple[int, int]]) -> dict[str, int]:
    """Run the deliveries of one message: start them together once the process's handler threads
    can soon take them (in parts, as threads come free, behind slow handlers), run their handlers
    at once (the process's pool of handler threads), record each outcome as its handler returns
    (the successes that return together in one statement); return the count of each outcome."""
    outcomes: dict[str, int] = {}
    rest = list(deliveries)
    futures: dict[Future[Ran], Run] = {}
    waiting: set[Future[Ran]] = set()
    failed: Exception | None = None
    while rest or waiting:
        count = 0
        if rest:
            # The calls start once the process's threads can soon take them (``handlerpool``):
            # each start then counts from about when its request goes. With a part at work, the
            # message looks for room a moment at a time, recording what returned meanwhile.
            wait_for = handlerpool.RECHECK if waiting else handlerpool.ROOM_WAIT
            count = handlerpool.reserve(len(rest), wait_for, anyway=not waiting)
        if count:
            part, rest = rest[:count], rest[count:]
            handed = 0
            try:
                # A part's calls go to the pool at once (its threads take them in order): handed over a few
                # at a time, threads idled while started calls waited (slots busy 60-82%, 71-84% so).
                for runs in _start_group(part, outcomes):
                    started = handlerpool.hand_over(runs, _call_handler_in_pool)
                    futures.update(started)
                    waiting |= set(started)
                    handed += len(runs)
            except Exception as exc:  # the calls at work are recorded first; the rest stay dispatched
                if not waiting:
                    raise
                failed, rest = exc, []
            finally:
                handlerpool.give_back(len(part) - handed)
        if waiting:
            done, waiting = wait(waiting, timeout=0 if rest else None, return_when=FIRST_COMPLETED)
            if done and waiting:  # what returns within GATHER of the first is recorded with it
                more, waiting = wait(waiting, timeout=GATHER)
                done |= more
            if done:
                _record_ran([(run, future.result()) for future, run in futures.items() if future in done], outcomes)
    if failed is not None:
        raise failed
    return outcomes


def _start_group(deliveries: list[tuple[int, int]], outcomes: dict[str, int]) -> Iterator[list[Run]]:
    """Start a message's calls together; yield each try's started calls before the wait for those that
    came early (a send delay up to DISPATCH_AHEAD otherwise); count the others in ``outcomes``."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    # Calls claimed ahead of their slot wait for it (briefly, holding no lock), as one call does.
    ahead = dispatcher_settings.tuned("DISPATCH_AHEAD", DISPATCH_AHEAD)
    pending = list(deliveries)
    for tries in range(EARLY_TRIES + 1):
        may_wait = ahead if tries < EARLY_TRIES else timedelta(0)
        started = _record(CallQueue.objects.start_many, pending, worker=worker, may_wait=may_wait)
        # The group's start clock and what it noted: each handler thread measures its send from it.
        noted = arrivals.snapshot()
        early, runs = [], []
        for (call_id, dispatch_no), one in zip(pending, started, strict=True):
            if one.state == StartState.STARTED:
                assert one.call is not None and one.attempt is not None
                runs.append(Run(one.call, one.attempt, one.capped, noted, one.buckets, one.moved, one.start, _tellers()))
                log.debug("run_started call=%s method=%s attempt=%s", one.call.id, one.call.method, one.attempt.number)
            elif one.state == StartState.EARLY:
                early.append(((call_id, dispatch_no), one.wait))
            else:
                log.info("run_skipped call=%s dispatch=%s state=%s reason=%s", call_id, dispatch_no, one.state, one.reason)
                outcomes[one.state] = outcomes.get(one.state, 0) + 1
        yield runs
        if not early:
            break
        pending = [delivery for delivery, _ in early]
        time.sleep(min(delay for _, delay in early).total_seconds())


def _record_ran(ran: list[tuple[Run, Ran]], outcomes: dict[str, int]) -> None:
    """Record the outcomes of a message's calls whose handlers returned; count them in ``outcomes``."""
    # One call's (or the successes') failure to record must not strand the others: what could not
    # be recorded stays running until the rescue sweep returns it.
    finished = [(run, outcome) for run, (outcome, _, _) in ran if outcome.kind == AttemptOutcome.DONE]
    if finished:
        try:
            _record(
                CallQueue.objects.finish_done_many,
                [(run.call, run.attempt, outcome.result, run.capped) for run, outcome in finished],
            )
        except Exception:
            log.exception("run_calls_failed calls=%s", [run.call.id for run, _ in finished])
            outcomes["failed_to_record"] = outcomes.get("failed_to_record", 0) + len(finished)
        else:
            for run, _ in finished:
                log.debug("run_done call=%s attempt=%s", run.call.id, run.attempt.number)
            outcomes["done"] = outcomes.get("done", 0) + len(finished)
    for run, (outcome, reported, _) in ran:
        try:
            if outcome.kind != AttemptOutcome.DONE:
                state = _record_outcome(run.call, run.attempt, run.capped, outcome)
                outcomes[state] = outcomes.get(state, 0) + 1
            if reported is not None:
                deltas = _record(CallQueue.objects.correct_cost, run.call, reported.units, late=reported.late)
                log.info("run_cost_corrected call=%s change=%s", run.call.id, deltas)
        except Exception:
            log.exception("run_calls_failed call=%s", run.call.id)
            outcomes["failed_to_record"] = outcomes.get("failed_to_record", 0) + 1
    # Each handler thread measured its send; the delays are kept here, on this slot's connection,
    # after the outcomes as a call alone keeps its own: a handler thread that opened a
    # connection only to write its delay cost a new database session (one per 6 calls measured
    # at 8 per message). The calls share what their start noted: of their delays for the same
    # keys only the largest can change what the keys remember (a kept delay only grows within its
    # span), so only it is written (these writes were ~9% of a grouped -c 32 worker's GIL time).
    # A send later than its bucket's guard moves the bucket on for each call, as alone.
    largest: dict[tuple[int, tuple[str, ...]], tuple[int, tuple[float | None, Any, arrivals.Sent | None]]] = {}
    for run, (_, _, measured) in ran:
        clock_read, noted, sent = measured
        if sent is None:
            continue
        if arrivals.overdue(noted, sent):
            _keep_delay(run.call.id, *measured)
            continue
        keys = (id(run.noted), tuple(run.call.keys))  # the same start's reading, the same keys
        kept = largest.get(keys)
        largest[keys] = (run.call.id, (clock_read, noted, sent.most(kept[1][2] if kept else None)))
    for call_id, measured in largest.values():
        _keep_delay(call_id, *measured)
    _mark_answered(sorted({key for run, _ in ran for key in run.call.keys}))


def _call_handler_in_pool(run: Run) -> Ran:
    """Run a handler in a thread of the message's pool; return what it did, the cost it reported
    and its start-to-send measurement (the start's clock reading, what it noted, the delay), which
    ``execute_many`` keeps for the keys' arrival guard, as ``execute`` does for a call alone."""
    take_reported()
    arrivals.restore(run.noted)
    move_on, tell = run.tellers
    clock_read, noted = arrivals.begin(run.call.keys, run.buckets, run.moved, move_on, run.start, tell)
    try:
        outcome = _call_handler(run.call)
        return outcome, take_reported(), (clock_read, noted, arrivals.sent_after(clock_read))
    finally:
        # A handler that used the database did so on this thread's own connection.
        connections.close_all()
