"""The door to the call table: ``CallQueue.objects``.

Each method names one operation and hands it to the module of its phase (``dispatcher.calls``
for calls), which holds the algorithm and its statements.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import models

from dispatcher.calls import dispense, finish, send, start, sweep
from dispatcher.calls.dispense import BatchClaim, Claimed
from dispatcher.calls.start import Started
from dispatcher.calls.sweep import RescueReport
from dispatcher.keys import key_in_set
from dispatcher.limits import catalog
from dispatcher.states import CallStatus as Status

if TYPE_CHECKING:
    from dispatcher.models import Attempt, CallQueue

__all__ = ["BatchClaim", "CallQueueManager", "CallQueueQuerySet", "Claimed", "RescueReport", "Started"]


class CallQueueQuerySet(models.QuerySet["CallQueue"]):
    """Calls filtered by state."""

    def pending(self) -> CallQueueQuerySet:
        """Return the calls waiting for a start, due or not."""
        return self.filter(status=Status.PENDING)

    def in_flight(self) -> CallQueueQuerySet:
        """Return the calls dispatched or running."""
        return self.filter(status__in=[Status.DISPATCHED, Status.RUNNING])

    def finished(self) -> CallQueueQuerySet:
        """Return the calls done, failed or cancelled."""
        return self.filter(status__in=[Status.DONE, Status.FAILED, Status.CANCELLED])

    def carrying(self, key: str) -> CallQueueQuerySet:
        """Return the calls that carry ``key`` among their keys (a key set is JSON text: the key quoted)."""
        return self.filter(key_set__contains=key_in_set(key))

    def due(self, now: datetime) -> CallQueueQuerySet:
        """Return the waiting calls whose ``run_at`` has come."""
        return self.filter(status=Status.PENDING, run_at__lte=now)


_CallQueueManagerBase = models.Manager.from_queryset(CallQueueQuerySet)


class CallQueueManager(_CallQueueManagerBase):  # type: ignore[type-arg]  # the stubs' generated manager class
    """Send, claim, start, finish, rescue, prune, retry and cancel calls (the one writer of ``status``)."""

    def send(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        keys: Iterable[str] | None = None,
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        queue: str | None = None,
        cost: int | Mapping[str, int] | None = None,
        unique_key: str | None = None,
        unique_for: timedelta | str | None = None,
        on_duplicate: str = "keep",
    ) -> CallQueue:
        """Store one call in the caller's transaction and return the saved row.

        ``keys``: the call's rate-limit keys (besides its handler's key templates); ``priority``:
        higher first (default 0); ``run_at``: not before then; ``max_attempts`` and ``queue``:
        the handler's, else DISPATCHER_MAX_ATTEMPTS and DISPATCHER_QUEUE; ``cost``: units charged
        to every key (an int), or {key: units} (keys not named cost 1); a cost one of the call's
        policies could never admit is refused (CostNeverFits). ``unique_key``: while a call with this
        key waits or is in flight (and for ``unique_for`` after it was sent, whatever its state), store
        nothing and return that call; ``on_duplicate="replace"`` gives a waiting one the new params and
        ``run_at``. The call returned has ``created``: True if stored, False if it held the key.
        """
        return send.send_one(
            self, method, params, keys=keys, priority=priority, run_at=run_at,
            max_attempts=max_attempts, queue=queue, cost=cost,
            unique_key=unique_key, unique_for=unique_for, on_duplicate=on_duplicate,
        )

    def send_many(self, calls: Iterable[Mapping[str, Any]]) -> list[CallQueue]:
        """Store many calls (each a dict of send()'s arguments) in one statement; all or none.

        With unique keys, one call is returned per input: a duplicate (of a held key, or of an earlier
        call in the batch) is the holder, with ``created`` False.
        """
        return send.send_many(self, calls)

    def waiting_key_sets(self, after: str | None = None, limit: int = 10_000) -> list[str]:
        """Return the distinct key sets of waiting calls, in order."""
        return dispense.waiting_key_sets(self, after, limit)

    def claim_batch(self, key_sets: Sequence[str], budget: int, policies: catalog.Policies) -> BatchClaim:
        """Claim up to ``budget`` due calls across key sets, as their keys have room, in one transaction."""
        return dispense.claim_batch(self, key_sets, budget, policies)

    def put_back(self, calls: Iterable[Claimed]) -> int:
        """Return claimed calls whose publish failed to waiting at once."""
        return dispense.put_back(self, calls)

    def next_due_at(self, now: datetime | None = None) -> datetime | None:
        """Return when the earliest call not yet due at ``now`` (the database's clock if None) becomes due."""
        return dispense.next_due_at(self, now)

    def at_workers(self, bound: int) -> int:
        """Count the calls dispatched and not yet started, up to ``bound``."""
        return dispense.at_workers(self, bound)

    def start(self, call_id: int, dispatch_no: int, worker: str = "", *, may_wait: timedelta = timedelta(0)) -> Started:
        """Move a dispatched call to running if its keys still have room; count the attempt."""
        return start.start(self, call_id, dispatch_no, worker, may_wait=may_wait)

    def start_many(
        self, deliveries: Sequence[tuple[int, int]], worker: str = "", *, may_wait: timedelta = timedelta(0)
    ) -> list[Started]:
        """Start the calls of one message together; return one ``Started`` per delivery, in order."""
        return start.start_many(self, deliveries, worker, may_wait=may_wait)

    def finish_done(self, call: CallQueue, attempt: Attempt, result: Any, *, wake: bool = True) -> bool:
        """Record a successful attempt and its result; say whether this delivery won."""
        return finish.finish_done(self, call, attempt, result, wake=wake)

    def finish_done_many(self, done: Sequence[tuple[CallQueue, Attempt, Any, bool]]) -> int:
        """Record successful attempts (call, attempt, result, wake) together; return how many were won."""
        return finish.finish_done_many(self, done)

    def finish_error(
        self, call: CallQueue, attempt: Attempt, error: str, tb: str, *, permanent: bool, wake: bool = True
    ) -> bool:
        """Record a failed attempt: retry with backoff while attempts remain, else fail."""
        return finish.finish_error(self, call, attempt, error, tb, permanent=permanent, wake=wake)

    def finish_rate_limited(
        self, call: CallQueue, attempt: Attempt, retry_after: float | None, key: str | None, error: str
    ) -> bool:
        """Record a 429: pause the key, put the call back to wait, refund the attempt."""
        return finish.finish_rate_limited(self, call, attempt, retry_after, key, error)

    def finish_missed(self, call: CallQueue, attempt: Attempt, error: str) -> bool:
        """Record a held request that was not sent: the call waits again, the attempt refunded."""
        return finish.finish_missed(self, call, attempt, error)

    def correct_cost(self, call: CallQueue, reported: int | Mapping[str, int], *, late: bool = False) -> dict[str, int]:
        """Correct the keys' usage to what a started call really cost; return the change per key
        (``late``: its request went out later than its start was counted under)."""
        return finish.correct_cost(self, call, reported, late=late)

    def rescue(self, batch: int | None = None) -> RescueReport:
        """Return calls stuck in dispatched or running past their timeout to waiting."""
        return sweep.rescue(self, batch)

    def prune(
        self,
        older_than: timedelta,
        *,
        batch: int | None = None,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Delete finished calls older than ``older_than`` in short batches; return how many."""
        return sweep.prune(self, older_than, batch=batch, dry_run=dry_run, progress=progress)

    def retry_now(self, ids: Iterable[int]) -> int:
        """Make waiting calls due now and give failed calls one more attempt; return how many."""
        return sweep.retry_now(self, ids)

    def cancel(self, ids: Iterable[int]) -> int:
        """Cancel waiting calls; calls in flight or finished are left alone."""
        return sweep.cancel(self, ids)
