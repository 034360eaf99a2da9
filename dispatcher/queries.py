"""Every change of a call's state: the one place that locks call rows or writes ``status``."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.db import connection, connections, models, transaction
from django.db.models import F, Q

from dispatcher import limiter
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import clean_cost
from dispatcher.exceptions import CostNeverFits, InvalidCall, InvalidCost, InvalidKey, InvalidParams
from dispatcher.inserts import NewCall, insert_many, insert_one
from dispatcher.keys import key_set, parse_key_set, read_key_set, resolve_keys
from dispatcher.registry import get_handler
from dispatcher.retry import RetryPolicy
from dispatcher.states import CallStatus as Status
from dispatcher.validation import OutOfBounds, check_json, check_moment

if TYPE_CHECKING:
    from dispatcher.models import Attempt, CallQueue

log = logging.getLogger("dispatcher")

# Plain strings (the values of CallQueue.Status): raw SQL parameters must not be enum members.
PENDING, DISPATCHED, RUNNING = Status.PENDING.value, Status.DISPATCHED.value, Status.RUNNING.value
DONE, FAILED, CANCELLED = Status.DONE.value, Status.FAILED.value, Status.CANCELLED.value
INT32_MAX = 2**31 - 1
MAX_ERROR_CHARS = 10_000
# How long a start may wait for its slot while holding its keys' locks (see start()).
HOLD_FOR_SLOT = timedelta(milliseconds=30)

SEND_ARGUMENTS = {"method", "params", "keys", "priority", "run_at", "max_attempts", "queue", "cost"}


@dataclass(frozen=True)
class Claimed:
    """A call a dispenser has claimed and must now publish."""

    id: int
    dispatch_no: int
    queue: str
    key_set: str
    priority: int = 0
    # Units per key when any differs from 1 (the call's ``cost``).
    cost: dict[str, int] | None = None

    def units(self, key: str) -> int:
        return (self.cost or {}).get(key, 1)


@dataclass
class ClaimResult:
    calls: list[Claimed]
    verdict: limiter.Verdict


@dataclass
class BatchClaim:
    """The calls a pass claimed, and each key set's room as the pass found it."""

    calls: list[Claimed]
    verdicts: dict[str, limiter.Verdict]


@dataclass
class Started:
    """The outcome of a worker's attempt to start a call."""

    state: str  # "started", "stale", "deferred" or "early"
    call: CallQueue | None = None
    attempt: Attempt | None = None
    reason: str = ""
    # Whether a key of the call has a concurrency cap, so its finish frees a slot to wake for.
    capped: bool = False
    # For an early delivery: how long until its keys have room.
    wait: timedelta = timedelta(0)


@dataclass
class RescueReport:
    dispatched: int = 0
    running: int = 0
    failed: int = 0
    ids: list[int] = field(default_factory=list)


# json.dumps builds a new encoder whenever it is given options; this one is built once.
_params_json = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def _clean_params(params: Any, limit: int) -> tuple[dict[str, Any], str]:
    """Return the params as JSON gives them back, and their JSON text; raise InvalidParams if bad."""
    if params is None:
        return {}, "{}"
    if not isinstance(params, dict):
        raise InvalidParams(f"params must be a JSON object (a dict), not {type(params).__name__}")
    # Depth, item count and NUL first, without recursion: encoding recurses, and PostgreSQL's
    # jsonb refuses a NUL (only a real one: the text backslash-u0000 is fine).
    try:
        check_json(params, what="params")
    except OutOfBounds as exc:
        raise InvalidParams(str(exc)) from None
    try:
        text = _params_json.encode(params)
    except RecursionError:
        raise InvalidParams("params are nested too deeply") from None
    except (TypeError, ValueError) as exc:
        raise InvalidParams(f"params must be JSON-serialisable: {exc}") from None
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidParams("params contain text that is not valid Unicode") from None
    if size > limit:
        raise InvalidParams(f"params are {size} bytes as JSON; the limit is {limit} (DISPATCHER_MAX_PARAMS_BYTES)")
    # Store what JSON would give back, so the handler sees the same params on every attempt.
    return json.loads(text), text


