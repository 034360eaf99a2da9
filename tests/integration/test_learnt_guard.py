"""The learnt arrival guard: start-to-send delays remembered per key (pure, no database)."""
from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.limits import edit
from dispatcher.limits.guard import (
    MEMORY_MAX,
    MEMORY_MIN,
    DelayMemory,
    arrival_guard,
    learnt_delay,
    memory,
    remember_delay,
)
from dispatcher.limits.shapes import US, Reading, SlidingWindow, TokenBucket

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


def test_a_learnt_guard_comes_out_of_the_burst_and_a_call_send_accepted_still_fits():
    """A learnt guard the burst can hold costs no rate; a call above the depth it leaves, which
    send() accepted under the configured guard, fits alone once the bucket has been full a while."""
    bucket = TokenBucket("k", 50, timedelta(seconds=1), burst=50).with_guard(20 * MS)
    learnt = bucket.with_learnt_guard(60 * MS)
    assert (bucket.depth, bucket.interval) == (49, 20_000)
    assert (learnt.depth, learnt.interval) == (47, 20_000)  # three tokens, no rate (was 49 at 40 ms)
    full = Reading(tat=T0)
    assert learnt.room(full, T0) == 47 and learnt.alone(full, T0) == 47
    # 49 units: 49 * 20 ms - (1 s - 60 ms) = 40 ms after the bucket is full.
    assert learnt.frees_at(full, T0, 49) == T0 + 40 * MS
    assert learnt.alone(full, T0 + 40 * MS) == 49 and learnt.alone(full, T0 + 40 * MS - US) == 48
    assert learnt.alone(Reading(), T0) == 50  # a bucket never charged
    # Something promised (a dispatched call not started yet): the clamped rule only.
    assert learnt.alone(full, T0 + 40 * MS, reserved=1) == 46
    # A guard the burst cannot hold slows the rate: k * interval + (1 + k) * extra >= guard.
    small = TokenBucket("k", 5, timedelta(seconds=1), burst=10).with_guard(20 * MS).with_learnt_guard(2500 * MS)
    k, extra = small.reserve, small.interval - small._interval_exact
    assert k == 9 and k * small._interval_exact + (1 + k) * extra >= 2_500_000


def _api_admits_every_arrival(arrivals: list[tuple[int, int]], burst: int, interval: Fraction) -> bool:
    """The API's bucket (burst, interval) on arrivals (time in us, units): never fewer tokens than asked."""
    tokens, last = Fraction(burst), None
    for t, units in sorted(arrivals):
        if last is not None:
            tokens = min(Fraction(burst), tokens + (t - last) / interval)
        last = t
        if tokens < units:
            return False
        tokens -= units
    return True


