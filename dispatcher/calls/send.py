"""Send: validate a call's arguments and store it (one or many) in the caller's transaction."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from django.db import IntegrityError, connections, models, transaction

from dispatcher.calls import once
from dispatcher.conf import dispatcher_settings
from dispatcher.costs import clean_cost
from dispatcher.exceptions import CostNeverFits, InvalidCall, InvalidParams
from dispatcher.keys import key_set, resolve_keys
from dispatcher.limits import catalog
from dispatcher.registry import get_handler
from dispatcher.states import CallStatus as Status
from dispatcher.store import schema
from dispatcher.store.inserts import NewCall, insert_many, insert_many_once, insert_one, insert_one_once
from dispatcher.validation import OutOfBounds, check_json, check_moment

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager
    from dispatcher.models import CallQueue

log = logging.getLogger("dispatcher")


INT32_MAX = 2**31 - 1


class SendOptions(TypedDict, total=False):
    """The keyword arguments of send() and build() (send() says what each means)."""

    keys: Iterable[str] | None
    priority: int
    run_at: datetime | None
    max_attempts: int | None
    queue: str | None
    cost: int | Mapping[str, int] | None
    unique_key: str | None
    unique_for: timedelta | str | None
    on_duplicate: str


SEND_ARGUMENTS = {"method", "params", *SendOptions.__optional_keys__}


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
    return int(value)


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
    def policies(self) -> catalog.Policies:
        # Read only for a call that costs more than 1 unit somewhere: 1 unit fits every policy.
        return catalog.Policies.load(self.db)


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
    unique_key: Any = None,
    unique_for: Any = None,
    on_duplicate: Any = "keep",
) -> NewCall:
    """Validate send()'s arguments and return the call to store; raise an InvalidCall (a ValueError) if bad."""
    handler = get_handler(method)
    unique = once.clean_unique(unique_key, unique_for, on_duplicate)
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
    return NewCall(method, clean, text, call_keys, key_set(call_keys), priority, queue, max_attempts, run_at, units, unique)


def _bulk_create_whole(manager: models.Manager[Any], objs: list[Any]) -> list[Any]:
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


def send_one(
    manager: CallQueueManager, method: str, params: Mapping[str, Any] | None = None, **options: Unpack[SendOptions]
) -> CallQueue:
    """Store one call in the caller's transaction and return the saved row (``CallQueue.objects.send``)."""
    call = _clean_call(_SendSettings(manager.db), method, params, **options)
    postgresql = schema.postgresql_path(manager.db)
    if call.unique is not None:
        tried: list[CallQueue | None] | None = None
        if postgresql:
            # The common case in one statement and no more: the key is free, the call stored.
            stored = insert_one_once(manager.model, manager.db, connections[manager.db], call, Status.PENDING)
            if stored is not None:
                stored.created = True
                return stored
            tried = [None]
        return once.send_once(manager, [call], _store_skipping(manager), tried)[0]
    if postgresql:
        row: CallQueue = insert_one(manager.model, manager.db, connections[manager.db], call, Status.PENDING)
    else:
        row = manager.model(**call.fields(Status.PENDING))
        row.save(force_insert=True, using=manager.db)
    row.created = True
    return row


def send_many(manager: CallQueueManager, calls: Iterable[Mapping[str, Any]]) -> list[CallQueue]:
    """Store many calls (each a dict of send()'s arguments) in one statement; all or none."""
    settings = _SendSettings(manager.db)
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
    if any(call.unique is not None for call in cleaned):
        # All or none: a holder found may still refuse a call (replace of another method), and a
        # call whose holder let go meanwhile is stored by a second statement.
        with transaction.atomic(using=manager.db):
            return once.send_once(manager, cleaned, _store_skipping(manager))
    if schema.postgresql_path(manager.db):
        # One statement: every row is stored or none, without a transaction of its own.
        rows = insert_many(manager.model, manager.db, connections[manager.db], cleaned, Status.PENDING)
    else:
        rows = _bulk_create_whole(manager, [manager.model(**call.fields(Status.PENDING)) for call in cleaned])
    for row in rows:
        row.created = True
    return rows


def _store_skipping(manager: CallQueueManager) -> once.Store:
    """Return how this database stores calls with unique keys, skipping those whose key is held."""
    connection = connections[manager.db]
    if schema.postgresql_path(manager.db):
        def store_postgresql(calls: list[NewCall]) -> list[CallQueue | None]:
            if len(calls) == 1:
                return [insert_one_once(manager.model, manager.db, connection, calls[0], Status.PENDING)]
            return insert_many_once(manager.model, manager.db, connection, calls, Status.PENDING)
        return store_postgresql

    def store_portable(calls: list[NewCall]) -> list[CallQueue | None]:
        # All at once in a savepoint; if a key is held, all but the held ones (a send_many holds
        # SQLite's write lock by then, so none is taken meanwhile); else one savepoint per call.
        for attempt in range(2 if len(calls) > 1 else 0):
            held = once.held_keys(manager, [call.unique.key for call in calls if call.unique]) if attempt else set()
            free = [call for call in calls if call.unique is None or call.unique.key not in held]
            try:
                with transaction.atomic(using=manager.db):
                    rows = iter(_bulk_create_whole(manager, [manager.model(**c.fields(Status.PENDING)) for c in free]))
            except IntegrityError:
                continue
            return [None if call.unique is not None and call.unique.key in held else next(rows) for call in calls]
        stored: list[CallQueue | None] = []
        for call in calls:
            row = manager.model(**call.fields(Status.PENDING))
            try:
                with transaction.atomic(using=manager.db):
                    row.save(force_insert=True, using=manager.db)
            except IntegrityError:
                stored.append(None)
            else:
                stored.append(row)
        return stored
    return store_portable
