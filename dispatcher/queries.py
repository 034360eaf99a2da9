"""Every change of a call's state: the one place that locks call rows or writes ``status``."""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connection, connections, models, transaction
from django.db.models import F, Q

from dispatcher import limiter
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidCall, InvalidParams
from dispatcher.keys import key_set, parse_key_set, resolve_keys
from dispatcher.registry import get_handler
from dispatcher.retry import RetryPolicy

if TYPE_CHECKING:
    from dispatcher.models import Attempt, CallQueue

log = logging.getLogger("dispatcher")

PENDING, DISPATCHED, RUNNING = "pending", "dispatched", "running"
DONE, FAILED, CANCELLED = "done", "failed", "cancelled"
INT32_MAX = 2**31 - 1
MAX_ERROR_CHARS = 10_000

SEND_ARGUMENTS = {"method", "params", "keys", "priority", "run_at", "max_attempts", "queue"}


@dataclass(frozen=True)
class Claimed:
    """A call a dispenser has claimed and must now publish."""

    id: int
    dispatch_no: int
    queue: str
    key_set: str


@dataclass
class ClaimResult:
    calls: list[Claimed]
    verdict: limiter.Verdict


@dataclass
class Started:
    """The outcome of a worker's attempt to start a call."""

    state: str  # "started", "stale" or "deferred"
    call: CallQueue | None = None
    attempt: Attempt | None = None
    reason: str = ""


@dataclass
class RescueReport:
    dispatched: int = 0
    running: int = 0
    failed: int = 0
    ids: list[int] = field(default_factory=list)


