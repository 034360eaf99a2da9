"""When a waiting call will start, counting the calls queued before it (dispatcher.waits)."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher import status as live
from dispatcher import waits
from dispatcher.clock import db_now
from dispatcher.limits import edit
from dispatcher.limits.shapes import US, Reading, SlidingWindow
from dispatcher.models import CallQueue
from tests.starts import log_starts

NOW = datetime(2030, 1, 1, tzinfo=UTC)


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 8),
    period_s=st.integers(1, 120),
    ages=st.lists(st.floats(0, 1), max_size=8),
    queued=st.integers(0, 60),
    need=st.integers(1, 8),
)
def test_a_window_starts_the_queue_one_unit_at_a_time_as_early_as_it_allows(limit, period_s, ages, queued, need):
    """The closed form equals placing each unit, in order, at the earliest moment the window admits it."""
    window = SlidingWindow("k", limit, timedelta(seconds=period_s), None, timedelta(0))
    if need > limit:
        return  # refused at send(): it can never fit
    in_window = sorted(NOW - window.span * age for age in ages)[-limit:] if ages else []
    placed = list(in_window)
    for _ in range(queued + need):
        earliest = NOW if len(placed) < limit else max(NOW, placed[-limit] + window.span + US)
        placed.append(earliest)
    reading = Reading(used=len(in_window), leaves_at=lambda n: in_window[n - 1] if n <= len(in_window) else None)
    assert window.queue_frees_at(reading, NOW, queued, need) == placed[-1]


pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
def test_a_call_behind_185_others_on_a_20_per_minute_key_is_told_about_nine_minutes(make_call):
    edit.set_policy("mail", 20, timedelta(minutes=1))
    now = db_now()
    log_starts("mail", [now - timedelta(seconds=58 - 3 * i) for i in range(20)])
    CallQueue.objects.send_many([{"method": "noop", "keys": ["mail"]} for _ in range(185)])
    last = CallQueue.objects.send("noop", {}, keys=["mail"])
    explanation = waits.explain_call(last)
    wait = (explanation.until - explanation.now).total_seconds()
    # 185 ahead plus itself: the 186th unit from now, 20 a minute, the window full until 2 s from now.
    assert 9 * 60 <= wait <= 9 * 60 + 20, wait
    assert explanation.expected.exact and explanation.expected.ahead == 185
    assert "185 calls ahead of it on key mail" in explanation.summary()
    assert "will start at" in explanation.summary()


@pytestmark_db
def test_other_tenants_on_a_shared_key_count_by_their_fair_turns(make_call):
    edit.set_policy("mail", 8, timedelta(minutes=1))
    for tenant in range(7):
        CallQueue.objects.send_many([{"method": "noop", "keys": ["mail", f"mail:t{tenant}"]} for _ in range(10)])
    mine = [CallQueue.objects.send("noop", {}, keys=["mail", "mail:t7"]) for _ in range(4)]
    expected = waits.explain_call(mine[3]).expected
    # Three of its own before it, and each other tenant's turns before its fourth: four each.
    assert expected.ahead == 3 + 7 * 4 and expected.key == "mail"


@pytestmark_db
def test_a_key_at_its_concurrency_cap_gives_only_a_lower_bound(make_call):
    edit.set_policy("slow", 100, timedelta(seconds=1), concurrency=1)
    make_call(keys=["slow"], status="running")
    explanation = waits.explain_call(make_call(keys=["slow"]))
    assert explanation.until is None
    assert not explanation.expected.exact and "not before" in explanation.summary()


@pytestmark_db
def test_a_tenant_key_with_room_reports_the_slot_of_the_full_shared_key_that_holds_its_calls():
    edit.set_policy("mail", 2, timedelta(minutes=1))
    edit.set_policy("mail:*", 10, timedelta(minutes=1))
    now = db_now()
    log_starts("mail", [now - timedelta(seconds=50), now - timedelta(seconds=20)])
    CallQueue.objects.send_many([{"method": "noop", "keys": ["mail", "mail:t5"]} for _ in range(25)])
    statuses = {s.key: s for s in live.key_statuses(now=now)}
    tenant = statuses["mail:t5"]
    assert not tenant.blocked and tenant.held_by == "mail"
    assert 8 <= (tenant.next_free_at - now).total_seconds() <= 12
    assert tenant.next_free_text(lambda moment, at: "then").endswith("(held by mail)")


@pytestmark_db
def test_a_key_behind_a_one_per_hour_key_is_not_free_now():
    edit.set_policy("hourly", 1, timedelta(hours=1))
    now = db_now()
    log_starts("hourly", [now - timedelta(minutes=10)])
    CallQueue.objects.send("noop", {}, keys=["fast", "hourly"])
    fast = next(s for s in live.key_statuses(now=now) if s.key == "fast")
    assert fast.held_by == "hourly" and (fast.next_free_at - now) >= timedelta(minutes=49)


@pytestmark_db
def test_the_drain_of_a_capped_key_is_a_lower_bound(make_call):
    edit.set_policy("slow", 100, timedelta(seconds=1), concurrency=1)
    for _ in range(9):
        make_call(keys=["slow"])
    slow = next(s for s in live.key_statuses(now=db_now()) if s.key == "slow")
    assert slow.drain_is_lower_bound and slow.drain_text(lambda d: "0 s") == "at least 0 s"


@pytestmark_db
def test_first_held_explains_the_first_call_the_room_cannot_take_and_counts_the_rest():
    edit.set_policy("api", 3, timedelta(minutes=1))
    edit.pause_key("paused", timedelta(minutes=5))
    free = CallQueue.objects.send_many([{"method": "noop", "keys": ["api"]}] * 5)
    stopped = CallQueue.objects.send("noop", {}, keys=["paused"])
    CallQueue.objects.retry_now([c.id for c in [*free, stopped]])
    held = waits.first_held([c.id for c in [*free, stopped]])
    # The key's room takes the first three; the fourth and fifth wait, and so does the paused key's call.
    assert held.call.id == free[3].id and held.more == 2
    assert "3 calls ahead of it on key api" in held.explanation.summary()
    assert waits.first_held([c.id for c in free[:3]]) is None


@pytestmark_db
def test_first_held_explains_the_last_call_when_only_calls_outside_the_batch_are_ahead():
    edit.set_policy("api", 3, timedelta(minutes=1))
    CallQueue.objects.send_many([{"method": "noop", "keys": ["api"]}] * 4)
    mine = CallQueue.objects.send_many([{"method": "noop", "keys": ["api"]}] * 2)
    CallQueue.objects.retry_now([c.id for c in mine])
    held = waits.first_held([c.id for c in mine])
    assert held.call.id == mine[1].id and held.more == 0
    assert "5 calls ahead of it on key api" in held.explanation.summary()
