"""Retention cleanup: bounded batches, dry run, live calls and window records kept, never blocking a dispenser."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections

from dispatcher.clock import db_now
from dispatcher.limits import catalog, edit
from dispatcher.models import Attempt, CallQueue, StartLog
from dispatcher.status import key_statuses
from tests.claims import claim

pytestmark = pytest.mark.django_db


def make(status: str, age: timedelta, keys: list[str] | None = None, attempts: int = 1) -> CallQueue:
    """Store a call in a status, created and (if finished) finished ``age`` ago, with its attempts."""
    call = CallQueue.objects.send("noop", {}, keys=keys or ["api"])
    when = db_now() - age
    finished = when if status in CallQueue.FINISHED else None
    CallQueue.objects.filter(id=call.id).update(status=status, created_at=when, finished_at=finished, attempts=attempts)
    Attempt.objects.bulk_create([
        Attempt(call=call, number=n + 1, started_at=when, finished_at=finished, outcome="done" if finished else "running")
        for n in range(attempts)
    ])
    return call


def test_prune_deletes_old_finished_calls_and_their_attempts_only():
    old = [make(s, timedelta(days=8)) for s in ("done", "failed", "cancelled")]
    recent = make("done", timedelta(days=6))
    live = [make(s, timedelta(days=30)) for s in ("pending", "dispatched", "running")]
    deleted = CallQueue.objects.prune(timedelta(days=7))
    assert deleted == 3
    remaining = set(CallQueue.objects.values_list("id", flat=True))
    assert remaining == {recent.id, *(c.id for c in live)}
    assert not Attempt.objects.filter(call_id__in=[c.id for c in old]).exists()
    assert Attempt.objects.count() == 4


def test_prune_works_in_bounded_batches_and_reports_progress():
    for _ in range(10):
        make("done", timedelta(days=8))
    seen: list[tuple[int, int]] = []
    assert CallQueue.objects.prune(timedelta(days=7), batch=3, progress=lambda done, total: seen.append((done, total))) == 10
    assert seen == [(3, 10), (6, 10), (9, 10), (10, 10)]


def test_dry_run_counts_and_deletes_nothing():
    for _ in range(4):
        make("done", timedelta(days=8))
    make("pending", timedelta(days=8))
    out = StringIO()
    call_command("prune_calls", "--dry-run", stdout=out)
    assert "would delete 4 finished calls older than 7d" in out.getvalue()
    assert CallQueue.objects.count() == 5 and Attempt.objects.count() == 5


def test_command_prints_plain_progress_lines_off_a_terminal():
    for _ in range(5):
        make("done", timedelta(hours=3))
    out = StringIO()
    call_command("prune_calls", "--older-than", "2h", "--batch", "2", stdout=out)
    assert out.getvalue().splitlines() == [
        "deleted 2/5", "deleted 4/5", "deleted 5/5", "deleted 5 finished calls older than 2h",
    ]
    assert not CallQueue.objects.exists()


@pytest.mark.parametrize(("args", "message"), [(["--older-than", "soon"], "--older-than"), (["--batch", "0"], "--batch")])
def test_command_refuses_bad_arguments_and_deletes_nothing(args, message):
    make("done", timedelta(days=30))
    with pytest.raises(CommandError, match=message):
        call_command("prune_calls", *args)
    assert CallQueue.objects.count() == 1


def test_prune_keeps_what_a_limiter_window_still_needs():
    edit.set_policy("api", 1000, timedelta(days=1))
    inside = make("done", timedelta(hours=2))
    outside = make("done", timedelta(days=2))
    now = db_now()
    StartLog.objects.bulk_create([
        StartLog(key="api", started_at=now - timedelta(hours=2)),
        StartLog(key="api", started_at=now - timedelta(days=2)),
    ])
    # --older-than 1h asks for more than the 1-day window allows: the 2-hour-old call stays.
    assert CallQueue.objects.prune(timedelta(hours=1)) == 1
    assert list(CallQueue.objects.values_list("id", flat=True)) == [inside.id]
    assert Attempt.objects.filter(call=inside).exists() and not Attempt.objects.filter(call=outside).exists()
    assert list(StartLog.objects.values_list("started_at", flat=True)) == [now - timedelta(hours=2)]
    # The limiter still counts the start inside its window.
    (status,) = key_statuses(["api"])
    assert status.policies[0].used == 1


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_prune_of_100k_rows_does_not_block_a_concurrent_dispenser():
    table = CallQueue._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO {table} (method, params, keys, key_set, priority, queue, status, run_at, attempts,
                    max_attempts, deferrals, dispatch_no, created_at, finished_at, last_error, last_traceback)
                SELECT 'noop', '{{}}', '["old"]', '["old"]', 0, '', 'done', now(), 1, 3, 0, 1,
                       now() - interval '10 days', now() - interval '9 days' + g * interval '1 ms', '', ''
                FROM generate_series(1, 100000) g"""
        )
        cursor.execute(
            f"""INSERT INTO dispatcher_attempt (call_id, number, started_at, finished_at, outcome, error, worker)
                SELECT id, 1, created_at, finished_at, 'done', '', '' FROM {table}"""
        )
        # A table of this size in production has planner statistics; give the test's the same.
        cursor.execute(f"ANALYZE {table}, dispatcher_attempt")
    waiting = CallQueue.objects.send_many([{"method": "noop", "keys": ["live"]} for _ in range(3000)])
    key_set_text = waiting[0].key_set
    longest = 0.0
    claims = 0
    stop = threading.Event()

    def dispenser() -> None:
        # The dispenser's own claim transaction, timed from its start to its commit.
        nonlocal longest, claims
        policies = catalog.Policies.load()
        try:
            while not stop.is_set() and claims < 5000:
                began = time.monotonic()
                claim(key_set_text, 1, policies)
                longest = max(longest, time.monotonic() - began)
                claims += 1
                time.sleep(0.005)
        finally:
            connections.close_all()

    thread = threading.Thread(target=dispenser)
    thread.start()
    began = time.monotonic()
    try:
        deleted = CallQueue.objects.prune(timedelta(days=7), batch=1000)
    finally:
        stop.set()
        thread.join(timeout=60)
    took = time.monotonic() - began
    print(f"\nprune_calls: {deleted} calls in {took:.1f}s; concurrent dispenser: {claims} claims, longest {longest * 1000:.0f} ms")
    assert deleted == 100_000 and not Attempt.objects.filter(call__status="done").exists()
    assert claims > 0
    assert CallQueue.objects.filter(key_set=key_set_text).count() == 3000
    assert CallQueue.objects.filter(status="dispatched").count() == min(claims, 3000)
