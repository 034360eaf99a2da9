"""send() and send_many() return exactly what they stored, in the order given, on either database."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from django.db import connection, transaction

from dispatcher import registry
from dispatcher.models import CallQueue
from dispatcher.registry import handler
from support.processes import database_url

pytestmark = pytest.mark.django_db(transaction=True)

SPECS: list[dict[str, Any]] = [
    {"method": "noop"},
    {"method": "noop", "params": {"text": "ünïcödé ✓ 😀 \u2028 \"quoted\" \\ back", "n": 1.5, "big": 2**62, "list": [1, None]}},
    {"method": "greet", "params": {"name": "ada"}, "keys": ["tenant:7"], "priority": -3},
    {"method": "noop", "params": {"nested": {"b": [True, False], "a": {}}}, "max_attempts": 9, "queue": "slow"},
    {"method": "noop", "run_at": datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))},
    {"method": "noop", "params": {"tuple": (1, 2), 3: "int key"}, "keys": ["k:é", "k:é", "other"]},
]


def _columns(call: CallQueue) -> dict[str, Any]:
    return {field.attname: getattr(call, field.attname) for field in CallQueue._meta.concrete_fields}


def _assert_same_as_stored(calls: list[CallQueue]) -> None:
    stored = CallQueue.objects.in_bulk([call.pk for call in calls])
    for call in calls:
        assert _columns(call) == _columns(stored[call.pk])
        assert call._state.adding is False and call._state.db == "default"


def test_send_returns_the_row_as_stored():
    calls = [CallQueue.objects.send(**spec) for spec in SPECS]
    _assert_same_as_stored(calls)
    assert calls[5].params == {"tuple": [1, 2], "3": "int key"} and calls[5].keys == ["k:é", "other"]
    assert calls[0].run_at == calls[0].created_at


def test_send_many_returns_the_rows_as_stored_in_the_order_given():
    specs = SPECS * 5
    calls = CallQueue.objects.send_many(specs)
    assert [call.pk for call in calls] == sorted(call.pk for call in calls)
    assert [call.method for call in calls] == [spec["method"] for spec in specs]
    assert [call.params for call in calls][:2] == [{}, SPECS[1]["params"]]
    _assert_same_as_stored(calls)


def test_send_many_and_send_store_identical_rows():
    one_by_one = [CallQueue.objects.send(**spec) for spec in SPECS]
    together = CallQueue.objects.send_many(SPECS)
    ignored = {"id", "run_at", "created_at"}
    for single, many in zip(one_by_one, together, strict=True):
        fresh_single, fresh_many = CallQueue.objects.get(pk=single.pk), CallQueue.objects.get(pk=many.pk)
        assert {k: v for k, v in _columns(fresh_single).items() if k not in ignored} == {
            k: v for k, v in _columns(fresh_many).items() if k not in ignored
        }
    assert together[4].run_at == SPECS[4]["run_at"]


def test_send_many_keeps_input_order_for_thousands_of_calls():
    calls = CallQueue.objects.send_many([{"method": "noop", "params": {"i": i}} for i in range(3000)])
    stored = dict(CallQueue.objects.values_list("id", "params"))
    assert [stored[call.pk]["i"] for call in calls] == list(range(3000))


def test_send_many_of_no_calls_stores_nothing():
    assert CallQueue.objects.send_many([]) == []
    assert CallQueue.objects.send_many(iter(())) == []
    assert not CallQueue.objects.exists()


def test_a_bad_call_in_the_middle_of_send_many_stores_nothing():
    specs = [{"method": "noop", "params": {"i": i}} for i in range(10)]
    specs[5] = {"method": "noop", "priority": "high"}
    with pytest.raises(ValueError, match=r"^call 5: priority must be a whole number"):
        CallQueue.objects.send_many(specs)
    assert not CallQueue.objects.exists()


def test_send_many_inside_a_rolled_back_transaction_stores_nothing():
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        CallQueue.objects.send_many([{"method": "noop"}, {"method": "noop"}])
        assert CallQueue.objects.count() == 2
        raise Abort
    assert not CallQueue.objects.exists()


def test_send_inside_a_rolled_back_transaction_stores_nothing_and_later_sends_work():
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        call = CallQueue.objects.send("noop", {"a": 1})
        assert CallQueue.objects.filter(pk=call.pk).exists()
        raise Abort
    assert not CallQueue.objects.exists()
    kept = CallQueue.objects.send("noop", {"a": 2})
    assert list(CallQueue.objects.values_list("id", flat=True)) == [kept.pk]


def test_calls_of_one_send_many_share_the_statement_clock():
    with transaction.atomic():
        first = CallQueue.objects.send("noop")
        batch = CallQueue.objects.send_many([{"method": "noop"}, {"method": "noop"}])
    assert batch[0].created_at == batch[1].created_at == batch[0].run_at
    assert first.created_at <= batch[0].created_at


def test_a_validator_sees_the_params_as_stored():
    seen: list = []
    handler("test.record", validator=seen.append)(lambda **params: None)
    try:
        call = CallQueue.objects.send("test.record", {"t": (1, 2)})
    finally:
        registry._registry.pop("test.record", None)
    assert seen == [{"t": [1, 2]}] and CallQueue.objects.get(pk=call.pk).params == {"t": [1, 2]}


def test_run_at_is_stored_to_the_microsecond_in_any_timezone():
    when = datetime(2030, 1, 1, 0, 0, 0, 1, tzinfo=timezone(timedelta(hours=-5, minutes=-30)))
    single = CallQueue.objects.send("noop", run_at=when)
    (many,) = CallQueue.objects.send_many([{"method": "noop", "run_at": when}])
    for call in (single, many):
        assert CallQueue.objects.get(pk=call.pk).run_at == when == when.astimezone(UTC)


@pytest.mark.postgres
def test_send_many_on_postgres_wakes_dispensers_with_one_notification():
    import psycopg

    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as listener:
        listener.execute("LISTEN dispatcher_wake")
        CallQueue.objects.send_many([{"method": "noop"} for _ in range(100)])
        notes = list(listener.notifies(timeout=1.0))
    assert len(notes) == 1


@pytest.mark.parametrize("queue", ["a\x00b", "a\ud800", "tab\there", "bell\x07"])
def test_a_queue_name_no_column_can_store_is_refused_before_the_database_sees_it(queue):
    with pytest.raises(ValueError, match="queue must be a Celery queue name"):
        CallQueue.objects.send("noop", queue=queue)
    with pytest.raises(ValueError, match="call 0: queue must be a Celery queue name"):
        CallQueue.objects.send_many([{"method": "noop", "queue": queue}])
    assert not CallQueue.objects.exists()
