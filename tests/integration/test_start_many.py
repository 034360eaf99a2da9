"""A message of several calls (DISPATCHER_CALLS_PER_MESSAGE > 1): started together as one group
against the limits, run at once, their outcomes recorded together; in-process, no broker."""
from __future__ import annotations

from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection

from dispatcher.clock import from_us
from dispatcher.limits import edit, gate
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState, RateLimit, StartLog
from dispatcher.worker import execute_many
from tests.integration.test_lifecycle import claim_all

pytestmark = pytest.mark.django_db


def _claimed(n: int, method: str = "noop", keys: list[str] | None = None, **params) -> list[tuple[int, int]]:
    calls = [CallQueue.objects.send(method, params, keys=keys or ["api"]) for _ in range(n)]
    claimed = claim_all(calls[0].key_set, n).calls
    assert len(claimed) == n
    return [(c.id, c.dispatch_no) for c in sorted(claimed, key=lambda c: c.id)]


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ({"limit": 3, "period": timedelta(minutes=1)}, {"limit": 2, "period": timedelta(minutes=1)}),
        (
            {"limit": 100, "period": timedelta(minutes=1), "concurrency": 3},
            {"limit": 100, "period": timedelta(minutes=1), "concurrency": 2},
        ),
        (
            {"limit": 60, "period": timedelta(minutes=1), "burst": 3},
            {"limit": 60, "period": timedelta(minutes=1), "burst": 2},
        ),
    ],
    ids=["window", "concurrency", "bucket"],
)
def test_a_group_is_checked_as_one_each_start_counting_against_the_next(before, after):
    edit.set_policy("api", **before)
    deliveries = _claimed(3)
    # Tightened while the message waited in the broker: only two of the three fit now. Each
    # call alone would fit the empty key; only counting the group's own starts defers the third.
    RateLimit.objects.filter(key="api").delete()
    edit.set_policy("api", **after)
    started = CallQueue.objects.start_many(deliveries, worker="w")
    assert [s.state for s in started] == ["started", "started", "deferred"]
    third = CallQueue.objects.get(id=deliveries[2][0])
    assert (third.status, third.attempts) == ("pending", 0)
    state = KeyState.objects.get(key="api")
    assert (state.reserved, state.reserved_units, state.total) == (0, 0, 2)
    assert sorted(StartLog.objects.filter(key="api").values_list("cum", flat=True)) == [1, 2]
    assert gate.running_by_key(["api"]) == {"api": 2}
    if "burst" in after:
        # The bucket holds the state after both charges, as two starts one after the other leave it.
        from dispatcher.conf import dispatcher_settings
        from dispatcher.limits.shapes import Reading

        (bucket,) = KeyBucket.objects.filter(key="api")
        policy = RateLimit.objects.get(key="api").as_policy().with_guard(dispatcher_settings.ARRIVAL_GUARD)
        now = started[0].call.started_at
        assert from_us(bucket.tat_us) == policy.charge(Reading(tat=policy.charge(Reading(), now, 1)), now, 1)


def test_a_call_whose_slot_frees_within_may_wait_is_early_and_nothing_changes_for_it():
    edit.set_policy("api", 2, timedelta(minutes=1))
    deliveries = _claimed(2)
    edit.set_policy("api", 1, timedelta(minutes=1))
    first, second = CallQueue.objects.start_many(deliveries, worker="w", may_wait=timedelta(minutes=2))
    assert (first.state, second.state) == ("started", "early")
    assert timedelta(seconds=59) < second.wait <= timedelta(minutes=1, seconds=1)
    waiting = CallQueue.objects.get(id=deliveries[1][0])
    assert (waiting.status, waiting.dispatch_no) == ("dispatched", deliveries[1][1])
    assert KeyState.objects.get(key="api").reserved == 1


