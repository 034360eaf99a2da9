"""The worker side: start a dispatched call, run its handler outside any transaction, record it."""
from __future__ import annotations

import json
import logging
import os
import reprlib
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import InterfaceError, OperationalError, connection

from dispatcher import arrivals, limiter
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import take_reported
from dispatcher.exceptions import PermanentError, RateLimited, UnknownMethod
from dispatcher.learning import running_call
from dispatcher.registry import get_handler
from dispatcher.validation import bounded_seconds, check_json

log = logging.getLogger("dispatcher")

T = TypeVar("T")

# Waits for a slot a call was claimed ahead of, before the start defers it.
EARLY_TRIES = 3
# How much before its slot a worker that came early tries again: half the time a start waits
# for its slot holding the key locks (queries.HOLD_FOR_SLOT, 30 ms).
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
            connection.close()
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


def execute(call_id: int, dispatch_no: int) -> str:
    """Run one delivery of a call; return what happened (started calls end done, retry or failed)."""
    from dispatcher.models import CallQueue

    worker = f"{socket.gethostname()}:{os.getpid()}"
    # A dispenser may claim a call up to DISPATCHER_DISPATCH_AHEAD before its slot frees: wait
    # for the slot here (briefly, holding no lock) rather than send the call back to wait.
    ahead = dispatcher_settings.DISPATCH_AHEAD
    for _ in range(EARLY_TRIES):
        started = _record(CallQueue.objects.start, call_id, dispatch_no, worker=worker, may_wait=ahead)
        if started.state != "early":
            break
        # Wake a little before the slot: the next start then finds it within HOLD_FOR_SLOT and
        # waits for it holding the key locks, so it lands on the slot rather than a sleep's
        # overshoot and a start's round trips after it (measured: 8-76 ms, 20 ms typical).
        time.sleep(max(started.wait.total_seconds() - EARLY_WAKE, 0.0))
    else:
        started = _record(CallQueue.objects.start, call_id, dispatch_no, worker=worker)
    if started.state != "started":
        log.info("run_skipped call=%s dispatch=%s state=%s reason=%s", call_id, dispatch_no, started.state, started.reason)
        return started.state
    call, attempt = started.call, started.attempt
    assert call is not None and attempt is not None
    log.info("run_started call=%s method=%s attempt=%s", call.id, call.method, attempt.number)
    take_reported()  # a cost reported by an earlier call of this thread is not this call's
    clock_read, noted = arrivals.begin()
    try:
        return _run(call, attempt, started.capped)
    finally:
        _remember_delay(call.id, clock_read, noted)
        reported = take_reported()
        if reported is not None:
            deltas = _record(CallQueue.objects.correct_cost, call, reported)
            log.info("run_cost_corrected call=%s change=%s", call.id, deltas)


def _remember_delay(call_id: int, clock_read: float | None, noted: Any) -> None:
    """Keep the measured start-to-send delay for the keys' arrival guard; never fails the call."""
    delay = arrivals.sent_after(clock_read)
    if delay is None:
        return
    overdue = arrivals.overdue(noted, delay)
    spans = arrivals.to_write(clock_read, noted, delay)
    if not spans and not overdue:
        return
    try:
        if overdue:
            limiter.push_buckets(overdue)
            log.info("send_late call=%s buckets=%s", call_id, {k: str(late) for k, (_, late) in overdue.items()})
        if limiter.remember_send_delay(spans, delay):
            log.info("send_delay call=%s delay_ms=%.1f", call_id, delay.total_seconds() * 1000)
    except (OperationalError, InterfaceError) as exc:
        log.warning("send_delay_not_kept call=%s error=%r", call_id, exc)
        connection.close()


def _run(call: Any, attempt: Any, capped: bool) -> str:
    """Run the handler of a started call and record its outcome."""
    from dispatcher.models import CallQueue

    try:
        fn = get_handler(call.method).fn
        with running_call(call.keys):  # the keys an API's rate-limit signals apply to
            arrivals.mark_invoked()
            result = fn(**call.params)
    except RateLimited as exc:
        # A handler's retry_after may be anything (1e20, NaN): bounded, so the record cannot overflow.
        retry_after = bounded_seconds(exc.retry_after)
        _record(CallQueue.objects.finish_rate_limited, call, attempt, retry_after, exc.key, f"RateLimited: {exc}")
        log.info("run_rate_limited call=%s retry_after=%s key=%s", call.id, exc.retry_after, exc.key)
        return "rate_limited"
    except (PermanentError, UnknownMethod) as exc:
        _record(
            CallQueue.objects.finish_error, call, attempt, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
            permanent=True, wake=capped,
        )
        log.info("run_failed call=%s error=%r", call.id, exc)
        return "failed"
    except Exception as exc:
        _record(
            CallQueue.objects.finish_error, call, attempt, f"{type(exc).__name__}: {exc}", traceback.format_exc(),
            permanent=False, wake=capped,
        )
        log.info("run_error call=%s attempt=%s error=%r", call.id, attempt.number, exc)
        return "error"
    _record(CallQueue.objects.finish_done, call, attempt, _jsonable(result), wake=capped)
    log.info("run_done call=%s attempt=%s", call.id, attempt.number)
    return "done"
