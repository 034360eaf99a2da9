"""PostgreSQL's statements and the portable ORM path leave the same rows.

Where PostgreSQL takes a statement of its own (send, send_many, the claim, the start, the
finish: ``_x_postgresql`` beside ``_x_portable`` in ``dispatcher.calls``; the limiter's key locks and
policy loading), the SQLite pass of the suite runs only the portable path. Here one scenario
runs on PostgreSQL twice, once as it ships and once with ``schema.postgresql_path`` answering no, forcing the
ORM path, on the same clock, and the calls,
attempts, start log, key counters and bucket state it leaves must be the same.
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db.models import Q

import dispatcher.limits.catalog
import dispatcher.limits.gate
import dispatcher.retry
import dispatcher.store.limit_sql
import dispatcher.store.schema
from dispatcher.calls import dispense, finish, send, start
from dispatcher.limits import catalog, edit, gate
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState, RateLimit, StartLog
from tests.clocks import fake_db_clock

pytestmark = [pytest.mark.postgres, pytest.mark.django_db]

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch, settings):
    monkeypatch.setattr(dispatcher.retry, "JITTER", 0)
    clock = lambda using=None: NOW  # noqa: E731
    fake_db_clock(monkeypatch, clock)
    monkeypatch.setattr(catalog.Policies, "load_with_clock", classmethod(lambda cls, using=None: (cls.load(using), NOW)))
    # A start with policies this process kept reads the clock in its own statement: with none kept
    # (as in a new process), every start reads the fixed clock above, whatever ran before.
    monkeypatch.setattr(gate, "kept_policies", lambda using=None: None)


def _scenario() -> list[str]:
    """Send, claim, start and finish calls of a window key and a bucket key; return what each start said."""
    calls = CallQueue.objects
    edit.set_policy("paths-window", 4, timedelta(minutes=1), concurrency=3)
    edit.set_policy("paths-bucket", 3, timedelta(minutes=1), burst=3)
    due = NOW - timedelta(seconds=1)
    calls.send("noop", {"n": 1}, keys=["paths-window"], run_at=due)
    calls.send("noop", {"n": 2}, keys=["paths-bucket", "paths-window"], run_at=due, cost={"paths-bucket": 2})
    calls.send_many([
        {"method": "noop", "params": {"n": 3}, "keys": ["paths-bucket"], "run_at": due},
        {"method": "noop", "params": {"n": 4}, "keys": ["paths-window"], "run_at": due, "priority": 5},
        {"method": "noop", "params": {"n": 5}, "keys": ["paths-window"], "run_at": due, "max_attempts": 1},
        {"method": "noop", "params": {"n": 6}, "keys": ["paths-bucket"], "run_at": due},
    ])
    # Send once: a duplicate, a replace, and duplicates inside a batch (not due: the claims stay as they were).
    later = NOW + timedelta(days=1)
    calls.send("noop", {"n": 7}, keys=["paths-window"], run_at=later, unique_key="paths-once")
    calls.send("noop", {"n": 8}, keys=["paths-window"], run_at=later, unique_key="paths-once")
    calls.send("noop", {"n": 9}, keys=["paths-bucket"], run_at=later + timedelta(hours=1), unique_key="paths-once",
               on_duplicate="replace")
    calls.send_many([
        {"method": "noop", "params": {"n": 10}, "run_at": later, "unique_key": "paths-many", "unique_for": "1h"},
        {"method": "noop", "params": {"n": 11}, "run_at": later, "unique_key": "paths-many"},
        {"method": "noop", "params": {"n": 12}, "run_at": later, "unique_key": "paths-once"},
        {"method": "noop", "params": {"n": 13}, "run_at": later},
    ])
    said = []
    finishes = [
        lambda s: calls.finish_done(s.call, s.attempt, {"ok": s.call.params["n"]}),
        lambda s: calls.finish_error(s.call, s.attempt, "boom", "Traceback: boom", permanent=False),
        lambda s: calls.finish_error(s.call, s.attempt, "bad input", "Traceback: bad", permanent=True),
        lambda s: None,  # left running
    ]
    for round_ in range(2):
        claimed = calls.claim_batch(calls.waiting_key_sets(), 10, catalog.Policies.load()).calls
        for index, claim in enumerate(sorted(claimed, key=lambda c: c.id)):
            started = calls.start(claim.id, claim.dispatch_no)
            said.append(f"{round_}:{started.state}:{started.reason}")
            if started.state == "started":
                finishes[index % len(finishes)](started)
    return said


def _rows() -> dict[str, Any]:
    """The rows the scenario left, with call ids replaced by the calls' order of sending."""
    order = {pk: n for n, pk in enumerate(CallQueue.objects.order_by("id").values_list("id", flat=True))}
    return {
        "calls": [
            {**row, "id": order[row["id"]]}
            for row in CallQueue.objects.order_by("id").values(
                "id", "method", "params", "keys", "key_set", "priority", "queue", "status", "run_at", "attempts",
                "max_attempts", "deferrals", "dispatch_no", "dispatched_at", "started_at", "finished_at", "result",
                "last_error", "last_traceback", "cost", "unique_key", "unique_released",
            ).annotate(holds_for_a_while=Q(unique_until__isnull=False))
        ],
        "attempts": sorted(
            (order[a["call_id"]], a["number"], a["outcome"], a["error"], a["started_at"], a["finished_at"], a["worker"])
            for a in Attempt.objects.values("call_id", "number", "outcome", "error", "started_at", "finished_at", "worker")
        ),
        "start log": sorted(
            (s["key"], s["started_at"], s["units"], s["cum"], order[s["call_id"]])
            for s in StartLog.objects.values("key", "started_at", "units", "cum", "call_id")
        ),
        "key states": list(KeyState.objects.order_by("key").values()),
        "buckets": list(KeyBucket.objects.order_by("key", "period").values("key", "period", "tat_us", "since")),
    }


