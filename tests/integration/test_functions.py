"""The hot statements as PL/pgSQL functions (``dispatcher.store.functions``): installed by migrate,
called where installed, the statements inline where not, and the same rows either way.

Transactional tests: a start is the worker's own transaction, and the functions are created and
dropped as a site's migrate would.
"""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from dispatcher import dispenser as dispenser_module
from dispatcher.calls import start as start_module
from dispatcher.dispenser import Dispenser
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue
from dispatcher.states import CallStatus
from dispatcher.store import call_sql, functions
from dispatcher.worker import execute

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def published(monkeypatch):
    """Record what the dispenser publishes instead of writing to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.extend(calls))
    return sent


@pytest.fixture
def dropped():
    """The functions dropped as a database migrated by older code would lack them; installed again after."""
    with connection.cursor() as cursor:
        for function in functions.every("default"):
            cursor.execute(f"DROP FUNCTION {function.name}")
    functions.forget()
    yield
    functions.install("default")


def _run(published: list, key: str, n: int) -> list[str]:
    """Send n calls of ``key``, dispense them and run each in this process: their outcomes, in order."""
    published.clear()
    for _ in range(n):
        CallQueue.objects.send("noop", keys=[key])
    assert Dispenser().run_once().moved == n
    return [execute(call.id, call.dispatch_no) for call in sorted(published, key=lambda c: c.id)]


def _sent(queries: CaptureQueriesContext) -> str:
    return "\n".join(query["sql"] for query in queries.captured_queries)


def _policies() -> None:
    edit.set_policy("window", 100, timedelta(minutes=1))
    edit.set_policy("bucket", 100, timedelta(minutes=1), burst=10)


def test_migrate_installs_them_and_passes_and_starts_call_them(published):
    _policies()
    functions.forget()
    assert functions.installed("default")
    with CaptureQueriesContext(connection) as queries:
        assert _run(published, "window", 2) + _run(published, "bucket", 2) == ["done"] * 4
    sent = _sent(queries)
    for function in (functions.key_sets(), functions.claim("default"), functions.mark(False, "default"),
                     functions.mark(True, "default"), functions.finish_done()):
        assert function.name in sent
    # Not the statements themselves.
    assert "FOR UPDATE SKIP LOCKED" not in sent and "AS d(id, dispatch_no)" not in sent
    assert Attempt.objects.filter(outcome="done").count() == 4


def test_without_them_the_statements_run_inline_and_calls_run_as_before(published, dropped):
    _policies()
    assert not functions.installed("default")
    with CaptureQueriesContext(connection) as queries:
        assert _run(published, "window", 2) + _run(published, "bucket", 2) == ["done"] * 4
    sent = _sent(queries)
    assert "dispatcher_claim_" not in sent and "dispatcher_mark_" not in sent
    # The statements themselves (as logged, with their parameters): the claim's and the mark's.
    assert "FOR UPDATE SKIP LOCKED" in sent and "AS d(id, dispatch_no)" in sent
    assert set(CallQueue.objects.values_list("status", flat=True)) == {CallStatus.DONE}

    # Migrate (its post_migrate) installs them, and this process calls them from then on.
    functions.install("default")
    with CaptureQueriesContext(connection) as queries:
        assert _run(published, "bucket", 1) == ["done"]
    assert functions.mark(True, "default").name in _sent(queries)


def test_install_leaves_another_versions_functions_for_the_processes_still_running_it():
    older = "dispatcher_claim_000000000000"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE FUNCTION {older}() RETURNS integer LANGUAGE sql AS 'SELECT 1'")
    try:
        functions.install("default")
        with connection.cursor() as cursor:
            cursor.execute("SELECT to_regproc(%s) IS NOT NULL", [older])
            assert cursor.fetchone()[0]
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP FUNCTION {older}")


def _both(statement: str, function: functions.Function, params: dict) -> tuple[list, list]:
    """The rows of ``statement`` and of ``function``'s call with the same params, each in a
    transaction rolled back (a claim writes)."""
    rows = []
    for sql in (statement, function.statement):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                rows.append(cursor.fetchall())
            transaction.set_rollback(True)
    return rows[0], rows[1]


def test_each_function_returns_what_its_statement_returns():
    now = timezone.now()
    for key, due in (("a", now - timedelta(seconds=5)), ("a", now - timedelta(seconds=1)), ("b", now),
                     ("c", now + timedelta(minutes=5)), ("d", now + timedelta(minutes=1))):
        call = CallQueue.objects.send("noop", {"k": key}, keys=[key], run_at=due, priority=1 if key == "b" else 0)
        CallQueue.objects.filter(id=call.id).update(cost={"units": 2} if key == "a" else None)
    claim = {
        "dispatched": CallStatus.DISPATCHED, "pending": CallStatus.PENDING, "now": now,
        "key_sets": ['["a"]', '["b"]', '["c"]'], "wanted": [5, 1, 3],
    }
    inline, called = _both(call_sql.claim_due(), functions.claim("default"), claim)
    assert sorted(inline) == sorted(called) and len(called) == 3
    inline, called = _both(call_sql.waiting_key_sets_with_version(), functions.key_sets(), {"after": "", "limit": 3})
    assert [row[1:] for row in inline] == [row[1:] for row in called] == [(called[0][1], ['["a"]', '["b"]', '["c"]'])]
    for moment in (now, None):
        inline, called = _both(call_sql.next_due(), functions.next_due(), {"now": moment})
        assert inline == called
    assert called[0][0] == CallQueue.objects.get(key_set='["d"]').run_at

    running = CallQueue.objects.get(key_set='["b"]')
    CallQueue.objects.filter(id=running.id).update(status=CallStatus.RUNNING, dispatch_no=1, started_at=now)
    attempt = Attempt.objects.create(call=running, number=1, started_at=now)
    finish = {
        "ids": [running.id, 10**9], "nos": [1, 1], "attempts": [attempt.id, 10**9],
        "results": [CallQueue._meta.get_field("result").get_db_prep_save(v, connection) for v in ({"ok": 1}, None)],
        "wakes": [True, False], "done": CallStatus.DONE, "outcome": "done", "running": CallStatus.RUNNING,
        "channel": "dispatcher_test_functions",
    }
    inline, called = _both(call_sql.finish_done_many(), functions.finish_done(), finish)
    assert inline == called == [(running.id,)]


def test_a_functions_call_takes_integer_lists_as_literals_with_the_same_rows(published):
    """``functions.bind``: integer lists (NULLs among them) as array literals, choices as their
    values, other lists as they are; each function's rows the same either way."""
    bound = functions.bind("default", {
        "ids": [3, None, 10**12], "status": CallStatus.DONE, "keys": ["a", 'b"c'], "wakes": [True, False], "none": [],
    })
    assert bound == {"ids": "{3,NULL,1000000000000}", "status": "done", "keys": ["a", 'b"c'], "wakes": [True, False],
                     "none": []}
    now = timezone.now()
    for key in ("a", "a", "b"):
        CallQueue.objects.send("noop", {"k": key}, keys=[key], run_at=now - timedelta(seconds=1))
    claim = {
        "dispatched": CallStatus.DISPATCHED, "pending": CallStatus.PENDING, "now": now,
        "key_sets": ['["a"]', '["b"]'], "wanted": [2, 1],
    }
    rows = []
    for params in (claim, functions.bind("default", claim)):
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute(functions.claim("default").statement, params)
                rows.append(sorted(cursor.fetchall()))
            transaction.set_rollback(True)
    assert rows[0] == rows[1] and len(rows[1]) == 3
    CallQueue.objects.all().delete()

    # And end to end: a bucket's first start (its read state NULL) and its finish, their lists
    # sent as literals (psycopg's own adaptation would cast each list to the type of its values).
    edit.set_policy("bucket", 100, timedelta(minutes=1), burst=10)
    with CaptureQueriesContext(connection) as queries:
        assert _run(published, "bucket", 3) == ["done"] * 3
    called = [q["sql"] for q in queries.captured_queries if "dispatcher_mark_" in q["sql"] or "dispatcher_finish_" in q["sql"]]
    assert len(called) == 6
    assert not [sql for sql in called if re.search(r"::int[248]\[\]", sql)]
    assert set(CallQueue.objects.values_list("status", flat=True)) == {CallStatus.DONE}


