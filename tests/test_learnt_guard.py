"""The learnt arrival guard: start-to-send delays remembered per key (pure, no database)."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.policies import (
    MEMORY_MAX,
    MEMORY_MIN,
    DelayMemory,
    SlidingWindow,
    TokenBucket,
    arrival_guard,
    learnt_delay,
    memory,
    remember_delay,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)


@settings(max_examples=300, deadline=None)
@given(
    span_ms=st.integers(1, 2000),
    events=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 500), st.booleans()), max_size=40),
)
def test_the_memory_never_forgets_a_delay_measured_within_the_last_span(span_ms, events):
    """At any moment the learnt delay is at least every delay measured in the span before it."""
    span = span_ms * MS
    kept, now, measured = DelayMemory(), T0, []
    for step_ms, delay_ms, query in events:
        now += step_ms * MS
        if query:
            recent = [d for at, d in measured if now - at < span]
            assert learnt_delay(kept, now, span) >= max(recent, default=timedelta(0))
            continue
        changed = remember_delay(kept, now, span, delay_ms * MS)
        measured.append((now, delay_ms * MS))
        if changed is not None:
            kept = changed
        # What it keeps is a delay it was told, never an invented one.
        assert kept.current in {d for _, d in measured} | {timedelta(0)}


def test_a_delay_is_forgotten_two_spans_after_the_last_measurement():
    span = timedelta(seconds=1)
    kept = remember_delay(DelayMemory(), T0, span, 80 * MS)
    assert learnt_delay(kept, T0 + 999 * MS, span) == 80 * MS
    assert learnt_delay(kept, T0 + 1999 * MS, span) == 80 * MS
    assert learnt_delay(kept, T0 + 2 * span, span) == timedelta(0)


def test_only_a_larger_delay_or_a_new_span_is_written():
    span = timedelta(seconds=1)
    kept = remember_delay(DelayMemory(), T0, span, 30 * MS)
    assert remember_delay(kept, T0 + 100 * MS, span, 20 * MS) is None
    assert remember_delay(kept, T0 + 100 * MS, span, 40 * MS) == DelayMemory(40 * MS, timedelta(0), T0)
    assert remember_delay(kept, T0 + span, span, 5 * MS) == DelayMemory(5 * MS, 30 * MS, T0 + span)


def test_the_memory_spans_the_policies_horizon_within_bounds():
    window = SlidingWindow("k", 10, timedelta(seconds=2))
    smooth = TokenBucket("k", 2, timedelta(seconds=1), burst=1)
    shopify = TokenBucket("k", 2, timedelta(seconds=1), burst=40)
    day = SlidingWindow("k", 1000, timedelta(days=1))
    assert memory([window]) == timedelta(seconds=2)
    assert memory([window], guard=250 * MS) == timedelta(seconds=2.25)
    assert memory([smooth], guard=250 * MS) == MEMORY_MIN  # 500 ms + 250 ms is below the least memory
    assert memory([shopify, window]) == timedelta(seconds=20)
    assert memory([day]) == MEMORY_MAX


def test_the_guard_is_the_configured_one_on_top_of_the_learnt_delay_up_to_the_cap():
    floor, cap = 20 * MS, 250 * MS
    assert arrival_guard(floor, cap, timedelta(0)) == floor
    assert arrival_guard(floor, cap, 8 * MS) == 28 * MS
    assert arrival_guard(floor, cap, 40 * MS) == 60 * MS
    assert arrival_guard(floor, cap, 900 * MS) == cap
    assert arrival_guard(300 * MS, cap, 40 * MS) == 300 * MS  # a configured guard above the cap wins


def test_a_learnt_guard_never_shrinks_what_a_bucket_holds():
    """A call send() accepted under the configured guard still fits under a larger learnt one."""
    bucket = TokenBucket("k", 5, timedelta(seconds=1), burst=10).with_guard(20 * MS)
    learnt = bucket.with_learnt_guard(250 * MS)
    assert learnt.capacity() == bucket.capacity()
    # The rest of the guard slows the rate instead: k * interval + (1 + k) * extra >= guard.
    k, extra = learnt.reserve, learnt.interval - learnt._interval_exact
    assert k * learnt._interval_exact + (1 + k) * extra >= 250_000


def test_a_worker_writes_only_a_delay_that_changes_what_its_start_read():
    from dispatcher import arrivals

    span = timedelta(seconds=1)
    kept = {"k": DelayMemory(30 * MS, timedelta(0), T0)}
    arrivals.mark_clock()
    clock_read, _ = arrivals.begin()
    noted = ({"k": span}, kept, T0 + 100 * MS, {"k": 30 * MS}, {"k": [timedelta(seconds=1)]})
    assert arrivals.to_write(clock_read, noted, 20 * MS) == {}
    assert arrivals.to_write(clock_read, noted, 40 * MS) == {"k": span}
    assert arrivals.to_write(None, noted, 40 * MS) == {}
    # A bucket was charged at the start with a guard learnt from 30 ms: a send 40 ms after the
    # start moves it on by 10 ms; one within 30 ms does not move it.
    assert arrivals.overdue(noted, 20 * MS) == {}
    assert arrivals.overdue(noted, 40 * MS) == {"k": ([timedelta(seconds=1)], 10 * MS)}


@pytest.mark.django_db(transaction=True)
def test_a_late_send_moves_the_keys_buckets_on_by_how_late_it_was():
    from dispatcher.limiter import push_buckets
    from dispatcher.models import KeyBucket

    second, minute = timedelta(seconds=1), timedelta(minutes=1)
    KeyBucket.objects.create(key="shop", period=second, tat_us=1_000_000, since=T0)
    KeyBucket.objects.create(key="shop", period=minute, tat_us=1_000_000, since=T0)
    KeyBucket.objects.create(key="other", period=second, tat_us=1_000_000, since=T0)
    push_buckets({"shop": ([second], 12 * MS)})
    assert dict(KeyBucket.objects.values_list("key", "tat_us").filter(period=second)) == {
        "shop": 1_012_000, "other": 1_000_000,
    }
    assert KeyBucket.objects.get(key="shop", period=minute).tat_us == 1_000_000
