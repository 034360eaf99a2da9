"""A start's, a finish's and a claim's statements prepared where the site's connection allows it
(``OPTIONS["prepare_threshold"]``, ``dispatcher.store.prepared``), and only there.

Transactional tests: a start is the worker's own transaction (autocommit, no ``atomic`` around it).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dispatcher import dispenser as dispenser_module
from dispatcher.dispenser import Dispenser
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, StartLog
from dispatcher.store import functions, prepared
from dispatcher.worker import execute
from tests.integration.test_folded import _idle, _key_lockable_elsewhere, _seen_elsewhere

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

_UNSET = object()


def _connect_with(threshold: object) -> None:
    """Reconnect with ``prepare_threshold`` set as a site's OPTIONS would (``_UNSET``: not set)."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    if threshold is _UNSET:
        options.pop("prepare_threshold", None)
    else:
        options["prepare_threshold"] = threshold
    connection.close()


@pytest.fixture
def threshold():
    """Set the connection's ``prepare_threshold`` for a test; put back what the suite runs with."""
    kept = connection.settings_dict.get("OPTIONS", {}).get("prepare_threshold", _UNSET)
    yield _connect_with
    _connect_with(kept)


@pytest.fixture
def published(monkeypatch):
    """Record what the dispenser publishes instead of writing to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.extend(calls))
    return sent


def _prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def _opening(sql: str) -> str:
    """A statement's text up to its first parameter, whitespace folded: how it shows once prepared."""
    return " ".join(sql.split("%", 1)[0].split())


def _run_calls(n: int, published: list) -> list[str]:
    """Send n calls of one key, dispense them, run each in this process; return their outcomes."""
    for _ in range(n):
        CallQueue.objects.send("noop", keys=["api"])
    assert Dispenser().run_once().moved == n
    return [execute(call.id, call.dispatch_no) for call in sorted(published, key=lambda c: c.id)]


def test_with_prepare_threshold_set_the_hot_statements_are_prepared_and_calls_run_as_before(threshold, published):
    edit.set_policy("api", 100, timedelta(minutes=1))
    threshold(0)
    assert prepared.preparing("default")
    assert _run_calls(3, published) == ["done", "done", "done"]
    assert CallQueue.objects.filter(status="done").count() == 3
    assert Attempt.objects.filter(outcome="done").count() == 3
    assert StartLog.objects.filter(key="api").count() == 3
    shown = [" ".join(statement.split()) for statement in _prepared_statements()]
    # The claim and the mark are calls of their functions (``store.functions``, installed by migrate).
    # (The calls' heads go with BEGIN and the keys' lock, as one query: not prepared.)
    for sql in (functions.mark(False, "default").statement, functions.finish_done().statement, functions.claim("default").statement):
        assert any(statement.startswith(_opening(sql)) for statement in shown), _opening(sql)[:80]


def test_without_it_nothing_is_prepared(threshold, published):
    edit.set_policy("api", 100, timedelta(minutes=1))
    threshold(_UNSET)
    assert not prepared.preparing("default")
    assert _run_calls(2, published) == ["done", "done"]
    assert _prepared_statements() == []


def test_a_prepared_start_commits_on_its_own_and_leaves_nothing_open(threshold, published):
    """The mark cannot carry the COMMIT: it goes next, and the start is as committed as a folded one."""
    edit.set_policy("api", 100, timedelta(minutes=1))
    threshold(0)
    for _ in range(2):
        CallQueue.objects.send("noop", keys=["api"])
    Dispenser().run_once()
    first, call = sorted(published, key=lambda c: c.id)
    assert CallQueue.objects.start(first.id, first.dispatch_no, worker="w").state == "started"
    with CaptureQueriesContext(connection) as queries:
        assert CallQueue.objects.start(call.id, call.dispatch_no, worker="w").state == "started"
    # (Django shows no text for some statements of a server-binding cursor: None.)
    sent = [(q["sql"] or "").strip() for q in queries]
    # BEGIN with the lock and the head, the windows, the mark, COMMIT.
    assert len(sent) == 4, sent
    assert sent[0].startswith("BEGIN; ") and not sent[2].endswith("COMMIT") and sent[3] == "COMMIT"
    assert _idle()
    assert _seen_elsewhere(lambda: CallQueue.objects.get(id=call.id).status) == "running"
    assert _key_lockable_elsewhere("api")


def test_a_stale_delivery_prepared_writes_nothing(threshold, published):
    edit.set_policy("api", 100, timedelta(minutes=1))
    threshold(0)
    CallQueue.objects.send("noop", keys=["api"])
    Dispenser().run_once()
    (call,) = published
    assert execute(call.id, call.dispatch_no) == "done"
    # The same delivery again, and one the call never had: neither starts anything.
    assert execute(call.id, call.dispatch_no) != "done"
    assert execute(call.id, call.dispatch_no + 5) != "done"
    assert Attempt.objects.count() == 1 and StartLog.objects.count() == 1
    assert _idle()