@settings(max_examples=400, deadline=None)
@given(
    limit=st.integers(1, 60), period_ms=st.integers(5, 2000), burst=st.integers(1, 60),
    floor_ms=st.integers(0, 40), learnt_ms=st.integers(0, 400),
    calls=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from([0, 0, 0, 1, 1000, 20_000, 300_000]), st.integers(0, 100)),
        min_size=1, max_size=60,
    ),
)
def test_a_greedy_client_under_a_learnt_guard_keeps_the_apis_bucket_and_every_accepted_cost_starts(
    limit, period_ms, burst, floor_ms, learnt_ms, calls
):
    """Costs send() accepts (under the configured guard), started as soon as the policy admits
    them (room, alone, frees_at, charge), each arriving 0 to g after its start, g the learnt guard:
    the API's bucket admits every arrival, and each call starts at most g after the bucket is full."""
    period = timedelta(milliseconds=period_ms)
    configured = TokenBucket("k", limit, period, burst=burst).with_guard(floor_ms * MS)
    guard = floor_ms * MS + learnt_ms * MS
    policy = configured.with_learnt_guard(guard)
    g = guard // US
    tat: datetime | None = None
    now = T0
    arrivals = []
    for seed, idle, share in calls:
        cost = 1 + seed % configured.capacity()
        now += idle * US
        reading = Reading(tat=tat)
        if policy.alone(reading, now) < cost:
            until = policy.frees_at(reading, now, cost)
            assert until is not None and until > now
            # Eventually, and soon: at most g after the bucket is full (nothing else started).
            assert until <= max(tat or now, now) + guard
            assert policy.alone(reading, until) >= cost
            assert policy.alone(reading, until - US) < cost
            now = until
        tat = policy.charge(reading, now, cost)
        arrivals.append(((now - T0) // US + g * share // 100, cost))
    assert _api_admits_every_arrival(arrivals, burst, Fraction(period_ms * 1000, limit))


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 20), period_ms=st.integers(5, 2000), burst=st.integers(2, 20),
    guard_ms=st.integers(0, 300), costs=st.lists(st.integers(1, 20), min_size=2, max_size=12),
)
def test_the_clamped_rule_and_the_alone_rule_agree_below_the_depth(limit, period_ms, burst, guard_ms, costs):
    """``alone`` never says less than ``room``, and says more only with nothing promised."""
    policy = TokenBucket("k", limit, timedelta(milliseconds=period_ms), burst=burst, guard=guard_ms * MS)
    tat = None
    for i, cost in enumerate(costs):
        now = T0 + i * 7 * MS
        reading = Reading(tat=tat)
        assert policy.alone(reading, now) >= policy.room(reading, now)
        assert policy.alone(reading, now, reserved=1) == policy.room(reading, now, reserved=1)
        assert policy.tolerance >= policy.depth * policy.interval
        tat = policy.charge(reading, now, min(cost, policy.burst))


def test_a_worker_writes_only_a_delay_that_changes_what_its_start_read():
    from dispatcher import arrivals

    span = timedelta(seconds=1)
    kept = {"k": DelayMemory(30 * MS, timedelta(0), T0)}
    with arrivals.reading_clock():
        pass
    clock_read, _ = arrivals.begin()
    noted = arrivals.Noted({"k": span}, kept, T0 + 100 * MS, {"k": 30 * MS}, {"k": [timedelta(seconds=1)]}, {})
    assert arrivals.to_write(clock_read, noted, arrivals.Sent(20 * MS, 20 * MS)) == {}
    assert arrivals.to_write(clock_read, noted, arrivals.Sent(40 * MS, 40 * MS)) == {40 * MS: {"k": span}}
    assert arrivals.to_write(None, noted, arrivals.Sent(40 * MS, 40 * MS)) == {}
    # A bucket was charged at the start with a guard learnt from 30 ms: a send 40 ms after the
    # start moves it on by 10 ms; one within 30 ms does not move it.
    assert arrivals.overdue(noted, arrivals.Sent(20 * MS, 20 * MS)) == {}
    assert arrivals.overdue(noted, arrivals.Sent(40 * MS, 40 * MS)) == {"k": ([timedelta(seconds=1)], 10 * MS)}
    # A held key's buckets were settled at its release: only a send marked later than that counts.
    held = noted._replace(holds={"k": 25 * MS})
    assert arrivals.overdue(held, arrivals.Sent(40 * MS, 20 * MS)) == {}
    assert arrivals.overdue(held, arrivals.Sent(40 * MS, 20 * MS, 3 * MS)) == {"k": ([timedelta(seconds=1)], 3 * MS)}


@pytest.mark.django_db(transaction=True)
def test_a_late_send_moves_the_keys_buckets_on_by_how_late_it_was():
    from dispatcher.limits.ledger import push_buckets
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


