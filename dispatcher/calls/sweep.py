"""Sweep: rescue stuck calls, prune finished ones, and the operator's retry now and cancel."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db import models, transaction
from django.db.models import F, Q

from dispatcher import tables
from dispatcher.calls import shares
from dispatcher.calls.rows import attempts, fail_unreadable
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidKey
from dispatcher.keys import read_key_set
from dispatcher.limits import ledger, locks
from dispatcher.retry import RetryPolicy
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager

log = logging.getLogger("dispatcher")

# Calls one rescue transaction returns: a sweep after an outage moves thousands in short transactions.
RESCUE_BATCH = 200
# Rows one prune transaction deletes (prune_calls --batch overrides): short enough never to hold
# the table for long, large enough that a day's calls go in a few hundred transactions.
PRUNE_BATCH = 1000


@dataclass
class RescueReport:
    dispatched: int = 0
    running: int = 0
    failed: int = 0
    ids: list[int] = field(default_factory=list)


def rescue(manager: CallQueueManager, batch: int | None = None) -> RescueReport:
    """Return calls stuck in dispatched or running past their timeout to waiting."""
    batch = batch or dispatcher_settings.tuned("RESCUE_BATCH", RESCUE_BATCH)
    report = RescueReport()
    now = db_now(manager.db)
    dispatch_cutoff = now - dispatcher_settings.DISPATCH_TIMEOUT
    run_cutoff = now - dispatcher_settings.RUN_TIMEOUT
    stuck = list(
        manager.filter(
            Q(status=Status.DISPATCHED, dispatched_at__lt=dispatch_cutoff) | Q(status=Status.RUNNING, started_at__lt=run_cutoff)
        )
        .order_by("id")
        .values_list("id", "key_set")[:batch]
    )
    policy = RetryPolicy.from_settings()
    for call_id, text in stuck:
        # One bad row must not leave the others stuck: it is failed (unreadable) or skipped.
        try:
            keys = read_key_set(text)
        except InvalidKey as exc:
            if fail_unreadable(manager, manager.filter(id=call_id, status__in=[Status.DISPATCHED, Status.RUNNING]), str(exc)):
                report.failed += 1
                report.ids.append(call_id)
            continue
        try:
            outcome = _rescue_one(manager, call_id, keys, dispatch_cutoff, run_cutoff, policy)
        except Exception:
            log.exception("rescue_skipped id=%s", call_id)
            continue
        if outcome == Status.DISPATCHED:
            report.dispatched += 1
        elif outcome:
            # A lost run counts as rescued, and as failed too when it was the last attempt.
            report.running += 1
            report.failed += outcome == Status.FAILED
        if outcome:
            report.ids.append(call_id)
    return report


def _rescue_one(
    manager: CallQueueManager, call_id: int, keys: list[str], dispatch_cutoff: datetime, run_cutoff: datetime, policy: RetryPolicy
) -> str:
    """Return one stuck call to waiting (or fail it when out of attempts); say which it was, "" if neither."""
    with transaction.atomic(using=manager.db):
        locks.lock_keys(keys, using=manager.db)
        call = manager.select_for_update().filter(id=call_id).first()
        if call is None:
            return ""
        now = db_now(manager.db)
        if call.status == Status.DISPATCHED and call.dispatched_at and call.dispatched_at < dispatch_cutoff:
            # Claimed but never started: the message was lost; no attempt was spent.
            manager.filter(id=call_id).update(status=Status.PENDING, dispatched_at=None)
            ledger.adjust(keys, reserved=-1, units={key: call.cost_of(key) for key in keys}, using=manager.db)
            outcome = Status.DISPATCHED
        elif call.status == Status.RUNNING and call.started_at and call.started_at < run_cutoff:
            # Started but never finished: the worker died; the attempt counts.
            error = f"lost: no result within DISPATCHER_RUN_TIMEOUT ({dispatcher_settings.RUN_TIMEOUT})"
            attempts(manager).filter(call_id=call_id, outcome=Outcome.RUNNING).update(
                outcome=Outcome.LOST, finished_at=now, error=error
            )
            if call.attempts >= call.max_attempts:
                manager.filter(id=call_id).update(status=Status.FAILED, finished_at=now, last_error=error)
                outcome = Status.FAILED
            else:
                manager.filter(id=call_id).update(
                    status=Status.PENDING, dispatched_at=None, run_at=now + policy.delay(call.attempts), last_error=error
                )
                outcome = Status.RUNNING
        else:
            return ""
        locks.wake_dispensers(using=manager.db)
    return outcome


def prune(
    manager: CallQueueManager, older_than: timedelta,
    *,
    batch: int | None = None,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Delete finished calls (and their attempts) older than ``older_than``, a short transaction per batch.

    Only done, failed and cancelled calls are touched, none whose unique key ``unique_for`` still
    holds, and none that finished within the longest policy period, so the attempt history behind a limiter window stays; the
    window log itself (StartLog) is trimmed by ``ledger.prune_starts``, which keeps what
    a window needs. ``progress(done, total)`` is called after every batch. With
    ``dry_run`` nothing is deleted and the number that would be is returned.
    """
    batch = batch or dispatcher_settings.tuned("PRUNE_BATCH", PRUNE_BATCH)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, not {batch}")
    if older_than < timedelta(0):
        raise ValueError("older_than cannot be negative")
    longest = max([timedelta(0), *tables.RateLimit.objects.using(manager.db).values_list("period", flat=True)])
    now = db_now(manager.db)
    cutoff = now - max(older_than, longest)
    # A call still holding its unique key for unique_for (dispatcher.calls.once) stays until then.
    old = manager.finished().filter(finished_at__lt=cutoff).exclude(unique_until__gt=now)
    total = old.count()
    if dry_run or total == 0:
        if progress is not None:
            progress(0, total)
        return total
    deleted = 0
    last_id = 0
    while deleted < total:
        # One short transaction per batch: it locks only the rows it deletes, which no
        # dispenser or worker wants (they are finished), and commits before the next.
        with transaction.atomic(using=manager.db):
            # Locking the batch's rows keeps a concurrent retry_now off them; rows locked
            # elsewhere are skipped, never waited for.
            ids = list(
                old.filter(id__gt=last_id).order_by("id").select_for_update(skip_locked=True)
                .values_list("id", flat=True)[:batch]
            )
            if not ids:
                break
            last_id = ids[-1]
            attempts(manager).filter(call_id__in=ids)._raw_delete(manager.db)
            deleted += manager.filter(id__in=ids).finished().filter(finished_at__lt=cutoff)._raw_delete(manager.db)
        if progress is not None:
            progress(deleted, total)
    ledger.prune_starts(using=manager.db)
    shares.forget_stale(db_now(manager.db) - shares.STALE_AFTER, manager.db)
    return deleted


def retry_now(manager: CallQueueManager, ids: Iterable[int]) -> int:
    """Make waiting calls due now and give failed calls one more attempt; return how many."""
    ids = list(ids)
    with transaction.atomic(using=manager.db):
        now = db_now(manager.db)
        waiting = manager.filter(id__in=ids, status=Status.PENDING).update(run_at=now)
        failed = manager.filter(id__in=ids, status=Status.FAILED).update(
            status=Status.PENDING, run_at=now, finished_at=None,
            max_attempts=models.Case(
                models.When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                default=F("max_attempts"),
                output_field=models.PositiveIntegerField(),
            ),
        )
        locks.wake_dispensers(using=manager.db)
    return waiting + failed


def cancel(manager: CallQueueManager, ids: Iterable[int]) -> int:
    """Cancel waiting calls; calls in flight or finished are left alone."""
    with transaction.atomic(using=manager.db):
        now = db_now(manager.db)
        return manager.filter(id__in=list(ids), status=Status.PENDING).update(status=Status.CANCELLED, finished_at=now)