def _int_argument(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidCall(f"{name} must be a whole number, not {value!r}")
    if not low <= value <= high:
        raise InvalidCall(f"{name} must be between {low} and {high}, not {value}")
    return value


def _clean_queue(queue: Any) -> str:
    # isprintable() also refuses NUL, control characters and lone surrogates, which no column stores.
    if not isinstance(queue, str) or len(queue) > 100 or any(c.isspace() for c in queue) or not queue.isprintable():
        raise InvalidCall(f"queue must be a Celery queue name (no spaces, at most 100 characters): {queue!r}")
    return queue


class _SendSettings:
    """The settings send() reads, each read at most once and only when a call needs it."""

    @cached_property
    def max_params_bytes(self) -> int:
        return dispatcher_settings.MAX_PARAMS_BYTES

    @cached_property
    def max_attempts(self) -> int:
        return dispatcher_settings.MAX_ATTEMPTS

    @cached_property
    def queue(self) -> str:
        return dispatcher_settings.QUEUE

    @cached_property
    def policies(self) -> limiter.Policies:
        # Read only for a call that costs more than 1 unit somewhere: 1 unit fits every policy.
        return limiter.Policies.load()


def _clean_call(
    settings: _SendSettings,
    method: Any,
    params: Any = None,
    *,
    keys: Any = None,
    priority: Any = 0,
    run_at: Any = None,
    max_attempts: Any = None,
    queue: Any = None,
    cost: Any = None,
) -> NewCall:
    """Validate send()'s arguments and return the call to store; raise an InvalidCall (a ValueError) if bad."""
    handler = get_handler(method)
    clean, text = _clean_params(params, settings.max_params_bytes)
    if handler.validator is not None:
        handler.validate(clean)
        # Validators are given the params themselves; store them as the validator left them.
        clean, text = _clean_params(clean, settings.max_params_bytes)
    call_keys = resolve_keys(handler.keys, keys, clean)
    _int_argument("priority", priority, -INT32_MAX, INT32_MAX)
    if max_attempts is None:
        max_attempts = handler.max_attempts or settings.max_attempts
    _int_argument("max_attempts", max_attempts, 1, 1000)
    if queue is None:
        queue = handler.queue or settings.queue
    queue = _clean_queue(queue)
    if run_at is not None:
        if not isinstance(run_at, datetime):
            raise InvalidCall(f"run_at must be a datetime, not {type(run_at).__name__}")
        try:
            # A timezone, a year a stored row can be read back in; in UTC (PostgreSQL refuses offsets past 15:59).
            run_at = check_moment(run_at)
        except OutOfBounds as exc:
            raise InvalidCall(str(exc)) from None
    units = clean_cost(cost, call_keys, clean, handler.cost)
    if units is not None:
        wrong = settings.policies.never_fits(units)
        if wrong:
            raise CostNeverFits(wrong)
    return NewCall(method, clean, text, call_keys, key_set(call_keys), priority, queue, max_attempts, run_at, units)


def _unreadable_cost(cost: Any, keys: Sequence[str]) -> str:
    """Return why a stored cost is not units per key of the call's keys, or "" if it is."""
    if cost is None:
        return ""
    if not isinstance(cost, dict):
        return f"the stored cost {cost!r:.80} is not a mapping of the call's keys to units"
    try:
        clean_cost(cost, keys, {}, None)
    except InvalidCost as exc:
        return f"the stored cost: {exc}"
    return ""


def _json_value(value: Any) -> Any:
    """Return a JSON column's value from a raw cursor (Django has the driver hand back the text)."""
    return json.loads(value) if isinstance(value, str) else value


def _call_from_row(model: type[CallQueue], db: str, row: Sequence[Any]) -> CallQueue:
    """Build a call from a raw row of all its columns, converted as the ORM would."""
    connection_ = connections[db]
    values = []
    for model_field, value in zip(model._meta.concrete_fields, row, strict=True):
        for convert in model_field.get_db_converters(connection_):
            value = convert(value, None, connection_)
        values.append(value)
    return model.from_db(db, [f.attname for f in model._meta.concrete_fields], values)


def _bulk_create_whole(manager: models.Manager, objs: list[Any]) -> list[Any]:
    """bulk_create in one INSERT where the SQLite library allows it.

    Django batches SQLite inserts at 999 variables (old SQLite's compile-time limit); the
    library in use reports its own limit, usually far higher.
    """
    db = connections[manager.db]
    ops = db.ops
    db.ensure_connection()
    try:
        import sqlite3

        limit = db.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    except (AttributeError, ImportError):
        return manager.bulk_create(objs)
    fields = len(manager.model._meta.concrete_fields)
    if not objs or fields * len(objs) > limit:
        return manager.bulk_create(objs)
    ops.bulk_batch_size = lambda _fields, batch: len(batch)  # this connection, this call only
    try:
        return manager.bulk_create(objs)
    finally:
        del ops.bulk_batch_size


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
        cost: int | Mapping[str, int] | None = None,
    ) -> CallQueue:
        """Validate a call and return it unsaved; raise an InvalidCall (a ValueError) if bad."""
        call = _clean_call(
            _SendSettings(), method, params, keys=keys, priority=priority, run_at=run_at,
            max_attempts=max_attempts, queue=queue, cost=cost,
        )
        return self.model(**call.fields(PENDING))

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
    ) -> CallQueue:
        """Store one call in the caller's transaction and return the saved row.

        ``cost``: units charged to every key (an int), or {key: units} (keys not named cost 1);
        a cost one of the call's policies could never admit is refused (CostNeverFits).
        """
        call = _clean_call(
            _SendSettings(), method, params, keys=keys, priority=priority, run_at=run_at,
            max_attempts=max_attempts, queue=queue, cost=cost,
        )
        db_connection = connections[self.db]
        if db_connection.vendor == "postgresql":
            return insert_one(self.model, self.db, db_connection, call, PENDING)
        row = self.model(**call.fields(PENDING))
        row.save(force_insert=True, using=self.db)
        return row

    def send_many(self, calls: Iterable[Mapping[str, Any]]) -> list[CallQueue]:
        """Store many calls (each a dict of send()'s arguments) in one statement; all or none."""
        settings = _SendSettings()
        cleaned = []
        for index, spec in enumerate(calls):
            if not isinstance(spec, Mapping):
                raise InvalidCall(f"call {index}: each call must be a dict of send() arguments")
            unknown = set(spec) - SEND_ARGUMENTS
            if unknown:
                raise InvalidCall(f"call {index}: unknown argument(s) {', '.join(sorted(unknown))}")
            if "method" not in spec:
                raise InvalidCall(f"call {index}: 'method' is required")
            try:
                cleaned.append(_clean_call(settings, **spec))
            except InvalidCall as exc:
                raise type(exc)(f"call {index}: {exc}") from exc
        if not cleaned:
            return []
        db_connection = connections[self.db]
        if db_connection.vendor == "postgresql":
            # One statement: every row is stored or none, without a transaction of its own.
            return insert_many(self.model, self.db, db_connection, cleaned, PENDING)
        return _bulk_create_whole(self, [self.model(**call.fields(PENDING)) for call in cleaned])

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
        batch = self.claim_batch([key_set_text], limit, policies)
        return ClaimResult(batch.calls, batch.verdicts[key_set_text])

    def claim_batch(self, key_sets: Sequence[str], budget: int, policies: limiter.Policies) -> BatchClaim:
        """Claim up to ``budget`` due calls across key sets, sharing it in rounds, in one transaction.

        Each round asks every key set still in play for an equal share of what is left (no more
        than its keys have room for) in one statement; a key set that fills its share may take
        more in the next round, so one backlog cannot crowd out a key that has room.
        """
        result = BatchClaim([], {})
        parsed: dict[str, list[str]] = {}
        for text in key_sets:
            try:
                parsed[text] = read_key_set(text)
            except InvalidKey as exc:
                # A row written by hand: its keys cannot be limited, so its calls cannot run.
                self._fail_unreadable(self.filter(status=PENDING, key_set=text), str(exc))
                result.verdicts[text] = limiter.Verdict(room=0, reason=str(exc))
        all_keys = sorted({key for keys in parsed.values() for key in keys})
        # Kept short: it holds the key locks every dispenser and worker of these keys waits on.
        with transaction.atomic(using=self.db):
            states = limiter.lock_keys(all_keys)
            now = db_now()
            # Judge the windows a little ahead, so a call claimed for a slot about to free
            # reaches its worker as the slot frees; the start re-checks on the clock of then.
            at = now + dispatcher_settings.DISPATCH_AHEAD
            by_key = limiter.check_each_key(all_keys, states, at, policies, for_start=False)
            room = {key: verdict.room for key, verdict in by_key.items()}
            active = []
            for text, keys in parsed.items():
                verdict = limiter.combine([by_key[key] for key in keys])
                result.verdicts[text] = verdict
                if not verdict.blocked:
                    active.append(text)
            reserved: dict[str, int] = {}
            reserved_units: dict[str, int] = {}
            # Key sets whose next call costs more than their keys have room for; its cost per key.
            walled: dict[str, dict[str, int]] = {}
            while active and budget > 0:
                share = max(1, budget // len(active))
                asks: dict[str, int] = {}
                left = budget
                for text in active:
                    # Room is in units and every call costs at least one: never more calls than units.
                    wanted = min([share, left, *(room[key] for key in parsed[text])])
                    if wanted > 0:
                        asks[text] = wanted
                        left -= wanted
                if not asks:
                    break
                rows = self._claim_rows(asks, now)
                got: dict[str, int] = {}
                kept, returned = [], []
                # Each key set's calls in the order its scan chose them; a call that does not fit
                # its keys' room (its cost) ends the key set's share, so no cheaper call jumps it.
                for row in sorted(rows, key=lambda r: (r.key_set, -r.priority, r.id)):
                    keys = parsed[row.key_set]
                    problem = _unreadable_cost(row.cost, keys)
                    if problem:
                        self._fail_unreadable(self.filter(id=row.id), problem)
                        continue
                    if row.key_set in walled or any(row.units(key) > room[key] for key in keys):
                        walled.setdefault(row.key_set, {key: row.units(key) for key in keys})
                        returned.append(row.id)
                        continue
                    kept.append(row)
                    got[row.key_set] = got.get(row.key_set, 0) + 1
                    for key in keys:
                        room[key] -= row.units(key)
                        reserved[key] = reserved.get(key, 0) + 1
                        reserved_units[key] = reserved_units.get(key, 0) + row.units(key)
                if returned:
                    self.filter(id__in=returned).update(status=PENDING, dispatched_at=None)
                result.calls.extend(kept)
                budget -= len(kept)
                # Only a key set that filled its share may have more waiting.
                active = [text for text, wanted in asks.items() if got.get(text, 0) == wanted and text not in walled]
            limiter.adjust_reserved(reserved, reserved_units)
            # A key set whose keys this pass filled (or whose next call's cost does not fit)
            # waits for room like one found blocked.
            filled = sorted({key for key in reserved if room[key] <= 0} | {k for c in walled.values() for k in c})
            if filled:
                for key in reserved:
                    states[key].reserved += reserved[key]
                    states[key].reserved_units += reserved_units[key]
                need: dict[str, int] = {}
                for costs in walled.values():
                    for key, units in costs.items():
                        need[key] = max(need.get(key, 1), units)
                after = limiter.assess(filled, states, at, policies, for_start=False, costs=need).verdicts
                for text, keys in parsed.items():
                    if not result.verdicts[text].blocked and any(key in after for key in keys):
                        result.verdicts[text] = limiter.combine([after.get(key, by_key[key]) for key in keys])
        # Publish the most urgent first, as each key set's scan chose them.
        result.calls.sort(key=lambda call: (-call.priority, call.id))
        return result

    def _fail_unreadable(self, calls: CallQueueQuerySet, problem: str) -> int:
        """Mark calls whose stored row cannot be read failed, saying why, so they stop no pass or sweep."""
        failed = calls.update(
            status=FAILED, dispatched_at=None, finished_at=db_now(), last_error=f"unreadable row: {problem}"
        )
        log.error("unreadable_calls failed=%s error=%r", failed, problem)
        return failed

    def _claim_rows(self, asks: dict[str, int], now: datetime) -> list[Claimed]:
        """Mark up to ``asks[key_set]`` due calls of each key set dispatched; skip rows locked elsewhere."""
        if connections[self.db].vendor == "postgresql":
            return self._claim_rows_returning(asks, now)
        claimed = []
        for text, wanted in asks.items():
            rows = list(
                self.filter(status=PENDING, key_set=text, run_at__lte=now)
                .order_by("-priority", "id")
                .select_for_update(skip_locked=True)
                .values_list("id", "dispatch_no", "queue", "priority", "cost")[:wanted]
            )
            if rows:
                self.filter(id__in=[r[0] for r in rows]).update(
                    status=DISPATCHED, dispatched_at=now, dispatch_no=F("dispatch_no") + 1
                )
            claimed += [
                Claimed(id=i, dispatch_no=n + 1, queue=q, key_set=text, priority=p, cost=c) for i, n, q, p, c in rows
            ]
        return claimed

    def _claim_rows_returning(self, asks: dict[str, int], now: datetime) -> list[Claimed]:
        """Select and mark the due calls of every asking key set in one statement."""
        table = self.model._meta.db_table
        # One LATERAL scan of the waiting index per key set, each with its own LIMIT.
        sql = f"""
            UPDATE {table} SET status = %s, dispatched_at = %s, dispatch_no = dispatch_no + 1
            WHERE id IN (
                SELECT due.id FROM unnest(%s::text[], %s::int[]) AS ask(key_set, wanted)
                CROSS JOIN LATERAL (
                    SELECT id FROM {table}
                    WHERE status = %s AND key_set = ask.key_set AND run_at <= %s
                    ORDER BY priority DESC, id
                    LIMIT ask.wanted
                    FOR UPDATE SKIP LOCKED
                ) AS due
            )
            RETURNING id, dispatch_no, queue, key_set, priority, cost
        """
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql, [DISPATCHED, now, list(asks), list(asks.values()), PENDING, now])
            return [
                Claimed(id=i, dispatch_no=n, queue=q, key_set=k, priority=p, cost=_json_value(c))
                for i, n, q, k, p, c in cursor.fetchall()
            ]

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
                units = dict.fromkeys(keys, 0)
                for call in group:
                    if self.filter(id=call.id, status=DISPATCHED, dispatch_no=call.dispatch_no).update(
                        status=PENDING, dispatched_at=None
                    ):
                        won += 1
                        for key in keys:
                            units[key] += call.units(key)
                limiter.adjust(keys, reserved=-won, units=units)
                returned += won
        return returned

    def next_due_at(self, now: datetime) -> datetime | None:
        """Return when the earliest call that is not yet due becomes due."""
        return self.filter(status=PENDING, run_at__gt=now).order_by("run_at").values_list("run_at", flat=True).first()

    # --- worker --------------------------------------------------------------------------

    def start(
        self, call_id: int, dispatch_no: int, worker: str = "", *, may_wait: timedelta = timedelta(0)
    ) -> Started:
        """Move a dispatched call to running if its keys still have room; count the attempt.

        If the keys have no room now but will within ``may_wait``, nothing changes and the
        result says how long to wait before trying again ("early").
        """
        with connections[self.db].cursor() as cursor:
            # Hand-written: read before any lock at every start, where the ORM's compilation
            # would cost more than the query.
            cursor.execute(
                f"SELECT key_set, status, dispatch_no, cost FROM {self.model._meta.db_table} WHERE id = %s", [call_id]
            )
            head = cursor.fetchone()
        if head is None:
            return Started("stale", reason="no such call")
        if head[1] != DISPATCHED or head[2] != dispatch_no:
            return Started("stale", reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}")
        keys = parse_key_set(head[0])
        cost = _json_value(head[3]) or {}
        costs = {key: cost.get(key, 1) for key in keys}
        capped = False
        record = None
        with transaction.atomic(using=self.db):
            if keys:
                states = limiter.lock_keys(keys)
                # Read after the lock wait, so a policy edit committed meanwhile binds this start.
                policies, now = limiter.Policies.load_with_clock()
                # Re-checked at the start itself: a message may have waited in the broker while
                # the window filled, a policy tightened or a pause began.
                assessment = limiter.assess(keys, states, now, policies, for_start=True, costs=costs)
                verdict = limiter.combine(list(assessment.verdicts.values()))
                if (
                    verdict.blocked and verdict.until is not None
                    and verdict.until - now <= min(may_wait, HOLD_FOR_SLOT)
                ):
                    # The slot frees within a few milliseconds: wait for it holding the key locks,
                    # which no other start of these keys could use before then anyway, so the
                    # start lands on its slot rather than a worker's round trip after it.
                    time.sleep((verdict.until - now).total_seconds())
                    now = db_now()
                    assessment = limiter.assess(keys, states, now, policies, for_start=True, costs=costs)
                    verdict = limiter.combine(list(assessment.verdicts.values()))
                if verdict.blocked and verdict.until is not None and verdict.until - now <= may_wait:
                    return Started("early", reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now)
                if verdict.blocked:
                    until = verdict.until or now + timedelta(seconds=1)
                    deferred = self.filter(id=call_id, status=DISPATCHED, dispatch_no=dispatch_no).update(
                        status=PENDING, dispatched_at=None, run_at=until
                    )
                    if not deferred:
                        return Started("stale", reason="claimed by another delivery")
                    limiter.adjust(keys, reserved=-1, units=costs)
                    return Started("deferred", reason=f"{verdict.key}: {verdict.reason}")
                capped = any(p.concurrency for key in keys for p in policies.for_key(key))
                record = limiter.start_record(keys, states, assessment, policies, now, costs)
            else:
                now = db_now()
            started = self._mark_running(call_id, dispatch_no, keys, now, worker[:200], record)
        if started is None:
            return Started("stale", reason="claimed by another delivery")
        return Started("started", call=started[0], attempt=started[1], capped=capped)

    def _mark_running(
        self, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
        record: limiter.StartRecord | None,
    ) -> tuple[CallQueue, Attempt] | None:
        """Mark the call running, log its starts and open its attempt; None if the delivery is stale."""
        from dispatcher.models import Attempt

        record = record or limiter.StartRecord()
        if connections[self.db].vendor == "postgresql":
            return self._mark_running_returning(call_id, dispatch_no, keys, now, worker, record)
        won = self.filter(id=call_id, status=DISPATCHED, dispatch_no=dispatch_no).update(
            status=RUNNING, started_at=now, attempts=F("attempts") + 1
        )
        if not won:
            return None
        call = self.get(id=call_id)
        attempt = Attempt.objects.create(
            call=call, number=call.attempts + call.deferrals, started_at=now, worker=worker
        )
        limiter.record_starts(now, record, call_id)
        limiter.adjust(
            keys, reserved=-1, running=1, units={key: units for key, units, _ in record.log},
            totals={key: cum for key, _, cum in record.log},
        )
        return call, attempt

    def _mark_running_returning(
        self, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
        record: limiter.StartRecord,
    ) -> tuple[CallQueue, Attempt] | None:
        """The same as one statement: the guarded update, the attempt, the start log, buckets, the counters."""
        from dispatcher.models import Attempt, KeyBucket, KeyStart, KeyState

        fields = self.model._meta.concrete_fields
        columns = ", ".join(f"started.{connections[self.db].ops.quote_name(f.column)}" for f in fields)
        # The start is recorded at the statement's own clock (clock_timestamp(), read once in a
        # CTE PostgreSQL materialises; never earlier than ``now``), not at the clock the admission
        # was judged on: the recorded start is then as close to the handler's request as the
        # transaction allows.
        # Safe because the key locks are held from the judgement to the commit: a window judged
        # to have room at the earlier time still has it later (its old starts only age out), and a
        # bucket's charge is carried to the later time (GREATEST below; the same max as
        # TokenBucket.charge).
        sql = f"""
            WITH clock AS (
                SELECT GREATEST(%(now)s::timestamptz, clock_timestamp()) AS now
            ), started AS (
                UPDATE {self.model._meta.db_table}
                SET status = %(running)s, started_at = (SELECT now FROM clock), attempts = attempts + 1
                WHERE id = %(id)s AND status = %(dispatched)s AND dispatch_no = %(dispatch_no)s
                RETURNING *
            ), attempt AS (
                INSERT INTO {Attempt._meta.db_table} (call_id, number, started_at, outcome, error, worker)
                SELECT id, attempts + deferrals, clock.now, %(running)s, '', %(worker)s FROM started, clock
                RETURNING id, number
            ), start_log AS (
                INSERT INTO {KeyStart._meta.db_table} (key, started_at, units, cum, call_id)
                SELECT log.key, clock.now, log.units, log.cum, started.id
                FROM started, clock, unnest(%(log_keys)s::text[], %(log_units)s::int[], %(log_cums)s::bigint[])
                    AS log(key, units, cum)
            ), buckets AS (
                INSERT INTO {KeyBucket._meta.db_table} (key, period, tat_us, since)
                SELECT b.key, b.period,
                    GREATEST(b.tat_us, floor(EXTRACT(EPOCH FROM clock.now) * 1000000)::bigint + b.charged_us),
                    clock.now
                FROM started, clock, unnest(
                    %(b_keys)s::text[], %(b_periods)s::interval[], %(b_tats)s::bigint[], %(b_charged)s::bigint[]
                ) AS b(key, period, tat_us, charged_us)
                ON CONFLICT (key, period) DO UPDATE SET tat_us = EXCLUDED.tat_us
            ), counters AS (
                UPDATE {KeyState._meta.db_table} AS state
                SET reserved = reserved - 1, reserved_units = reserved_units - log.units,
                    running = running + 1, total = log.cum
                FROM unnest(%(log_keys)s::text[], %(log_units)s::int[], %(log_cums)s::bigint[]) AS log(key, units, cum)
                WHERE state.key = log.key AND EXISTS (SELECT 1 FROM started)
            )
            SELECT attempt.id, attempt.number, clock.now, {columns} FROM started, attempt, clock
        """
        params = {
            "running": RUNNING, "dispatched": DISPATCHED, "now": now, "id": call_id,
            "dispatch_no": dispatch_no, "worker": worker,
            "log_keys": [k for k, _, _ in record.log], "log_units": [u for _, u, _ in record.log],
            "log_cums": [c for _, _, c in record.log],
            "b_keys": [k for k, _, _ in record.buckets], "b_periods": [p for _, p, _ in record.buckets],
            "b_tats": [t for _, _, t in record.buckets],
            # What each start charged its bucket beyond max(tat, now), to carry to the later clock.
            "b_charged": record.charged,
        }
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:
            return None
        call = _call_from_row(self.model, self.db, row[3:])
        attempt = Attempt(id=row[0], call=call, number=row[1], started_at=row[2], worker=worker)
        attempt._state.adding, attempt._state.db = False, self.db
        return call, attempt

    def _finish(
        self, call: CallQueue, attempt: Attempt, outcome: str, error: str, *, wake: bool = True, **changes: Any
    ) -> bool:
        from dispatcher.models import Attempt

        keys = parse_key_set(call.key_set)
        error = error[:MAX_ERROR_CHARS]
        if connections[self.db].vendor == "postgresql":
            # One statement, atomic by itself, that also locks the key rows (in key order). Its
            # call row may be locked before them, the reverse of a start; only a rescue of this
            # very call (past DISPATCHER_RUN_TIMEOUT) or a duplicate delivery racing its first
            # start takes both the other way, and then PostgreSQL ends one of the two: a finish
            # is retried by the worker, a duplicate start does nothing.
            now = db_now()
            changes, wake = self._finish_changes(changes, now, keys, wake)
            won = self._finish_returning(call, attempt.id, keys, now, outcome, error, changes, wake)
        else:
            with transaction.atomic(using=self.db):
                limiter.lock_keys(keys)
                now = db_now()
                changes, wake = self._finish_changes(changes, now, keys, wake)
                won = bool(self.filter(id=call.id, status=RUNNING, dispatch_no=call.dispatch_no).update(**changes))
                if won:
                    Attempt.objects.filter(id=attempt.id).update(finished_at=now, outcome=outcome, error=error)
                    limiter.adjust(keys, running=-1)
                    if wake:
                        limiter.wake_dispensers()
        if not won:
            # Rescued while it ran (the run took longer than DISPATCHER_RUN_TIMEOUT).
            log.warning("finish_lost call=%s attempt=%s outcome=%s", call.id, attempt.number, outcome)
        return won

    @staticmethod
    def _finish_changes(
        changes: dict[str, Any], now: datetime, keys: list[str], wake: bool
    ) -> tuple[dict[str, Any], bool]:
        """Resolve the changes that depend on the finish time; say whether to wake dispensers."""
        changes = {k: (v(now) if callable(v) else v) for k, v in changes.items()}
        # Wake dispensers when the call waits again, or when it may free a concurrency slot.
        return changes, changes.get("status") == PENDING or (wake and bool(keys))

    def _finish_returning(
        self, call: CallQueue, attempt_id: int, keys: list[str], now: datetime, outcome: str, error: str,
        changes: dict[str, Any], wake: bool,
    ) -> bool:
        """Record the finish in one statement: the guarded update, the attempt, the counters, the wake-up."""
        from dispatcher.models import Attempt, KeyState

        db = connections[self.db]
        sets, values = [], []
        for name, value in changes.items():
            field = self.model._meta.get_field(name)
            sets.append(f"{db.ops.quote_name(field.column)} = %s")
            values.append(field.get_db_prep_save(value, db))
        # The key rows are locked in key order, as every other locker of several keys does;
        # the counters' UPDATE only touches rows that "locked" already holds.
        sql = f"""
            WITH locked AS (
                SELECT key FROM {KeyState._meta.db_table} WHERE key = ANY(%s::text[]) ORDER BY key FOR UPDATE
            ), finished AS (
                UPDATE {self.model._meta.db_table} SET {", ".join(sets)}
                WHERE id = %s AND status = %s AND dispatch_no = %s
                RETURNING id
            ), attempt AS (
                UPDATE {Attempt._meta.db_table} SET finished_at = %s, outcome = %s, error = %s
                WHERE id = %s AND EXISTS (SELECT 1 FROM finished)
            ), counters AS (
                UPDATE {KeyState._meta.db_table} SET running = running - 1
                WHERE key IN (SELECT key FROM locked) AND EXISTS (SELECT 1 FROM finished)
            ), wake AS (
                SELECT pg_notify(%s, '') FROM finished WHERE %s
            )
            SELECT (SELECT COUNT(*) FROM finished), (SELECT COUNT(*) FROM wake)
        """
        params = [
            keys, *values, call.id, RUNNING, call.dispatch_no, now, outcome, error, attempt_id,
            limiter.WAKE_CHANNEL, wake,
        ]
        with db.cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.fetchone()[0])

    def finish_done(self, call: CallQueue, attempt: Attempt, result: Any, *, wake: bool = True) -> bool:
        """Record a successful attempt and its result; ``wake=False`` when no key has a concurrency cap."""
        return self._finish(
            call, attempt, "done", "", wake=wake, status=DONE, result=result, finished_at=lambda now: now, last_error=""
        )

    def finish_error(
        self, call: CallQueue, attempt: Attempt, error: str, tb: str, *, permanent: bool, wake: bool = True
    ) -> bool:
        """Record a failed attempt: retry with backoff while attempts remain, else fail."""
        error = error[:MAX_ERROR_CHARS]
        if permanent or call.attempts >= call.max_attempts:
            return self._finish(
                call, attempt, "failed" if permanent else "error", error, wake=wake,
                status=FAILED, finished_at=lambda now: now, last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
            )
        delay = RetryPolicy.from_settings().delay(call.attempts)
        return self._finish(
            call, attempt, "error", error, wake=wake,
            status=PENDING, run_at=lambda now: now + delay, dispatched_at=None,
            last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
        )

    def finish_rate_limited(
        self, call: CallQueue, attempt: Attempt, retry_after: float | None, key: str | None, error: str
    ) -> bool:
        """Record a 429: pause the key, put the call back to wait, refund the attempt."""
        from dispatcher.models import Attempt

        wait = timedelta(seconds=retry_after) if retry_after is not None else dispatcher_settings.DEFAULT_RETRY_AFTER
        # A downstream may ask for any pause; none lasts longer than DISPATCHER_MAX_PAUSE.
        wait = min(max(wait, timedelta(0)), dispatcher_settings.MAX_PAUSE)
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

    def correct_cost(self, call: CallQueue, reported: int | Mapping[str, int]) -> dict[str, int]:
        """Correct the keys' usage to what a started call really cost; return the change per key.

        The call's rows in the start log take the reported units (and every later running
        total of the key moves with them); its buckets are charged or refunded the difference.
        """
        from dispatcher.models import KeyBucket, KeyStart, KeyState

        keys = parse_key_set(call.key_set)
        if isinstance(reported, Mapping):
            actual = {key: int(reported.get(key, call.cost_of(key))) for key in keys}
        else:
            actual = dict.fromkeys(keys, int(reported))
        deltas = {key: actual[key] - call.cost_of(key) for key in keys if actual[key] != call.cost_of(key)}
        if not deltas or call.started_at is None:
            return {}
        with transaction.atomic(using=self.db):
            limiter.lock_keys(keys)
            policies = limiter.Policies.load()
            now = db_now()
            for key, delta in deltas.items():
                start = KeyStart.objects.filter(key=key, started_at=call.started_at, call_id=call.id).first()
                if start is not None:
                    KeyStart.objects.filter(key=key, cum__gt=start.cum).exclude(id=start.id).update(cum=F("cum") + delta)
                    KeyStart.objects.filter(id=start.id).update(units=F("units") + delta, cum=F("cum") + delta)
                KeyState.objects.filter(key=key).update(total=F("total") + delta)
                for policy in policies.for_key(key):
                    if not isinstance(policy, limiter.TokenBucket):
                        continue
                    bucket = KeyBucket.objects.filter(key=key, period=policy.period).first()
                    if bucket is None or bucket.since > call.started_at:
                        # This bucket (new, or a new shape) never charged the start: nothing to
                        # give back, and an extra charge would count a start it did not see.
                        continue
                    tat = policy.refund(limiter.from_us(bucket.tat_us), now, -delta)
                    if tat is not None:
                        KeyBucket.objects.filter(id=bucket.id).update(tat_us=limiter.to_us(tat))
            if any(delta < 0 for delta in deltas.values()):
                limiter.wake_dispensers()
        return deltas

    # --- rescue --------------------------------------------------------------------------

    def rescue(self, batch: int | None = None) -> RescueReport:
        """Return calls stuck in dispatched or running past their timeout to waiting."""
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
            # One bad row must not leave the others stuck: it is failed (unreadable) or skipped.
            try:
                keys = read_key_set(text)
            except InvalidKey as exc:
                if self._fail_unreadable(self.filter(id=call_id, status__in=[DISPATCHED, RUNNING]), str(exc)):
                    report.failed += 1
                    report.ids.append(call_id)
                continue
            try:
                outcome = self._rescue_one(call_id, keys, dispatch_cutoff, run_cutoff, policy)
            except Exception:
                log.exception("rescue_skipped id=%s", call_id)
                continue
            if outcome == "dispatched":
                report.dispatched += 1
            elif outcome:
                # A lost run counts as rescued, and as failed too when it was the last attempt.
                report.running += 1
                report.failed += outcome == "failed"
            if outcome:
                report.ids.append(call_id)
        return report

    def _rescue_one(
        self, call_id: int, keys: list[str], dispatch_cutoff: datetime, run_cutoff: datetime, policy: RetryPolicy
    ) -> str:
        """Return one stuck call to waiting (or fail it when out of attempts); say which it was, "" if neither."""
        from dispatcher.models import Attempt

        with transaction.atomic(using=self.db):
            limiter.lock_keys(keys)
            call = self.select_for_update().filter(id=call_id).first()
            if call is None:
                return ""
            now = db_now()
            if call.status == DISPATCHED and call.dispatched_at and call.dispatched_at < dispatch_cutoff:
                # Claimed but never started: the message was lost; no attempt was spent.
                self.filter(id=call_id).update(status=PENDING, dispatched_at=None)
                limiter.adjust(keys, reserved=-1, units={key: call.cost_of(key) for key in keys})
                outcome = "dispatched"
            elif call.status == RUNNING and call.started_at and call.started_at < run_cutoff:
                # Started but never finished: the worker died; the attempt counts.
                error = f"lost: no result within DISPATCHER_RUN_TIMEOUT ({dispatcher_settings.RUN_TIMEOUT})"
                Attempt.objects.filter(call_id=call_id, outcome="running").update(
                    outcome="lost", finished_at=now, error=error
                )
                if call.attempts >= call.max_attempts:
                    self.filter(id=call_id).update(status=FAILED, finished_at=now, last_error=error)
                    outcome = "failed"
                else:
                    self.filter(id=call_id).update(
                        status=PENDING, dispatched_at=None, run_at=now + policy.delay(call.attempts), last_error=error
                    )
                    outcome = "running"
                limiter.adjust(keys, running=-1)
            else:
                return ""
            limiter.wake_dispensers()
        return outcome

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