def test_without_the_functions_parameters_go_as_they_are(dropped):
    params = {"ids": [1, 2], "status": CallStatus.DONE}
    assert functions.bind("default", params) is params


def test_a_call_started_by_the_function_comes_back_as_from_the_statement(published, monkeypatch):
    """Every column of a started call, as the worker reads it from the mark's row."""
    rows: list[tuple] = []
    read = start_module.call_from_row

    def recorded(model, db, row):
        rows.append(tuple(row))
        return read(model, db, row)

    monkeypatch.setattr(start_module, "call_from_row", recorded)
    edit.set_policy("bucket", 100, timedelta(minutes=1), burst=10)
    assert _run(published, "bucket", 1) == ["done"]
    with connection.cursor() as cursor:
        for function in functions.every("default"):
            cursor.execute(f"DROP FUNCTION {function.name}")
    functions.forget()
    try:
        assert _run(published, "bucket", 1) == ["done"]
    finally:
        functions.install("default")
    by_function, by_statement = rows
    fields = [f.name for f in CallQueue._meta.concrete_fields]
    assert len(by_function) == len(by_statement) == len(fields)
    differ = {"id", "created_at", "run_at", "dispatched_at", "started_at"}
    for name, one, other in zip(fields, by_function, by_statement, strict=True):
        assert type(one) is type(other), name
        if name not in differ:
            assert one == other, name


class _CallsElsewhere:
    """A site's router that keeps the dispatcher's tables out of the default database."""

    def allow_migrate(self, db: str, app_label: str, **hints) -> bool | None:
        return False if app_label == "dispatcher" and db == "default" else None


def test_migrate_installs_them_only_where_a_router_lets_the_calls_table_go(dropped):
    with override_settings(DATABASE_ROUTERS=[f"{__name__}._CallsElsewhere"]):
        functions.on_post_migrate(using="default")
    functions.forget()
    assert not functions.installed("default")
    functions.on_post_migrate(using="default")
    assert functions.installed("default")
