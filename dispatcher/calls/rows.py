"""Reading stored call rows: raw rows into instances, stored values checked, unreadable rows failed."""
from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import connections, models

from dispatcher import tables
from dispatcher.clock import db_now
from dispatcher.costs import clean_cost
from dispatcher.exceptions import InvalidCost
from dispatcher.states import CallStatus as Status

if TYPE_CHECKING:
    from dispatcher.managers import CallQueueManager, CallQueueQuerySet
    from dispatcher.models import Attempt, CallQueue

log = logging.getLogger("dispatcher")


def json_value(value: Any) -> Any:
    """Return a JSON column's value from a raw cursor (Django has the driver hand back the text)."""
    return json.loads(value) if isinstance(value, str) else value


def call_from_row(model: type[CallQueue], db: str, row: Sequence[Any]) -> CallQueue:
    """Build a call from a raw row of all its columns, converted as the ORM would."""
    connection_ = connections[db]
    values = []
    for model_field, value in zip(model._meta.concrete_fields, row, strict=True):
        # Field.get_db_converters is Django's (the compiler calls it); the 5.2 stubs leave it out.
        for convert in model_field.get_db_converters(connection_):  # type: ignore[attr-defined]
            value = convert(value, None, connection_)
        values.append(value)
    return model.from_db(db, [f.attname for f in model._meta.concrete_fields], values)


def unreadable_cost(cost: Any, keys: Sequence[str]) -> str:
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


def attempts(manager: CallQueueManager) -> models.QuerySet[Attempt]:
    """The attempts, on this manager's database."""
    return tables.Attempt.objects.using(manager.db)


def fail_unreadable(manager: CallQueueManager, calls: CallQueueQuerySet, problem: str) -> int:
    """Mark calls whose stored row cannot be read failed, saying why, so they stop no pass or sweep."""
    failed = calls.update(
        status=Status.FAILED, dispatched_at=None, finished_at=db_now(manager.db), last_error=f"unreadable row: {problem}"
    )
    log.error("unreadable_calls failed=%s error=%r", failed, problem)
    return failed
