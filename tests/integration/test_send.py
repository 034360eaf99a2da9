"""send() and send_many(): what is stored, and bad input refused with nothing stored."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db(transaction=True)


def test_send_stores_a_pending_call_with_keys_from_the_handler():
    call = CallQueue.objects.send("greet", {"name": "ada"}, priority=5)
    stored = CallQueue.objects.get(pk=call.pk)
    assert stored.status == CallQueue.Status.PENDING
    assert stored.keys == ["greeter", "greeter:ada"]
    assert stored.priority == 5 and stored.attempts == 0 and stored.max_attempts == 3
    assert stored.created_at is not None and stored.run_at is not None
    assert call.created_at == stored.created_at


def test_send_joins_the_callers_transaction_and_a_rollback_removes_the_call():
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        CallQueue.objects.send("greet", {"name": "ada"})
        raise Abort
    assert not CallQueue.objects.exists()


def test_send_many_stores_every_call_in_one_statement():
    specs = [{"method": "greet", "params": {"name": f"n{i}"}} for i in range(50)]
    with CaptureQueriesContext(connection) as captured:
        calls = CallQueue.objects.send_many(specs)
    inserts = [q for q in captured.captured_queries if q["sql"].lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1
    assert len(calls) == 50 and all(c.pk for c in calls)
    assert CallQueue.objects.count() == 50


def test_send_many_stores_nothing_if_one_call_is_bad():
    specs = [{"method": "greet", "params": {"name": "ok"}}, {"method": "greet", "params": {"name": ""}}]
    with pytest.raises(ValueError, match="call 1"):
        CallQueue.objects.send_many(specs)
    assert not CallQueue.objects.exists()


def test_run_at_with_timezone_delays_the_call():
    later = datetime.now(UTC) + timedelta(hours=1)
    call = CallQueue.objects.send("noop", {}, run_at=later)
    assert CallQueue.objects.get(pk=call.pk).run_at == later


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"method": "no_such_method"}, "unknown method"),
        ({"method": "noop", "params": ["not", "an", "object"]}, "JSON object"),
        ({"method": "noop", "params": "text"}, "JSON object"),
        ({"method": "noop", "params": {"x": object()}}, "JSON-serialisable"),
        ({"method": "noop", "params": {"x": float("nan")}}, "JSON-serialisable"),
        ({"method": "noop", "params": {"x": "a" * 70_000}}, "limit is"),
        ({"method": "noop", "params": {"x": "\ud800"}}, "not valid Unicode"),
        ({"method": "noop", "params": {"x": "a\x00b"}}, "NUL"),
        ({"method": "greet", "params": {"name": 3}}, "non-empty string"),
        ({"method": "greet", "params": {}}, "non-empty string"),
        ({"method": "noop", "run_at": datetime(2030, 1, 1)}, "timezone"),
        ({"method": "noop", "run_at": "tomorrow"}, "datetime"),
        ({"method": "noop", "priority": "high"}, "priority"),
        ({"method": "noop", "max_attempts": 0}, "max_attempts"),
        ({"method": "noop", "keys": "one-string"}, "list"),
        ({"method": "noop", "keys": ["pattern*"]}, "'\\*'"),
        ({"method": "noop", "queue": "has space"}, "queue"),
        ({"method": "http", "params": {"method": "GET", "url": "http://example.com/"}}, "not in DISPATCHER_HTTP_ALLOWED_HOSTS"),
        ({"method": "http", "params": {"method": "GET", "url": "ftp://127.0.0.1/"}}, "http and https"),
        ({"method": "http", "params": {"method": "BREW", "url": "http://127.0.0.1/"}}, "'method' must be one of"),
        ({"method": "http", "params": {"method": "GET", "url": "http://127.0.0.1/", "cookie": 1}}, "unknown params"),
    ],
)
def test_bad_input_raises_a_clear_value_error_and_stores_nothing(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CallQueue.objects.send(**kwargs)
    assert not CallQueue.objects.exists()


def test_deeply_nested_params_are_refused():
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(ValueError, match="nested too deeply"):
        CallQueue.objects.send("noop", deep)
    assert not CallQueue.objects.exists()


def test_http_call_to_an_allowed_host_is_stored():
    call = CallQueue.objects.send(
        "http", {"method": "POST", "url": "http://127.0.0.1:9/x", "json": {"a": 1}}, keys=["partner"]
    )
    assert call.keys == ["partner"] and call.method == "http"


def test_a_key_with_a_lone_surrogate_is_refused_before_the_database_sees_it():
    with pytest.raises(ValueError, match="valid Unicode"):
        CallQueue.objects.send("noop", {}, keys=["tenant:\ud800"])
    assert not CallQueue.objects.exists()