@pytest.mark.django_db
def test_a_start_that_waits_for_its_slot_reads_the_start_clock_again_after_the_wait(monkeypatch):
    """The wait for a slot (holding the key locks) is no start-to-send delay: the worker measures
    the send from the clock read after it, which the start is judged and recorded on (or later)."""
    from dispatcher import arrivals
    from dispatcher.calls import start
    from dispatcher.models import CallQueue
    from tests.integration.test_lifecycle import claim_all

    edit.set_policy("api", 2, timedelta(minutes=1))
    calls = [CallQueue.objects.send("noop", {}, keys=["api"]) for _ in range(2)]
    first, second = sorted(claim_all(calls[0].key_set, 2).calls, key=lambda c: c.id)
    edit.set_policy("api", 1, timedelta(minutes=1))
    assert CallQueue.objects.start(first.id, first.dispatch_no, "w").state == "started"
    events: list[str] = []
    real_reading = arrivals.reading_clock

    def reading_clock():
        events.append("mark")
        return real_reading()

    monkeypatch.setattr(arrivals, "reading_clock", reading_clock)
    monkeypatch.setattr(start.time, "sleep", lambda seconds: events.append("wait"))
    monkeypatch.setattr(start, "HOLD_FOR_SLOT", timedelta(minutes=2))
    started = CallQueue.objects.start(second.id, second.dispatch_no, "w", may_wait=timedelta(minutes=2))
    assert started.state == "early"  # the wait was skipped here: the slot is still a minute away
    assert events == ["mark", "wait", "mark"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_calls_of_one_message_keep_their_send_delay_for_the_arrival_guard():
    """DISPATCHER_CALLS_PER_MESSAGE > 1: each handler thread of a message measures its own send
    from the group's start clock, and the keys learn it, as a call alone does (without it, a
    worker running messages of 8 calls under -P threads overflowed a binding window at the API)."""
    from dispatcher.models import CallQueue, KeyState
    from dispatcher.worker import execute_many
    from tests.integration.test_lifecycle import claim_all

    edit.set_policy("late", 100, timedelta(minutes=1))
    calls = [CallQueue.objects.send("late_send", {"delay": 0.06}, keys=["late"]) for _ in range(3)]
    claimed = claim_all(calls[0].key_set, 3).calls
    assert execute_many([(c.id, c.dispatch_no) for c in claimed]) == {"done": 3}
    assert KeyState.objects.get(key="late").send_delay_us >= 60_000


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_message_keeps_its_calls_send_delays_without_opening_database_sessions():
    """The delays a message's handler threads measure are written on the worker slot's own
    connection: a handler thread that opened one only for that write cost a new database session
    (one per six calls at 8 per message under -P threads)."""
    from django.db.backends.signals import connection_created

    from dispatcher.models import CallQueue, KeyState
    from dispatcher.worker import execute_many
    from tests.integration.test_lifecycle import claim_all

    # Buckets with a burst: their delays are kept after the answers (a window key's late delay is
    # kept before its request goes out, by the process's delay writer: test_window_late_send.py;
    # their lateness moves them on as the requests go out, on that writer's connection:
    # test_bucket_late_send.py).
    edit.set_policy("late:*", 100, timedelta(minutes=1), burst=100)
    # Four keys never measured: every call's delay is its key's first, so each is written.
    calls = [CallQueue.objects.send("late_send", {"delay": 0.02}, keys=[f"late:{i}"]) for i in range(4)]
    claimed = [c for call in calls for c in claim_all(call.key_set, 1).calls]
    opened: list[object] = []

    def count(sender, connection, **kwargs):
        opened.append(threading.current_thread().name)

    connection_created.connect(count)
    try:
        assert execute_many([(c.id, c.dispatch_no) for c in claimed]) == {"done": 4}
    finally:
        connection_created.disconnect(count)
    assert all(state.send_delay_us >= 20_000 for state in KeyState.objects.filter(key__startswith="late:"))
    assert KeyState.objects.filter(key__startswith="late:").count() == 4
    # No handler thread's; the writer's one (kept for the process's next writes), if it had none.
    assert set(opened) <= {"dispatcher-delays_0"}, opened
