"""Celery tasks: thin wrappers over the dispenser, the worker and the manager."""
from __future__ import annotations

import logging
import sys

from celery import shared_task
from django.db import connection

from dispatcher import liveness
from dispatcher.beat import DISPENSE, PRUNE, RESCUE
from dispatcher.conf import dispatcher_settings
from dispatcher.dispenser import RUN_CALL, RUN_CALLS, Dispenser
from dispatcher.models import CallQueue
from dispatcher.worker import begin_task, execute, execute_many

log = logging.getLogger("dispatcher")


def _release_greenlet_connection() -> None:
    """Close the task's database connection when the task runs in its own greenlet (gevent).

    Django keeps a connection per thread, which under gevent's patched ``threading`` means per
    greenlet, and Celery's gevent pool runs every task in a new one: left open, each task's
    connection would linger until garbage collection, far more of them than the pool's size.
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        connection.close()


# What a delivery did, in the words Celery's "Task ... succeeded: '...'" line shows: the task ran to
# its end even when the call it ran failed, so the line says what happened to the call.
DELIVERY_OUTCOMES = {
    "done": "done",
    "error": "raised an error (retried while attempts remain, else failed)",
    "failed": "failed (a permanent error)",
    "rate_limited": "rate limited (waits again, its keys paused)",
    "stale": "skipped (a stale or duplicate delivery)",
    "deferred": "sent back to wait (its keys had no room)",
}


def describe_delivery(call_id: int, outcome: str) -> str:
    """Say what one delivery did to its call: "call 12 failed (a permanent error)"."""
    return f"call {call_id} {DELIVERY_OUTCOMES.get(outcome, outcome)}"


@shared_task(name=RUN_CALL, ignore_result=True)
def run_call(call_id: int, dispatch_no: int) -> str:
    """Run one delivery of a call (a stale or duplicate delivery does nothing); say what it did."""
    # Workers keep their connection across tasks (CELERY_DB_REUSE_MAX); drop it here if it
    # failed or outlived CONN_MAX_AGE, as Django does at the start of a request.
    begin_task()
    try:
        return describe_delivery(call_id, execute(call_id, dispatch_no))
    finally:
        _release_greenlet_connection()


@shared_task(name=RUN_CALLS, ignore_result=True)
def run_calls(deliveries: list[list[int]]) -> dict[str, int]:
    """Run several deliveries (DISPATCHER_CALLS_PER_MESSAGE > 1): started together, their
    handlers run at once, each outcome recorded as its handler returns (see ``worker.execute_many``)."""
    begin_task()
    try:
        return execute_many([(int(call_id), int(dispatch_no)) for call_id, dispatch_no in deliveries])
    finally:
        _release_greenlet_connection()


@shared_task(name=DISPENSE, ignore_result=True)
def dispense(max_passes: int = 20) -> int:
    """Run dispense passes while each fills its batch (bounded); return calls moved."""
    # One row per machine: whichever pool process runs beat's task. Its own kind: beside a
    # `dispense --loop` it is not a second dispenser, and alone it still says dispensing runs.
    liveness.beat(liveness.BEAT_TASK, liveness.process_name(liveness.BEAT_TASK, "dispense", pid=False))
    dispenser = Dispenser()
    moved = 0
    for _ in range(max_passes):
        report = dispenser.run_once()
        moved += report.moved
        if not report.full:
            break
    return moved


@shared_task(name=RESCUE, ignore_result=True)
def rescue() -> int:
    """Return calls stuck in dispatched or running past their timeout to waiting."""
    report = CallQueue.objects.rescue()
    if report.ids:
        log.warning(
            "rescued dispatched=%s running=%s failed=%s ids=%s",
            report.dispatched, report.running, report.failed, report.ids[:20],
        )
    return len(report.ids)


@shared_task(name=PRUNE, ignore_result=True)
def prune() -> int:
    """Delete finished calls older than DISPATCHER_RETENTION."""
    deleted = CallQueue.objects.prune(dispatcher_settings.RETENTION)
    log.info("pruned calls=%s", deleted)
    return deleted