def _clean_params(params: Any, limit: int) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidParams(f"params must be a JSON object (a dict), not {type(params).__name__}")
    try:
        text = json.dumps(params, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        raise InvalidParams("params are nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise InvalidParams(f"params must be JSON-serialisable: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidParams("params contain text that is not valid Unicode") from None
    if "\\u0000" in text:
        raise InvalidParams("params cannot contain NUL characters")
    if size > limit:
        raise InvalidParams(f"params are {size} bytes as JSON; the limit is {limit} (DISPATCHER_MAX_PARAMS_BYTES)")
    # Store what JSON would give back, so the handler sees the same params on every attempt.
    return json.loads(text)


def _int_argument(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCall(f"{name} must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise InvalidCall(f"{name} must be between {low} and {high}, not {value}")
    return value


def _clean_queue(queue: Any) -> str:
    if not isinstance(queue, str) or len(queue) > 100 or any(c.isspace() for c in queue):
        raise InvalidCall(f"queue must be a Celery queue name (no spaces, at most 100 characters): {queue!r}")
    return queue


class CallQueueQuerySet(models.QuerySet):
    """Calls filtered by state."""

    def pending(self) -> CallQueueQuerySet:
        return self.filter(status=PENDING)

    def in_flight(self) -> CallQueueQuerySet:
        return self.filter(status__in=[DISPATCHED, RUNNING])

    def finished(self) -> CallQueueQuerySet:
        return self.filter(status__in=[DONE, FAILED, CANCELLED])

    def waiting_retry(self) -> CallQueueQuerySet:
        return self.filter(status=PENDING, attempts__gt=0)

    def due(self, now: datetime) -> CallQueueQuerySet:
        return self.filter(status=PENDING, run_at__lte=now)


class CallQueueManager(models.Manager.from_queryset(CallQueueQuerySet)):  # type: ignore[misc]
    """Enqueue, claim, start, finish, rescue and cancel calls."""

    # --- enqueue -------------------------------------------------------------------------

    def build(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        keys: Iterable[str] | None = None,
        priority: int = 0,
        run_at: datetime | None = None,
        max_attempts: int | None = None,
        queue: str | None = None,
    ) -> CallQueue:
        """Validate a call and return it unsaved; raise an InvalidCall (a ValueError) if bad."""
        handler = get_handler(method)
        clean = _clean_params(params, dispatcher_settings.MAX_PARAMS_BYTES)
        handler.validate(clean)
        call_keys = resolve_keys(handler.keys, keys, clean)
        _int_argument("priority", priority, -INT32_MAX, INT32_MAX)
        if max_attempts is None:
            max_attempts = handler.max_attempts or dispatcher_settings.MAX_ATTEMPTS
        _int_argument("max_attempts", max_attempts, 1, 1000)
        if queue is None:
            queue = handler.queue or dispatcher_settings.QUEUE
        fields: dict[str, Any] = {
            "method": method,
            "params": clean,
            "keys": call_keys,
            "key_set": key_set(call_keys),
            "priority": priority,
            "max_attempts": max_attempts,
            "queue": _clean_queue(queue),
            "status": PENDING,
        }
        if run_at is not None:
            if not isinstance(run_at, datetime):
                raise InvalidCall(f"run_at must be a datetime, not {type(run_at).__name__}")
            if run_at.tzinfo is None or run_at.utcoffset() is None:
                raise InvalidCall("run_at must carry a timezone (a naive datetime is ambiguous)")
            fields["run_at"] = run_at
        return self.model(**fields)

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
    ) -> CallQueue:
        """Store one call in the caller's transaction and return the saved row."""
        call = self.build(
            method, params, keys=keys, priority=priority, run_at=run_at, max_attempts=max_attempts, queue=queue
        )
        call.save(force_insert=True, using=self.db)
        return call

    def send_many(self, calls: Iterable[Mapping[str, Any]]) -> list[CallQueue]:
        """Store many calls (each a dict of send()'s arguments) in one statement; all or none."""
        built = []
        for index, spec in enumerate(calls):
            if not isinstance(spec, Mapping):
                raise InvalidCall(f"call {index}: each call must be a dict of send() arguments")
            unknown = set(spec) - SEND_ARGUMENTS
            if unknown:
                raise InvalidCall(f"call {index}: unknown argument(s) {', '.join(sorted(unknown))}")
            if "method" not in spec:
                raise InvalidCall(f"call {index}: 'method' is required")
            try:
                built.append(self.build(**spec))
            except InvalidCall as exc:
                raise type(exc)(f"call {index}: {exc}") from exc
        if not built:
            return []
        return self.bulk_create(built)

    # --- dispense ------------------------------------------------------------------------

    def waiting_key_sets(self, after: str | None = None, limit: int = 10_000) -> list[str]:
        """Return the distinct key sets of waiting calls, in order, one index probe each."""
        table = self.model._meta.db_table
        # A loose index scan: each step asks the partial index for the next key set.
        sql = f"""
            WITH RECURSIVE ks(k) AS (
                SELECT MIN(key_set) FROM {table} WHERE status = 'pending' AND key_set > %s
                UNION ALL
                SELECT (SELECT MIN(key_set) FROM {table} WHERE status = 'pending' AND key_set > ks.k)
                FROM ks WHERE ks.k IS NOT NULL
            )
            SELECT k FROM ks WHERE k IS NOT NULL LIMIT %s
        """
        with connection.cursor() as cursor:
            cursor.execute(sql, [after if after is not None else "", limit])
            return [row[0] for row in cursor.fetchall()]

    def claim(self, key_set_text: str, limit: int, policies: limiter.Policies) -> ClaimResult:
        """Claim up to ``limit`` due calls of one key set, as many as its keys have room for."""
        keys = parse_key_set(key_set_text)
        # Kept short: it holds the key locks every dispenser and worker of these keys waits on.
        with transaction.atomic(using=self.db):
            states = limiter.lock_keys(keys)
            now = db_now()
            verdict = limiter.check_keys(keys, states, now, policies, for_start=False)
            wanted = min(limit, verdict.room)
            if wanted <= 0:
                return ClaimResult([], verdict)
            if connections[self.db].vendor == "postgresql":
                rows = self._claim_rows_returning(key_set_text, now, wanted)
            else:
                rows = list(
                    self.filter(status=PENDING, key_set=key_set_text, run_at__lte=now)
                    .order_by("-priority", "id")
                    .select_for_update(skip_locked=True)
                    .values_list("id", "dispatch_no", "queue")[:wanted]
                )
                if rows:
                    self.filter(id__in=[r[0] for r in rows]).update(
                        status=DISPATCHED, dispatched_at=now, dispatch_no=F("dispatch_no") + 1
                    )
                rows = [(i, n + 1, q) for i, n, q in rows]
            if rows:
                limiter.adjust(keys, reserved=len(rows))
        claimed = [Claimed(id=i, dispatch_no=n, queue=q, key_set=key_set_text) for i, n, q in rows]
        return ClaimResult(claimed, verdict)

    def _claim_rows_returning(self, key_set_text: str, now: datetime, wanted: int) -> list[tuple[int, int, str]]:
        """Select and mark due calls dispatched in one statement; return (id, new dispatch_no, queue)."""
        table = self.model._meta.db_table
        sql = f"""
            UPDATE {table} SET status = %s, dispatched_at = %s, dispatch_no = dispatch_no + 1
            WHERE id IN (
                SELECT id FROM {table}
                WHERE status = %s AND key_set = %s AND run_at <= %s
                ORDER BY priority DESC, id
                LIMIT %s
                FOR UPDATE SKIP LOCKED
            )
            RETURNING id, dispatch_no, queue, priority
        """
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql, [DISPATCHED, now, PENDING, key_set_text, now, wanted])
            found = cursor.fetchall()
        # RETURNING keeps no order: publish the most urgent first, as the scan chose them.
        found.sort(key=lambda row: (-row[3], row[0]))
        return [(i, n, q) for i, n, q, _ in found]

    def put_back(self, calls: Iterable[Claimed]) -> int:
        """Return claimed calls whose publish failed to waiting at once."""
        by_set: dict[str, list[Claimed]] = {}
        for call in calls:
            by_set.setdefault(call.key_set, []).append(call)
        returned = 0
        for text, group in by_set.items():
            keys = parse_key_set(text)
            with transaction.atomic(using=self.db):
                limiter.lock_keys(keys)
                won = 0
                for call in group:
                    won += self.filter(id=call.id, status=DISPATCHED, dispatch_no=call.dispatch_no).update(
                        status=PENDING, dispatched_at=None
                    )
                limiter.adjust(keys, reserved=-won)
                returned += won
        return returned

    def next_due_at(self, now: datetime) -> datetime | None:
        """Return when the earliest call that is not yet due becomes due."""
        return self.filter(status=PENDING, run_at__gt=now).order_by("run_at").values_list("run_at", flat=True).first()

    # --- worker --------------------------------------------------------------------------

    def start(self, call_id: int, dispatch_no: int, worker: str = "") -> Started:
        """Move a dispatched call to running if its keys still have room; count the attempt."""
        from dispatcher.models import Attempt

        head = self.filter(id=call_id).values_list("key_set", "status", "dispatch_no").first()
        if head is None:
            return Started("stale", reason="no such call")
        if head[1] != DISPATCHED or head[2] != dispatch_no:
            return Started("stale", reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}")
        keys = parse_key_set(head[0])
        with transaction.atomic(using=self.db):
            states = limiter.lock_keys(keys)
            # Read after the lock wait, so a policy edit committed meanwhile binds this start.
            policies = limiter.Policies.load()
            call = self.select_for_update().filter(id=call_id).first()
            if call is None or call.status != DISPATCHED or call.dispatch_no != dispatch_no:
                return Started("stale", reason="claimed by another delivery")
            now = db_now()
            # Re-checked at the start itself: a message may have waited in the broker while the
            # window filled, a policy tightened or a pause began.
            verdict = limiter.check_keys(keys, states, now, policies, for_start=True)
            if verdict.blocked:
                until = verdict.until or now + timedelta(seconds=1)
                self.filter(id=call_id).update(status=PENDING, dispatched_at=None, run_at=until)
                limiter.adjust(keys, reserved=-1)
                return Started("deferred", reason=f"{verdict.key}: {verdict.reason}")
            limiter.record_starts(keys, now)
            number = call.attempts + call.deferrals + 1
            attempt = Attempt.objects.create(call=call, number=number, started_at=now, worker=worker[:200])
            call.status, call.started_at, call.attempts = RUNNING, now, call.attempts + 1
            self.filter(id=call_id).update(status=RUNNING, started_at=now, attempts=F("attempts") + 1)
            limiter.adjust(keys, reserved=-1, running=1)
        return Started("started", call=call, attempt=attempt)

    def _finish(self, call: CallQueue, attempt: Attempt, outcome: str, error: str, **changes: Any) -> bool:
        from dispatcher.models import Attempt

        keys = parse_key_set(call.key_set)
        with transaction.atomic(using=self.db):
            limiter.lock_keys(keys)
            now = db_now()
            changes = {k: (v(now) if callable(v) else v) for k, v in changes.items()}
            won = self.filter(id=call.id, status=RUNNING, dispatch_no=call.dispatch_no).update(**changes)
            if not won:
                # Rescued while it ran (the run took longer than DISPATCHER_RUN_TIMEOUT).
                log.warning("finish_lost call=%s attempt=%s outcome=%s", call.id, attempt.number, outcome)
                return False
            Attempt.objects.filter(id=attempt.id).update(finished_at=now, outcome=outcome, error=error[:MAX_ERROR_CHARS])
            limiter.adjust(keys, running=-1)
            limiter.wake_dispensers()
        return True

    def finish_done(self, call: CallQueue, attempt: Attempt, result: Any) -> bool:
        """Record a successful attempt and its result."""
        return self._finish(
            call, attempt, "done", "", status=DONE, result=result, finished_at=lambda now: now, last_error=""
        )

    def finish_error(self, call: CallQueue, attempt: Attempt, error: str, tb: str, *, permanent: bool) -> bool:
        """Record a failed attempt: retry with backoff while attempts remain, else fail."""
        error = error[:MAX_ERROR_CHARS]
        if permanent or call.attempts >= call.max_attempts:
            return self._finish(
                call, attempt, "failed" if permanent else "error", error,
                status=FAILED, finished_at=lambda now: now, last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
            )
        delay = RetryPolicy.from_settings().delay(call.attempts)
        return self._finish(
            call, attempt, "error", error,
            status=PENDING, run_at=lambda now: now + delay, dispatched_at=None,
            last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
        )

    def finish_rate_limited(
        self, call: CallQueue, attempt: Attempt, retry_after: float | None, key: str | None, error: str
    ) -> bool:
        """Record a 429: pause the key, put the call back to wait, refund the attempt."""
        from dispatcher.models import Attempt

        wait = timedelta(seconds=retry_after) if retry_after is not None else dispatcher_settings.DEFAULT_RETRY_AFTER
        wait = max(wait, timedelta(0))
        keys = parse_key_set(call.key_set)
        paused = [key] if key else keys
        max_deferrals = dispatcher_settings.MAX_DEFERRALS
        gives_up = max_deferrals is not None and call.deferrals + 1 > max_deferrals
        with transaction.atomic(using=self.db):
            limiter.lock_keys(sorted(set(keys) | set(paused)))
            now = db_now()
            until = now + wait
            fields: dict[str, Any] = {"deferrals": F("deferrals") + 1, "attempts": F("attempts") - 1, "last_error": error}
            if gives_up:
                fields.update(status=FAILED, finished_at=now, last_error=f"{error} (gave up after {call.deferrals + 1} deferrals)")
            else:
                fields.update(status=PENDING, run_at=until, dispatched_at=None)
            won = self.filter(id=call.id, status=RUNNING, dispatch_no=call.dispatch_no).update(**fields)
            if not won:
                log.warning("finish_lost call=%s attempt=%s outcome=rate_limited", call.id, attempt.number)
                return False
            Attempt.objects.filter(id=attempt.id).update(finished_at=now, outcome="rate_limited", error=error[:MAX_ERROR_CHARS])
            limiter.pause(paused, until, reason=f"429 from call #{call.id}")
            limiter.adjust(keys, running=-1)
        return True

    # --- rescue --------------------------------------------------------------------------

    def rescue(self, batch: int | None = None) -> RescueReport:
        """Return calls stuck in dispatched or running past their timeout to waiting."""
        from dispatcher.models import Attempt

        batch = batch or dispatcher_settings.RESCUE_BATCH
        report = RescueReport()
        now = db_now()
        dispatch_cutoff = now - dispatcher_settings.DISPATCH_TIMEOUT
        run_cutoff = now - dispatcher_settings.RUN_TIMEOUT
        stuck = list(
            self.filter(
                Q(status=DISPATCHED, dispatched_at__lt=dispatch_cutoff) | Q(status=RUNNING, started_at__lt=run_cutoff)
            )
            .order_by("id")
            .values_list("id", "key_set")[:batch]
        )
        policy = RetryPolicy.from_settings()
        for call_id, text in stuck:
            keys = parse_key_set(text)
            with transaction.atomic(using=self.db):
                limiter.lock_keys(keys)
                call = self.select_for_update().filter(id=call_id).first()
                if call is None:
                    continue
                now = db_now()
                if call.status == DISPATCHED and call.dispatched_at and call.dispatched_at < dispatch_cutoff:
                    # Claimed but never started: the message was lost; no attempt was spent.
                    self.filter(id=call_id).update(status=PENDING, dispatched_at=None)
                    limiter.adjust(keys, reserved=-1)
                    report.dispatched += 1
                elif call.status == RUNNING and call.started_at and call.started_at < run_cutoff:
                    # Started but never finished: the worker died; the attempt counts.
                    error = f"lost: no result within DISPATCHER_RUN_TIMEOUT ({dispatcher_settings.RUN_TIMEOUT})"
                    Attempt.objects.filter(call_id=call_id, outcome="running").update(
                        outcome="lost", finished_at=now, error=error
                    )
                    if call.attempts >= call.max_attempts:
                        self.filter(id=call_id).update(status=FAILED, finished_at=now, last_error=error)
                        report.failed += 1
                    else:
                        self.filter(id=call_id).update(
                            status=PENDING, dispatched_at=None, run_at=now + policy.delay(call.attempts), last_error=error
                        )
                    limiter.adjust(keys, running=-1)
                    report.running += 1
                else:
                    continue
                report.ids.append(call_id)
                limiter.wake_dispensers()
        return report

    # --- retention ------------------------------------------------------------------------

    def prune(
        self,
        older_than: timedelta,
        *,
        batch: int | None = None,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Delete finished calls (and their attempts) older than ``older_than``, a short transaction per batch.

        Only done, failed and cancelled calls are touched, and none that finished within the
        longest policy period, so the attempt history behind a limiter window stays; the
        window log itself (KeyStart) is trimmed by ``limiter.prune_starts``, which keeps what
        a window needs. ``progress(done, total)`` is called after every batch. With
        ``dry_run`` nothing is deleted and the number that would be is returned.
        """
        from dispatcher.models import Attempt, RateLimit

        batch = batch or dispatcher_settings.PRUNE_BATCH
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        if older_than < timedelta(0):
            raise ValueError("older_than cannot be negative")
        longest = max([timedelta(0), *RateLimit.objects.values_list("period", flat=True)])
        cutoff = db_now() - max(older_than, longest)
        old = self.finished().filter(finished_at__lt=cutoff)
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
            with transaction.atomic(using=self.db):
                # Locking the batch's rows keeps a concurrent retry_now off them; rows locked
                # elsewhere are skipped, never waited for.
                ids = list(
                    old.filter(id__gt=last_id).order_by("id").select_for_update(skip_locked=True)
                    .values_list("id", flat=True)[:batch]
                )
                if not ids:
                    break
                last_id = ids[-1]
                Attempt.objects.filter(call_id__in=ids)._raw_delete(self.db)
                deleted += self.filter(id__in=ids).finished().filter(finished_at__lt=cutoff)._raw_delete(self.db)
            if progress is not None:
                progress(deleted, total)
        limiter.prune_starts()
        return deleted

    # --- operator actions ----------------------------------------------------------------

    def retry_now(self, ids: Iterable[int]) -> int:
        """Make waiting calls due now and give failed calls one more attempt; return how many."""
        ids = list(ids)
        with transaction.atomic(using=self.db):
            now = db_now()
            waiting = self.filter(id__in=ids, status=PENDING).update(run_at=now)
            failed = self.filter(id__in=ids, status=FAILED).update(
                status=PENDING, run_at=now, finished_at=None,
                max_attempts=models.Case(
                    models.When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                    default=F("max_attempts"),
                    output_field=models.PositiveIntegerField(),
                ),
            )
            limiter.wake_dispensers()
        return waiting + failed

    def cancel(self, ids: Iterable[int]) -> int:
        """Cancel waiting calls; calls in flight or finished are left alone."""
        with transaction.atomic(using=self.db):
            now = db_now()
            return self.filter(id__in=list(ids), status=PENDING).update(status=CANCELLED, finished_at=now)