def _forget() -> None:
    for model in (Attempt, CallQueue, StartLog, KeyState, KeyBucket, RateLimit):
        model.objects.all().delete()


def test_postgresql_statements_and_the_portable_path_leave_the_same_rows(monkeypatch):
    postgresql_said = _scenario()
    postgresql_rows = _rows()
    _forget()
    monkeypatch.setattr(dispatcher.store.schema, "postgresql_path", lambda alias: False)
    portable_said = _scenario()
    portable_rows = _rows()

    assert portable_said == postgresql_said
    for table, rows in postgresql_rows.items():
        assert portable_rows[table] == rows, table
    # The scenario reaches every outcome both paths write.
    statuses = {row["status"] for row in postgresql_rows["calls"]}
    assert statuses >= {CallQueue.Status.DONE, CallQueue.Status.PENDING, CallQueue.Status.FAILED, CallQueue.Status.RUNNING}
    assert any(state.startswith("1:started") for state in postgresql_said)
    assert postgresql_rows["buckets"] and postgresql_rows["start log"]


def test_the_portable_path_is_really_taken_when_forced(monkeypatch):
    monkeypatch.setattr(dispatcher.store.schema, "postgresql_path", lambda alias: False)
    taken = []
    for module, name in (
        (dispense, "_claim_rows_postgresql"), (start, "_mark_running_postgresql"), (finish, "_finish_postgresql"),
        (send, "insert_one"), (send, "insert_many"), (send, "insert_one_once"), (send, "insert_many_once"),
    ):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: taken.append(name))
    monkeypatch.setattr(dispatcher.limits.catalog, "policies_statement", lambda *a: taken.append("policies_statement"))
    monkeypatch.setattr(dispatcher.store.limit_sql, "lock_key_states", lambda: taken.append("lock_key_states"))
    monkeypatch.setattr(dispatcher.store.limit_sql, "lock_key_states_of_calls", lambda: taken.append("lock_key_states_of_calls"))
    monkeypatch.setattr(dispatcher.store.limit_sql, "clock_readings", lambda *a: taken.append("clock_readings"))
    _scenario()
    assert taken == []