def test_a_stale_delivery_in_a_group_is_skipped_and_the_others_start():
    edit.set_policy("api", 10, timedelta(minutes=1))
    deliveries = _claimed(3)
    deliveries[1] = (deliveries[1][0], deliveries[1][1] + 7)
    deliveries.append(deliveries[0])  # the same delivery twice in one message starts once
    # A stale delivery of a call does not stop a good one of the same call after it.
    deliveries.insert(0, (deliveries[2][0], deliveries[2][1] + 3))
    started = CallQueue.objects.start_many(deliveries, worker="w")
    assert [s.state for s in started] == ["stale", "started", "stale", "started", "stale"]
    assert Counter(Attempt.objects.values_list("call_id", flat=True)) == {deliveries[1][0]: 1, deliveries[3][0]: 1}
    assert KeyState.objects.get(key="api").total == 2


def test_a_group_of_calls_of_different_keys_and_costs_starts_with_each_keys_own_totals():
    edit.set_policy("api", 10, timedelta(minutes=1))
    edit.set_policy("llm", 100, timedelta(minutes=1))
    plain = _claimed(2)
    costly = _claimed(2, "complete", keys=["llm"], max_tokens=7)
    started = CallQueue.objects.start_many([plain[0], costly[0], plain[1], costly[1]], worker="w")
    assert [s.state for s in started] == ["started"] * 4
    totals = dict(KeyState.objects.values_list("key", "total"))
    assert (totals["api"], totals["llm"]) == (2, 14)
    assert sorted(StartLog.objects.filter(key="llm").values_list("units", "cum")) == [(7, 7), (7, 14)]


def test_a_message_runs_its_calls_and_records_each_outcome_once():
    edit.set_policy("api", 10, timedelta(minutes=1))
    ok = _claimed(3)
    failing = _claimed(1, "explode", keys=["api"], permanent=True)
    reporting = _claimed(1, "complete", keys=["llm"], max_tokens=5, used=2)
    outcomes = execute_many(ok + failing + reporting)
    assert outcomes == {"done": 4, "failed": 1}
    statuses = dict(CallQueue.objects.values_list("id", "status"))
    assert [statuses[i] for i, _ in ok + reporting] == ["done"] * 4
    assert statuses[failing[0][0]] == "failed"
    assert set(Attempt.objects.values_list("outcome", flat=True)) == {"done", "failed"}
    assert Attempt.objects.filter(finished_at__isnull=True).count() == 0
    # The cost the handler reported corrected its key's log, as for one call.
    assert KeyState.objects.get(key="llm").total == 2
    assert not CallQueue.objects.filter(status="running").exists()
    assert set(KeyState.objects.values_list("reserved", flat=True)) == {0}


def _table_state() -> tuple:
    """Every row a start writes: calls, attempts, start logs, buckets, key counters."""
    return (
        sorted(CallQueue.objects.values_list("id", "status", "attempts", "started_at")),
        sorted(Attempt.objects.values_list("id", "call_id", "started_at")),
        sorted(StartLog.objects.values_list("id", "key", "cum")),
        sorted(KeyBucket.objects.values_list("key", "period", "tat_us", "start")),
        sorted(KeyState.objects.values_list("key", "reserved", "reserved_units", "total")),
    )


def test_warming_a_start_writes_nothing_and_the_next_start_runs_as_any(django_assert_max_num_queries):
    from dispatcher.calls.start import warm

    # Calls claimed (dispatched, reserved), a bucket charged by an earlier start: what a warm-up
    # must leave as it found it.
    edit.set_policy("api", 60, timedelta(minutes=1), burst=5)
    deliveries = _claimed(3)
    started_first = CallQueue.objects.start(*deliveries[0], "w")
    assert started_first.state == "started"
    before = _table_state()
    warm(CallQueue.objects)
    assert _table_state() == before
    # On PostgreSQL it ran a start's statements (the point of it), a bounded few; SQLite has none to warm.
    with django_assert_max_num_queries(8) as captured:
        warm(CallQueue.objects)
    assert bool(captured.captured_queries) == (connection.vendor == "postgresql")
    assert _table_state() == before
    started = CallQueue.objects.start_many(deliveries[1:], "w")
    assert [s.state for s in started] == ["started", "started"]
    assert Attempt.objects.count() == 3
    assert KeyState.objects.get(key="api").reserved == 0
