"""The call table's queryset and manager: every change of a call's state, the one place that
locks call rows or writes ``status``; their hand-written statements are in ``dispatcher.sql``."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, models, transaction
from django.db.models import F, Q

from dispatcher import arrivals, limiter, sql, tables
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import bounded_charge, clean_cost
from dispatcher.durations import parse_positive_duration
from dispatcher.exceptions import CostNeverFits, InvalidCall, InvalidCost, InvalidKey, InvalidParams
from dispatcher.folded import Folded, folding, start_transaction
from dispatcher.inserts import NewCall, insert_many, insert_one
from dispatcher.keys import is_pattern, key_set, parse_key_set, read_key_set, resolve_keys, validate_policy_key
from dispatcher.policies import validate as validate_shape
from dispatcher.registry import get_handler
from dispatcher.retry import RetryPolicy
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status
from dispatcher.validation import OutOfBounds, check_json, check_moment

if TYPE_CHECKING:
    from dispatcher.models import Attempt, CallQueue, RateLimit

log = logging.getLogger("dispatcher")

INT32_MAX = 2**31 - 1
MAX_ERROR_CHARS = 10_000
# How long a start may wait for its slot while holding its keys' locks (see start()).
HOLD_FOR_SLOT = timedelta(milliseconds=30)



class SendOptions(TypedDict, total=False):
    """The keyword arguments of send() and build() (send() says what each means)."""

    keys: Iterable[str] | None
    priority: int
    run_at: datetime | None
    max_attempts: int | None
    queue: str | None
    cost: int | Mapping[str, int] | None


SEND_ARGUMENTS = {"method", "params", *SendOptions.__optional_keys__}


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


class _GroupRaced(Exception):
    """A call of a message's group was no longer the delivery's to start: start each on its own."""


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

    def __init__(self, db: str) -> None:
        self.db = db

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
        return limiter.Policies.load(self.db)


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
        # Field.get_db_converters is Django's (the compiler calls it); the 5.2 stubs leave it out.
        for convert in model_field.get_db_converters(connection_):  # type: ignore[attr-defined]
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
    # On purpose, for this connection and this call only (restored below).
    ops.bulk_batch_size = lambda fields, objs: len(objs)  # type: ignore[method-assign]
    try:
        return manager.bulk_create(objs)
    finally:
        del ops.bulk_batch_size


class CallQueueQuerySet(models.QuerySet):
    """Calls filtered by state."""

    def pending(self) -> CallQueueQuerySet:
        return self.filter(status=Status.PENDING)

    def in_flight(self) -> CallQueueQuerySet:
        return self.filter(status__in=[Status.DISPATCHED, Status.RUNNING])

    def finished(self) -> CallQueueQuerySet:
        return self.filter(status__in=[Status.DONE, Status.FAILED, Status.CANCELLED])

    def waiting_retry(self) -> CallQueueQuerySet:
        return self.filter(status=Status.PENDING, attempts__gt=0)

    def due(self, now: datetime) -> CallQueueQuerySet:
        return self.filter(status=Status.PENDING, run_at__lte=now)


class CallQueueManager(models.Manager.from_queryset(CallQueueQuerySet)):  # type: ignore[misc]
    """Enqueue, claim, start, finish, rescue and cancel calls.

    Where PostgreSQL takes a statement of its own (``dispatcher.sql``), the operation has two
    methods side by side, ``_x_postgresql`` and ``_x_portable`` (the ORM's, for every database),
    and ``_x`` chooses (``sql.postgresql_path``); tests/test_paths.py runs both on PostgreSQL and
    compares the rows they leave.
    """

    def _on_postgresql(self) -> bool:
        return sql.postgresql_path(self.db)

    def _attempts(self) -> models.QuerySet[Attempt]:
        """The attempts, on this manager's database."""
        return tables.Attempt.objects.using(self.db)

    # --- enqueue -------------------------------------------------------------------------

    def build(self, method: str, params: Mapping[str, Any] | None = None, **options: Unpack[SendOptions]) -> CallQueue:
        """Validate a call and return it unsaved; raise an InvalidCall (a ValueError) if bad."""
        return self.model(**_clean_call(_SendSettings(self.db), method, params, **options).fields(Status.PENDING))

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

        ``keys``: the call's rate-limit keys (besides its handler's key templates); ``priority``:
        higher first (default 0); ``run_at``: not before then; ``max_attempts`` and ``queue``:
        the handler's, else DISPATCHER_MAX_ATTEMPTS and DISPATCHER_QUEUE; ``cost``: units charged
        to every key (an int), or {key: units} (keys not named cost 1); a cost one of the call's
        policies could never admit is refused (CostNeverFits).
        """
        call = _clean_call(
            _SendSettings(self.db), method, params, keys=keys, priority=priority, run_at=run_at,
            max_attempts=max_attempts, queue=queue, cost=cost,
        )
        if self._on_postgresql():
            return insert_one(self.model, self.db, connections[self.db], call, Status.PENDING)
        row = self.model(**call.fields(Status.PENDING))
        row.save(force_insert=True, using=self.db)
        return row

    def send_many(self, calls: Iterable[Mapping[str, Any]]) -> list[CallQueue]:
        """Store many calls (each a dict of send()'s arguments) in one statement; all or none."""
        settings = _SendSettings(self.db)
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
        if self._on_postgresql():
            # One statement: every row is stored or none, without a transaction of its own.
            return insert_many(self.model, self.db, connections[self.db], cleaned, Status.PENDING)
        return _bulk_create_whole(self, [self.model(**call.fields(Status.PENDING)) for call in cleaned])

    # --- dispense ------------------------------------------------------------------------

    def waiting_key_sets(self, after: str | None = None, limit: int = 10_000) -> list[str]:
        """Return the distinct key sets of waiting calls, in order, one index probe each."""
        # A loose index scan: each step asks the partial index for the next key set.
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.waiting_key_sets(), {"after": after if after is not None else "", "limit": limit})
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
                self._fail_unreadable(self.filter(status=Status.PENDING, key_set=text), str(exc))
                result.verdicts[text] = limiter.Verdict(room=0, reason=str(exc))
        all_keys = sorted({key for keys in parsed.values() for key in keys})
        # Kept short: it holds the key locks every dispenser and worker of these keys waits on.
        with transaction.atomic(using=self.db):
            states = limiter.lock_keys(all_keys, using=self.db)
            now = db_now(self.db)
            # Judge the windows a little ahead, so a call claimed for a slot about to free
            # reaches its worker as the slot frees; the start re-checks on the clock of then.
            at = now + dispatcher_settings.DISPATCH_AHEAD
            by_key = limiter.check_each_key(all_keys, states, at, policies, for_start=False, using=self.db)
            room = {key: verdict.room for key, verdict in by_key.items()}
            # A key's first call of the pass may cost more than its room when its bucket admits
            # one call beyond its depth (TokenBucket.alone): nothing else is promised then.
            alone = {key: verdict.largest for key, verdict in by_key.items()}
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
                    if row.key_set in walled or any(
                        row.units(key) > room[key] and (key in reserved or row.units(key) > alone[key]) for key in keys
                    ):
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
                    self.filter(id__in=returned).update(status=Status.PENDING, dispatched_at=None)
                result.calls.extend(kept)
                budget -= len(kept)
                # Only a key set that filled its share may have more waiting.
                active = [text for text, wanted in asks.items() if got.get(text, 0) == wanted and text not in walled]
            limiter.adjust_reserved(reserved, reserved_units, using=self.db)
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
                after = limiter.assess(filled, states, at, policies, for_start=False, costs=need, using=self.db).verdicts
                for text, keys in parsed.items():
                    if not result.verdicts[text].blocked and any(key in after for key in keys):
                        result.verdicts[text] = limiter.combine([after.get(key, by_key[key]) for key in keys])
        # Publish the most urgent first, as each key set's scan chose them.
        result.calls.sort(key=lambda call: (-call.priority, call.id))
        return result

    def _fail_unreadable(self, calls: CallQueueQuerySet, problem: str) -> int:
        """Mark calls whose stored row cannot be read failed, saying why, so they stop no pass or sweep."""
        failed = calls.update(
            status=Status.FAILED, dispatched_at=None, finished_at=db_now(self.db), last_error=f"unreadable row: {problem}"
        )
        log.error("unreadable_calls failed=%s error=%r", failed, problem)
        return failed

    def _claim_rows(self, asks: dict[str, int], now: datetime) -> list[Claimed]:
        """Mark up to ``asks[key_set]`` due calls of each key set dispatched; skip rows locked elsewhere."""
        if self._on_postgresql():
            return self._claim_rows_postgresql(asks, now)
        return self._claim_rows_portable(asks, now)

    def _claim_rows_portable(self, asks: dict[str, int], now: datetime) -> list[Claimed]:
        """Per key set: select the due rows (skipping locked ones), then mark them, through the ORM."""
        claimed = []
        for text, wanted in asks.items():
            rows = list(
                self.filter(status=Status.PENDING, key_set=text, run_at__lte=now)
                .order_by("-priority", "id")
                .select_for_update(skip_locked=True)
                .values_list("id", "dispatch_no", "queue", "priority", "cost")[:wanted]
            )
            if rows:
                self.filter(id__in=[r[0] for r in rows]).update(
                    status=Status.DISPATCHED, dispatched_at=now, dispatch_no=F("dispatch_no") + 1
                )
            claimed += [
                Claimed(id=i, dispatch_no=n + 1, queue=q, key_set=text, priority=p, cost=c) for i, n, q, p, c in rows
            ]
        return claimed

    def _claim_rows_postgresql(self, asks: dict[str, int], now: datetime) -> list[Claimed]:
        """Select and mark the due calls of every asking key set in one statement (``sql.claim_due``)."""
        params: dict[str, Any] = {
            "dispatched": Status.DISPATCHED, "pending": Status.PENDING, "now": now,
            "key_sets": list(asks), "wanted": list(asks.values()),
        }
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.claim_due(), params)
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
                limiter.lock_keys(keys, using=self.db)
                won = 0
                units = dict.fromkeys(keys, 0)
                for call in group:
                    if self.filter(id=call.id, status=Status.DISPATCHED, dispatch_no=call.dispatch_no).update(
                        status=Status.PENDING, dispatched_at=None
                    ):
                        won += 1
                        for key in keys:
                            units[key] += call.units(key)
                limiter.adjust(keys, reserved=-won, units=units, using=self.db)
                returned += won
        return returned

    def next_due_at(self, now: datetime) -> datetime | None:
        """Return when the earliest call that is not yet due becomes due."""
        return self.filter(status=Status.PENDING, run_at__gt=now).order_by("run_at").values_list("run_at", flat=True).first()

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
            cursor.execute(sql.call_head(), [call_id])
            head = cursor.fetchone()
        if head is None:
            return Started("stale", reason="no such call")
        if head[1] != Status.DISPATCHED or head[2] != dispatch_no:
            return Started("stale", reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}")
        keys = parse_key_set(head[0])
        cost = _json_value(head[3]) or {}
        costs = {key: cost.get(key, 1) for key in keys}
        return folding(lambda fold: self._start_locked(call_id, dispatch_no, keys, costs, worker, may_wait, fold=fold))

    def _start_locked(
        self, call_id: int, dispatch_no: int, keys: list[str], costs: dict[str, int], worker: str,
        may_wait: timedelta, *, fold: bool,
    ) -> Started:
        """The transaction of ``start``: lock the keys, judge the call, mark it running or defer it."""
        capped = False
        record = None
        with start_transaction(self.db, fold) as folded:
            if keys:
                states = limiter.lock_keys(keys, using=self.db, folded=folded)
                # Read after the lock wait, so a policy edit committed meanwhile binds this start;
                # with the policies this process kept, in the statement that reads the windows.
                policies, now, read = limiter.policies_for_start(keys, states, using=self.db)
                # Re-checked at the start itself: a message may have waited in the broker while
                # the window filled, a policy tightened or a pause began.
                assessment = limiter.assess(
                    keys, states, now, policies, for_start=True, costs=costs, read=read, using=self.db
                )
                verdict = limiter.combine(list(assessment.verdicts.values()))
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
                    now = db_now(self.db)
                    assessment = limiter.assess(keys, states, now, policies, for_start=True, costs=costs, using=self.db)
                    verdict = limiter.combine(list(assessment.verdicts.values()))
                if verdict.blocked and verdict.until is not None and verdict.until - now <= may_wait:
                    return Started("early", reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now)
                if verdict.blocked:
                    until = verdict.until or now + timedelta(seconds=1)
                    deferred = self.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
                        status=Status.PENDING, dispatched_at=None, run_at=until
                    )
                    if not deferred:
                        return Started("stale", reason="claimed by another delivery")
                    limiter.adjust(keys, reserved=-1, units=costs, using=self.db)
                    return Started("deferred", reason=f"{verdict.key}: {verdict.reason}")
                capped = any(p.concurrency for key in keys for p in policies.for_key(key))
                record = limiter.start_record(keys, states, assessment, policies, now, costs)
            else:
                now = db_now(self.db)
            started = self._mark_running(call_id, dispatch_no, keys, now, worker[:200], record, folded)
        if started is None:
            return Started("stale", reason="claimed by another delivery")
        return Started("started", call=started[0], attempt=started[1], capped=capped)

    def start_many(
        self, deliveries: Sequence[tuple[int, int]], worker: str = "", *, may_wait: timedelta = timedelta(0)
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
        if not sql.postgresql_path(self.db) or len(deliveries) < 2:
            return [
                self.start(call_id, dispatch_no, worker, may_wait=may_wait) for call_id, dispatch_no in deliveries
            ]
        with connections[self.db].cursor() as cursor:
            cursor.execute(sql.call_heads(), [[call_id for call_id, _ in deliveries]])
            heads = {row[0]: row[1:] for row in cursor.fetchall()}
        results: dict[int, Started] = {}
        live: list[tuple[int, int, int, list[str], dict[str, int]]] = []
        seen: set[int] = set()
        for index, (call_id, dispatch_no) in enumerate(deliveries):
            head = heads.get(call_id)
            if head is None or call_id in seen:
                results[index] = Started("stale", reason="no such call" if head is None else "twice in one message")
            elif head[1] != Status.DISPATCHED or head[2] != dispatch_no:
                results[index] = Started(
                    "stale", reason=f"call is {head[1]} (dispatch {head[2]}), message was for dispatch {dispatch_no}"
                )
            else:
                keys = parse_key_set(head[0])
                cost = _json_value(head[3]) or {}
                live.append((index, call_id, dispatch_no, keys, {key: cost.get(key, 1) for key in keys}))
                seen.add(call_id)
        try:
            results.update(folding(lambda fold: self._start_group(live, worker, may_wait, fold=fold)))
        except _GroupRaced:
            for index, call_id, dispatch_no, _, _ in live:
                results[index] = self.start(call_id, dispatch_no, worker, may_wait=may_wait)
        return [results[index] for index in range(len(deliveries))]

    def _start_group(
        self, live: list[tuple[int, int, int, list[str], dict[str, int]]], worker: str, may_wait: timedelta,
        *, fold: bool,
    ) -> dict[int, Started]:
        """Start (or defer) the live deliveries of a message in one transaction; see start_many()."""
        results: dict[int, Started] = {}
        if not live:
            return results
        all_keys = sorted({key for _, _, _, keys, _ in live for key in keys})
        with start_transaction(self.db, fold) as folded:
            states = limiter.lock_keys(all_keys, using=self.db, folded=folded)
            policies, now, read = limiter.policies_for_start(all_keys, states, using=self.db)
            group = limiter.Group(states, policies, now, limiter.assess(
                all_keys, states, now, policies, for_start=True, read=read, using=self.db
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
                        "early", reason=f"{verdict.key}: {verdict.reason}", wait=verdict.until - now
                    )
                    continue
                until = verdict.until or now + timedelta(seconds=1)
                deferred = self.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
                    status=Status.PENDING, dispatched_at=None, run_at=until
                )
                if not deferred:
                    raise _GroupRaced
                limiter.adjust(keys, reserved=-1, units=costs, using=self.db)
                results[index] = Started("deferred", reason=f"{verdict.key}: {verdict.reason}")
            if admitted:
                started = self._mark_running_group(admitted, now, worker, group, folded)
                if len(started) < len(admitted):
                    raise _GroupRaced  # rolls back the whole group
                for index, call_id, _, _, capped in admitted:
                    call, attempt = started[call_id]
                    results[index] = Started("started", call=call, attempt=attempt, capped=capped)
        return results

    def _mark_running_group(
        self, admitted: list[tuple[int, int, int, limiter.StartRecord, bool]], now: datetime, worker: str,
        group: limiter.Group, folded: Folded | None = None,
    ) -> dict[int, tuple[CallQueue, Attempt]]:
        """One statement (``sql.mark_running_group``): mark the admitted calls running, open their
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
        statement = sql.mark_running_group()
        with connections[self.db].cursor() as cursor:
            cursor.execute(folded.commit(statement) if folded else statement, params)
            rows = cursor.fetchall()
        started: dict[int, tuple[CallQueue, Attempt]] = {}
        for row in rows:
            call, attempt = self._started_from_row(row, now, worker)
            started[call.id] = (call, attempt)
        return started

    def _started_from_row(self, row: Sequence[Any], now: datetime, worker: str) -> tuple[CallQueue, Attempt]:
        """The call and attempt a start statement returned (the attempt's id and number, then the call).

        The start's time is the call's ``started_at``: the statement's own clock, never before ``now``.
        """
        call = _call_from_row(self.model, self.db, row[2:])
        attempt = tables.Attempt(id=row[0], call=call, number=row[1], started_at=call.started_at or now, worker=worker)
        attempt._state.adding, attempt._state.db = False, self.db
        return call, attempt

    def _mark_running(
        self, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
        record: limiter.StartRecord | None, folded: Folded | None = None,
    ) -> tuple[CallQueue, Attempt] | None:
        """Mark the call running, log its starts and open its attempt; None if the delivery is stale."""
        record = record or limiter.StartRecord()
        if self._on_postgresql():
            return self._mark_running_postgresql(call_id, dispatch_no, keys, now, worker, record, folded)
        return self._mark_running_portable(call_id, dispatch_no, keys, now, worker, record)

    def _mark_running_portable(
        self, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
        record: limiter.StartRecord,
    ) -> tuple[CallQueue, Attempt] | None:
        """The guarded update, then the call read back, its attempt, the start log and buckets, the counters."""
        won = self.filter(id=call_id, status=Status.DISPATCHED, dispatch_no=dispatch_no).update(
            status=Status.RUNNING, started_at=now, attempts=F("attempts") + 1
        )
        if not won:
            return None
        call = self.get(id=call_id)
        attempt = self._attempts().create(
            call=call, number=call.attempts + call.deferrals, started_at=now, worker=worker
        )
        limiter.record_starts(now, record, call_id, using=self.db)
        limiter.adjust(
            keys, reserved=-1, units={key: units for key, units, _ in record.log},
            totals={key: cum for key, _, cum in record.log}, using=self.db,
        )
        return call, attempt

    def _mark_running_postgresql(
        self, call_id: int, dispatch_no: int, keys: list[str], now: datetime, worker: str,
        record: limiter.StartRecord, folded: Folded | None,
    ) -> tuple[CallQueue, Attempt] | None:
        """The same as one statement (``sql.mark_running``), with a folded start's COMMIT."""
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
        statement = sql.mark_running()
        with connections[self.db].cursor() as cursor:
            cursor.execute(folded.commit(statement) if folded else statement, params)
            row = cursor.fetchone()
        if row is None:
            return None
        return self._started_from_row(row, now, worker)

    def _finish(
        self, call: CallQueue, attempt: Attempt, outcome: str, error: str, *, wake: bool = True, **changes: Any
    ) -> bool:
        keys = parse_key_set(call.key_set)
        error = error[:MAX_ERROR_CHARS]
        # No key is locked: running calls have no counter (a capped key counts its running calls
        # at each check, under its lock), so finishes never wait on the starts of their keys.
        if self._on_postgresql():
            won = self._finish_postgresql(call, attempt.id, keys, outcome, error, changes, wake)
        else:
            won = self._finish_portable(call, attempt.id, keys, outcome, error, changes, wake)
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
        return changes, changes.get("status") == Status.PENDING or (wake and bool(keys))

    def _finish_portable(
        self, call: CallQueue, attempt_id: int, keys: list[str], outcome: str, error: str,
        changes: dict[str, Any], wake: bool,
    ) -> bool:
        """The guarded update, the attempt, the wake-up; no key is locked (see ``_finish``)."""
        with transaction.atomic(using=self.db):
            now = db_now(self.db)
            changes, wake = self._finish_changes(changes, now, keys, wake)
            won = bool(self.filter(id=call.id, status=Status.RUNNING, dispatch_no=call.dispatch_no).update(**changes))
            if won:
                self._attempts().filter(id=attempt_id).update(
                    finished_at=now, outcome=outcome, error=error
                )
                if wake:
                    limiter.wake_dispensers(using=self.db)
        return won

    def _finish_postgresql(
        self, call: CallQueue, attempt_id: int, keys: list[str], outcome: str, error: str,
        changes: dict[str, Any], wake: bool,
    ) -> bool:
        """The same in one statement (``sql.finish``), atomic by itself."""
        now = db_now(self.db)
        changes, wake = self._finish_changes(changes, now, keys, wake)
        db = connections[self.db]
        values = [self.model._meta.get_field(name).get_db_prep_save(value, db) for name, value in changes.items()]
        params = [
            *values, call.id, Status.RUNNING, call.dispatch_no, now, outcome, error, attempt_id,
            limiter.WAKE_CHANNEL, wake,
        ]
        with db.cursor() as cursor:
            cursor.execute(sql.finish(tuple(changes)), params)
            return bool(cursor.fetchone()[0])

    def finish_done(self, call: CallQueue, attempt: Attempt, result: Any, *, wake: bool = True) -> bool:
        """Record a successful attempt and its result; ``wake=False`` when no key has a concurrency cap.

        On PostgreSQL one statement on the database's clock (``finish_done_many``'s), with no
        clock read before it.
        """
        if sql.postgresql_path(self.db):
            return self.finish_done_many([(call, attempt, result, wake)]) == 1
        return self._finish(
            call, attempt, Outcome.DONE, "", wake=wake, status=Status.DONE, result=result, finished_at=lambda now: now, last_error=""
        )

    def finish_done_many(self, done: Sequence[tuple[CallQueue, Attempt, Any, bool]]) -> int:
        """Record successful attempts (call, attempt, result, wake) together; return how many were won.

        On PostgreSQL one statement, as ``finish_done`` for one; a call rescued while it ran is
        not won (and logged), as there.
        """
        db = connections[self.db]
        if not sql.postgresql_path(self.db):
            return sum(self.finish_done(call, attempt, result, wake=wake) for call, attempt, result, wake in done)
        result_field = self.model._meta.get_field("result")
        params: dict[str, Any] = {
            "ids": [call.id for call, _, _, _ in done], "nos": [call.dispatch_no for call, _, _, _ in done],
            "attempts": [attempt.id for _, attempt, _, _ in done],
            "results": [result_field.get_db_prep_save(result, db) for _, _, result, _ in done],
            "wakes": [bool(wake) and bool(call.key_set) for call, _, _, wake in done],
            "done": Status.DONE, "outcome": Outcome.DONE, "running": Status.RUNNING, "channel": limiter.WAKE_CHANNEL,
        }
        with db.cursor() as cursor:
            cursor.execute(sql.finish_done_many(), params)
            won = {row[0] for row in cursor.fetchall()}
        for call, attempt, _, _ in done:
            if call.id not in won:
                log.warning("finish_lost call=%s attempt=%s outcome=done", call.id, attempt.number)
        return len(won)

    def finish_error(
        self, call: CallQueue, attempt: Attempt, error: str, tb: str, *, permanent: bool, wake: bool = True
    ) -> bool:
        """Record a failed attempt: retry with backoff while attempts remain, else fail."""
        error = error[:MAX_ERROR_CHARS]
        if permanent or call.attempts >= call.max_attempts:
            return self._finish(
                call, attempt, Outcome.FAILED if permanent else Outcome.ERROR, error, wake=wake,
                status=Status.FAILED, finished_at=lambda now: now, last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
            )
        delay = RetryPolicy.from_settings().delay(call.attempts)
        return self._finish(
            call, attempt, Outcome.ERROR, error, wake=wake,
            status=Status.PENDING, run_at=lambda now: now + delay, dispatched_at=None,
            last_error=error, last_traceback=tb[:MAX_ERROR_CHARS],
        )

    def finish_rate_limited(
        self, call: CallQueue, attempt: Attempt, retry_after: float | None, key: str | None, error: str
    ) -> bool:
        """Record a 429: pause the key, put the call back to wait, refund the attempt."""
        wait = timedelta(seconds=retry_after) if retry_after is not None else dispatcher_settings.DEFAULT_RETRY_AFTER
        # A downstream may ask for any pause; none lasts longer than DISPATCHER_MAX_PAUSE.
        wait = min(max(wait, timedelta(0)), dispatcher_settings.MAX_PAUSE)
        keys = parse_key_set(call.key_set)
        paused = [key] if key else keys
        max_deferrals = dispatcher_settings.MAX_DEFERRALS
        gives_up = max_deferrals is not None and call.deferrals + 1 > max_deferrals
        with transaction.atomic(using=self.db):
            limiter.lock_keys(sorted(set(keys) | set(paused)), using=self.db)
            now = db_now(self.db)
            until = now + wait
            fields: dict[str, Any] = {"deferrals": F("deferrals") + 1, "attempts": F("attempts") - 1, "last_error": error}
            if gives_up:
                fields.update(status=Status.FAILED, finished_at=now, last_error=f"{error} (gave up after {call.deferrals + 1} deferrals)")
            else:
                fields.update(status=Status.PENDING, run_at=until, dispatched_at=None)
            won = self.filter(id=call.id, status=Status.RUNNING, dispatch_no=call.dispatch_no).update(**fields)
            if not won:
                log.warning("finish_lost call=%s attempt=%s outcome=rate_limited", call.id, attempt.number)
                return False
            self._attempts().filter(id=attempt.id).update(
                finished_at=now, outcome=Outcome.RATE_LIMITED, error=error[:MAX_ERROR_CHARS]
            )
            limiter.pause(paused, until, reason=f"429 from call #{call.id}", using=self.db)
        return True

    def correct_cost(self, call: CallQueue, reported: int | Mapping[str, int]) -> dict[str, int]:
        """Correct the keys' usage to what a started call really cost; return the change per key.

        The call's rows in the start log take the reported units (and every later running
        total of the key moves with them); its buckets are charged or refunded the difference.
        """
        keys = parse_key_set(call.key_set)
        if isinstance(reported, Mapping):
            actual = {key: int(reported.get(key, call.cost_of(key))) for key in keys}
        else:
            actual = dict.fromkeys(keys, int(reported))
        deltas = {key: actual[key] - call.cost_of(key) for key in keys if actual[key] != call.cost_of(key)}
        if not deltas or call.started_at is None:
            return {}
        with transaction.atomic(using=self.db):
            limiter.lock_keys(keys, using=self.db)
            policies = limiter.Policies.load(self.db)
            now = db_now(self.db)
            starts = tables.KeyStart.objects.using(self.db)
            buckets = tables.KeyBucket.objects.using(self.db)
            for key, delta in deltas.items():
                start = starts.filter(key=key, started_at=call.started_at, call_id=call.id).first()
                if start is not None:
                    starts.filter(key=key, cum__gt=start.cum).exclude(id=start.id).update(cum=F("cum") + delta)
                    starts.filter(id=start.id).update(units=F("units") + delta, cum=F("cum") + delta)
                tables.KeyState.objects.using(self.db).filter(key=key).update(total=F("total") + delta)
                later: list[tuple[datetime, int]] | None = None
                for policy in policies.for_key(key):
                    if not isinstance(policy, limiter.TokenBucket):
                        continue
                    bucket = buckets.filter(key=key, period=policy.period).first()
                    if bucket is None or bucket.since > call.started_at:
                        # This bucket (new, or a new shape) never charged the start: nothing to
                        # give back, and an extra charge would count a start it did not see.
                        continue
                    if delta < 0 and later is None:
                        later = self._starts_after(key, call, start)
                    tat = policy.refund(limiter.from_us(bucket.tat_us), now, -bounded_charge(delta, policy.capacity()), later or ())
                    if tat is not None:
                        buckets.filter(id=bucket.id).update(tat_us=limiter.to_us(tat))
            if any(delta < 0 for delta in deltas.values()):
                limiter.wake_dispensers(using=self.db)
        return deltas

    def _starts_after(self, key: str, call: CallQueue, start: models.Model | None) -> list[tuple[datetime, int]]:
        """Return (time, units) of the key's starts after ``call``'s, in order, for a bucket's refund.

        Starts at the same instant are included whatever their order: they can only make the
        refund smaller, never give back units a later start still holds.
        """
        later = tables.KeyStart.objects.using(self.db).filter(key=key, started_at__gte=call.started_at)
        if start is not None:
            later = later.exclude(id=start.pk)
        return list(later.order_by("started_at", "id").values_list("started_at", "units"))

    # --- rescue --------------------------------------------------------------------------

    def rescue(self, batch: int | None = None) -> RescueReport:
        """Return calls stuck in dispatched or running past their timeout to waiting."""
        batch = batch or dispatcher_settings.RESCUE_BATCH
        report = RescueReport()
        now = db_now(self.db)
        dispatch_cutoff = now - dispatcher_settings.DISPATCH_TIMEOUT
        run_cutoff = now - dispatcher_settings.RUN_TIMEOUT
        stuck = list(
            self.filter(
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
                if self._fail_unreadable(self.filter(id=call_id, status__in=[Status.DISPATCHED, Status.RUNNING]), str(exc)):
                    report.failed += 1
                    report.ids.append(call_id)
                continue
            try:
                outcome = self._rescue_one(call_id, keys, dispatch_cutoff, run_cutoff, policy)
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
        self, call_id: int, keys: list[str], dispatch_cutoff: datetime, run_cutoff: datetime, policy: RetryPolicy
    ) -> str:
        """Return one stuck call to waiting (or fail it when out of attempts); say which it was, "" if neither."""
        with transaction.atomic(using=self.db):
            limiter.lock_keys(keys, using=self.db)
            call = self.select_for_update().filter(id=call_id).first()
            if call is None:
                return ""
            now = db_now(self.db)
            if call.status == Status.DISPATCHED and call.dispatched_at and call.dispatched_at < dispatch_cutoff:
                # Claimed but never started: the message was lost; no attempt was spent.
                self.filter(id=call_id).update(status=Status.PENDING, dispatched_at=None)
                limiter.adjust(keys, reserved=-1, units={key: call.cost_of(key) for key in keys}, using=self.db)
                outcome = Status.DISPATCHED
            elif call.status == Status.RUNNING and call.started_at and call.started_at < run_cutoff:
                # Started but never finished: the worker died; the attempt counts.
                error = f"lost: no result within DISPATCHER_RUN_TIMEOUT ({dispatcher_settings.RUN_TIMEOUT})"
                self._attempts().filter(call_id=call_id, outcome=Outcome.RUNNING).update(
                    outcome=Outcome.LOST, finished_at=now, error=error
                )
                if call.attempts >= call.max_attempts:
                    self.filter(id=call_id).update(status=Status.FAILED, finished_at=now, last_error=error)
                    outcome = Status.FAILED
                else:
                    self.filter(id=call_id).update(
                        status=Status.PENDING, dispatched_at=None, run_at=now + policy.delay(call.attempts), last_error=error
                    )
                    outcome = Status.RUNNING
            else:
                return ""
            limiter.wake_dispensers(using=self.db)
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
        batch = batch or dispatcher_settings.PRUNE_BATCH
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        if older_than < timedelta(0):
            raise ValueError("older_than cannot be negative")
        longest = max([timedelta(0), *tables.RateLimit.objects.using(self.db).values_list("period", flat=True)])
        cutoff = db_now(self.db) - max(older_than, longest)
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
                self._attempts().filter(call_id__in=ids)._raw_delete(self.db)
                deleted += self.filter(id__in=ids).finished().filter(finished_at__lt=cutoff)._raw_delete(self.db)
            if progress is not None:
                progress(deleted, total)
        limiter.prune_starts(using=self.db)
        return deleted

    # --- operator actions ----------------------------------------------------------------

    def retry_now(self, ids: Iterable[int]) -> int:
        """Make waiting calls due now and give failed calls one more attempt; return how many."""
        ids = list(ids)
        with transaction.atomic(using=self.db):
            now = db_now(self.db)
            waiting = self.filter(id__in=ids, status=Status.PENDING).update(run_at=now)
            failed = self.filter(id__in=ids, status=Status.FAILED).update(
                status=Status.PENDING, run_at=now, finished_at=None,
                max_attempts=models.Case(
                    models.When(attempts__gte=F("max_attempts"), then=F("attempts") + 1),
                    default=F("max_attempts"),
                    output_field=models.PositiveIntegerField(),
                ),
            )
            limiter.wake_dispensers(using=self.db)
        return waiting + failed

    def cancel(self, ids: Iterable[int]) -> int:
        """Cancel waiting calls; calls in flight or finished are left alone."""
        with transaction.atomic(using=self.db):
            now = db_now(self.db)
            return self.filter(id__in=list(ids), status=Status.PENDING).update(status=Status.CANCELLED, finished_at=now)


class RateLimitManager(models.Manager["RateLimit"]):
    """Edits of rate policies and pauses, shared by the command, the admin and settings."""

    def set_policy(
        self,
        key: str,
        limit: int,
        period: timedelta,
        concurrency: int | None = None,
        *,
        burst: int | None = None,
        replacing: int | None = None,
    ) -> RateLimit:
        """Create or update the policy of ``key`` for ``period``: a window, or a bucket with ``burst``.

        ``replacing``: the id of the policy this edits (the admin's change form); a new key or
        period makes a new policy, so that one is deleted (with its wake-up) in the same transaction.
        """
        validate_policy_key(key)
        validate_shape(limit, period, burst, concurrency)
        with transaction.atomic(using=self.db):
            if replacing is not None:
                moved = self.filter(pk=replacing).exclude(key=key, period=period).values_list("key", "period").first()
                if moved is not None:
                    self.delete_policies(*moved)
            if not is_pattern(key):
                # Serialise with starts of the key, which read the policies under this lock.
                limiter.lock_keys([key], using=self.db)
            old = self.filter(key=key, period=period).first()
            policy, _ = self.update_or_create(
                key=key, period=period, defaults={"limit": limit, "concurrency": concurrency, "burst": burst}
            )
            self._carry_buckets(old, policy, db_now(self.db))
            limiter.wake_dispensers(using=self.db)
        return policy

    def delete_policies(self, key: str, period: timedelta | None = None) -> int:
        """Delete the policies of ``key`` (only the one of ``period`` if given); return how many.

        Locked and woken as ``set_policy`` is: a start of the key reads the policies under its
        lock, and a dispenser waiting on the deleted policy is woken to send what it held back.
        """
        with transaction.atomic(using=self.db):
            if not is_pattern(key):
                limiter.lock_keys([key], using=self.db)
            policies = self.filter(key=key)
            if period is not None:
                policies = policies.filter(period=period)
            deleted, _ = policies.delete()
            if deleted:
                limiter.wake_dispensers(using=self.db)
        return deleted

    def _carry_buckets(self, old: RateLimit | None, new: RateLimit, now: datetime) -> None:
        """Carry the units a key's bucket still owes into the edited policy (a new shape starts afresh)."""
        buckets = tables.KeyBucket.objects.using(self.db).filter(period=new.period)
        if is_pattern(new.key):
            buckets = buckets.filter(key__startswith=new.key[:-1])
        else:
            buckets = buckets.filter(key=new.key)
        guard = dispatcher_settings.ARRIVAL_GUARD
        before = old.as_policy().with_guard(guard) if old is not None else None
        after = new.as_policy().with_guard(guard)
        if not (isinstance(before, limiter.TokenBucket) and isinstance(after, limiter.TokenBucket)):
            buckets.delete()
            return
        for bucket in buckets.filter(tat_us__gt=limiter.to_us(now)):
            tat = before.rebase(limiter.from_us(bucket.tat_us), now, after)
            tables.KeyBucket.objects.using(self.db).filter(id=bucket.id).update(tat_us=limiter.to_us(tat))

    def pause_key(self, key: str, duration: timedelta, reason: str = "paused by operator") -> datetime:
        """Pause a key (or every key a pattern matches) for a duration from now."""
        validate_policy_key(key)
        if duration <= timedelta(0):
            raise ValueError("a pause must last longer than zero")
        with transaction.atomic(using=self.db):
            until = db_now(self.db) + duration
            limiter.pause([key], until, reason, using=self.db)
        return until

    def resume_key(self, key: str) -> int:
        """Lift the pause of a key (or pattern); return how many pauses were lifted."""
        with_pause = tables.KeyState.objects.using(self.db).filter(key=key, paused_until__isnull=False)
        lifted = with_pause.update(paused_until=None, pause_reason="")
        limiter.wake_dispensers(using=self.db)
        return lifted

    def seed_from_settings(self) -> int:
        """Upsert the policies listed in DISPATCHER_RATE_LIMITS; return how many."""
        count = 0
        for entry in dispatcher_settings.RATE_LIMITS:
            try:
                self.set_policy(
                    entry["key"],
                    int(entry["limit"]),
                    parse_positive_duration(entry["period"]),
                    int(entry["concurrency"]) if entry.get("concurrency") else None,
                    burst=int(entry["burst"]) if entry.get("burst") is not None else None,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ImproperlyConfigured(f"DISPATCHER_RATE_LIMITS entry {entry!r}: {exc}") from exc
            count += 1
        return count
