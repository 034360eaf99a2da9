"""CONN_HEALTH_CHECKS in a worker: our own statements skip the check's round trip (they retry on a
lost connection); a handler's first query on a kept connection is still checked, as a request's is."""
from __future__ import annotations

import psycopg
import pytest
from django.db import connection

from dispatcher.models import CallQueue
from dispatcher.registry import handler
from dispatcher.tasks import run_call
from tests.claims import claim

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

@handler("test.count_calls")
def count_calls() -> dict[str, int]:
    """A handler that reads the database twice."""
    return {"calls": CallQueue.objects.count(), "again": CallQueue.objects.count()}


@handler("test.lose_connection_then_read")
def lose_connection_then_read() -> dict[str, int]:
    """The worker's kept connection dies under the handler (a restart, a proxy's timeout); then it reads."""
    pid = connection.connection.info.backend_pid
    with psycopg.connect(_dsn(), autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    return {"calls": CallQueue.objects.count()}


def _dsn() -> str:
    s = connection.settings_dict
    return f"host={s['HOST'] or '127.0.0.1'} port={s['PORT'] or 5432} dbname={s['NAME']} user={s['USER']}"


@pytest.fixture
def checks_on():
    """Health checks on, as the project's settings have them, on a kept connection."""
    before = connection.settings_dict["CONN_HEALTH_CHECKS"], connection.settings_dict["CONN_MAX_AGE"]
    connection.settings_dict["CONN_HEALTH_CHECKS"], connection.settings_dict["CONN_MAX_AGE"] = True, 60
    connection.close()
    connection.ensure_connection()
    yield
    connection.settings_dict["CONN_HEALTH_CHECKS"], connection.settings_dict["CONN_MAX_AGE"] = before
    connection.close()


def _run(method: str) -> str:
    call = CallQueue.objects.send(method)
    claimed = claim(call.key_set, 1).calls[0]
    return run_call(claimed.id, claimed.dispatch_no)


@pytest.fixture
def checks(monkeypatch):
    """Each health check Django makes on this thread's connection, by what ran next (its raw
    ``SELECT 1`` bypasses the query log): the real check runs, its calls are counted."""
    made: list[str] = []
    real = connection.is_usable

    def is_usable() -> bool:
        made.append("check")
        return real()

    monkeypatch.setattr(connection, "is_usable", is_usable)
    return made


def test_a_run_makes_no_health_check_of_its_own(checks_on, checks):
    assert connection.health_check_enabled
    assert "done" in _run("noop")
    assert checks == []
    assert CallQueue.objects.get().status == "done"


def test_a_handler_s_first_query_is_checked(checks_on, checks):
    assert "done" in _run("test.count_calls")
    # One check, before the handler's first query (not its second, nor the finish after it).
    assert checks == ["check"]
    # Without the check before the handler, Django's own (the first query after the task began)
    # would have been the start's: the test of a lost connection below shows it matters.


def test_a_handler_whose_connection_died_gets_a_new_one_and_the_call_is_recorded(checks_on):
    assert "done" in _run("test.lose_connection_then_read")
    call = CallQueue.objects.get()
    assert call.status == "done" and call.result == {"calls": 1}, (call.status, call.last_error)
