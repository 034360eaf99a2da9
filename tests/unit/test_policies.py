"""The policy shapes against straightforward reference simulations on a controlled clock, no database."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatcher.limits.shapes import PolicyError, Reading, SlidingWindow, TokenBucket, make_policy, validate
from tests.window_log import LogEntry, first_in_window, leaves_at_from_log, used_from_log

T0 = datetime(2030, 1, 1, tzinfo=UTC)
US = timedelta(microseconds=1)


def at(us: int) -> datetime:
    return T0 + us * US


# --- references: the shapes as their definitions say, counted the slow way ------------------------


class WindowReference:
    """At most ``limit`` units in any closed interval of length ``period``: count them all."""

    def __init__(self, limit: int, period_us: int) -> None:
        self.limit, self.period_us = limit, period_us
        self.starts: list[list[int]] = []  # [time_us, units]

    def used(self, t: int) -> int:
        return sum(u for s, u in self.starts if t - self.period_us <= s <= t)

    def admits(self, t: int, cost: int) -> bool:
        return self.used(t) + cost <= self.limit


class BucketReference:
    """Tokens refill continuously at limit/period up to burst; a start takes its cost."""

    def __init__(self, limit: int, period_us: int, burst: int) -> None:
        self.rate = Fraction(limit, period_us)
        self.burst = burst
        self.tokens = Fraction(burst)
        self.last = 0

    def refill(self, t: int) -> None:
        self.tokens = min(Fraction(self.burst), self.tokens + (t - self.last) * self.rate)
        self.last = t

    def admits(self, t: int, cost: int) -> bool:
        self.refill(t)
        return self.tokens >= cost

    def take(self, cost: int) -> None:
        self.tokens -= cost

    def refund(self, t: int, units: int) -> None:
        self.refill(t)
        self.tokens = min(Fraction(self.burst), self.tokens + units)

    def edit(self, t: int, limit: int, period_us: int, burst: int) -> None:
        self.refill(t)
        owed = self.burst - self.tokens
        self.rate, self.burst = Fraction(limit, period_us), burst
        self.tokens = burst - owed


# --- the model under test, driven as the limiter drives it ----------------------------------------


class WindowModel:
    """A key's start log with running totals, read the way the database reads it."""

    def __init__(self, policy: SlidingWindow) -> None:
        self.policy = policy
        self.log: list[LogEntry] = []
        self.total = 0

    def reading(self, now: datetime) -> Reading:
        first = first_in_window(self.log, now - self.policy.span)
        base = first.cum - first.units if first else self.total
        return Reading(
            used=used_from_log(self.total, first), leaves_at=lambda n: leaves_at_from_log(self.log, base, n)
        )

    def start(self, now: datetime, cost: int) -> None:
        self.total += cost
        self.log.append(LogEntry(now, cost, self.total))

    def correct(self, index: int, delta: int) -> None:
        """Change one start's units: its entry and every later running total move by delta."""
        entry = self.log[index]
        self.log[index] = LogEntry(entry.at, entry.units + delta, entry.cum + delta)
        for i in range(index + 1, len(self.log)):
            e = self.log[i]
            self.log[i] = LogEntry(e.at, e.units, e.cum + delta)
        self.total += delta


def max_units_in_span(starts: list[tuple[int, int]], span: int) -> int:
    best = 0
    for i, (t, _) in enumerate(starts):
        best = max(best, sum(u for s, u in starts[i:] if s <= t + span))
    return best


def bucket_conforms(starts: list[tuple[int, int]], limit: int, period_us: int, burst: int) -> bool:
    """Whether every run of starts fits burst plus what refills between its first and last."""
    for i in range(len(starts)):
        units = 0
        for j in range(i, len(starts)):
            units += starts[j][1]
            if units > burst + Fraction(limit * (starts[j][0] - starts[i][0]), period_us):
                return False
    return True


steps = st.lists(
    st.tuples(st.integers(0, 400_000), st.integers(1, 4), st.integers(-1, 3)), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(limit=st.integers(1, 8), period_ms=st.integers(1, 2000), steps=steps, edits=st.lists(st.integers(1, 8), max_size=3))
def test_a_greedy_client_is_admitted_by_the_window_exactly_when_the_reference_admits(limit, period_ms, steps, edits):
    policy = SlidingWindow("k", limit, timedelta(milliseconds=period_ms))
    model, ref = WindowModel(policy), WindowReference(limit, period_ms * 1000)
    t = 0
    edits_made = False
    for n, (gap, cost, refund_of) in enumerate(steps):
        t += gap
        now = at(t)
        if edits and n % 15 == 14:
            new = edits.pop()
            policy = SlidingWindow("k", new, policy.period)
            model.policy, ref.limit = policy, new
            edits_made = True
        admitted = model.policy.room(model.reading(now), now) >= cost
        assert admitted == ref.admits(t, cost), (t, cost)
        if admitted:
            model.start(now, cost)
            ref.starts.append([t, cost])
            # What the start itself sees in its window never exceeds the limit in force.
            assert ref.used(t) <= ref.limit
        else:
            # When room returns, it is there, and not a microsecond earlier.
            frees = policy.frees_at(model.reading(now), now, cost)
            if cost <= ref.limit and frees is not None:
                later = round((frees - T0) / US)
                assert ref.admits(later, cost)
                assert not ref.admits(later - 1, cost) or later - 1 < t
        if refund_of >= 0 and model.log:
            # A handler reports it used fewer units than charged (never below zero).
            index = refund_of % len(model.log)
            delta = -min(model.log[index].units, 1)
            model.correct(index, delta)
            ref.starts[index][1] += delta
    if not edits_made:
        assert max_units_in_span([(s, u) for s, u in ref.starts], period_ms * 1000) <= limit


@settings(max_examples=150, deadline=None)
@given(
    limit=st.integers(1, 10), per_unit_us=st.integers(1, 300_000), burst=st.integers(1, 6),
    steps=steps, edit=st.none() | st.tuples(st.integers(1, 10), st.integers(1, 6)),
)
def test_a_greedy_client_is_admitted_by_the_bucket_exactly_when_the_reference_admits(
    limit, per_unit_us, burst, steps, edit
):
    policy = TokenBucket("k", limit, timedelta(microseconds=per_unit_us * limit), burst=burst)
    ref = BucketReference(limit, per_unit_us * limit, burst)
    tat = None
    t = 0
    started: list[tuple[int, int]] = []
    for n, (gap, cost, refund) in enumerate(steps):
        t += gap
        now = at(t)
        if edit and n == len(steps) // 2:
            new_limit, new_burst = edit
            new = TokenBucket("k", new_limit, timedelta(microseconds=per_unit_us * new_limit), burst=new_burst)
            tat = policy.rebase(tat, now, new)
            ref.edit(t, new_limit, per_unit_us * new_limit, new_burst)
            policy, started = new, []
        reading = Reading(tat=tat)
        admitted = policy.room(reading, now) >= cost
        assert admitted == ref.admits(t, cost), (t, cost, tat)
        if admitted:
            tat = policy.charge(reading, now, cost)
            ref.take(cost)
            started.append((t, cost))
        elif cost <= policy.burst:
            frees = policy.frees_at(reading, now, cost)
            later = round((frees - T0) / US)
            assert later >= t and policy.room(Reading(tat=tat), frees) >= cost
            assert later == t or policy.room(Reading(tat=tat), frees - US) < cost
        if refund > 0 and started:
            # Gives back at most what the last start took.
            units = min(refund, started[-1][1])
            tat = policy.refund(tat, now, units)
            ref.refund(t, units)
            started[-1] = (started[-1][0], started[-1][1] - units)
    assert bucket_conforms(started, policy.limit, _us(policy.period), policy.burst)


def _us(value: timedelta) -> int:
    return value // US


@settings(max_examples=200, deadline=None)
@given(
    limit=st.integers(1, 10), per_unit_us=st.integers(1, 300_000), burst=st.integers(1, 6),
    starts=st.lists(st.tuples(st.integers(0, 600_000), st.integers(0, 4)), min_size=1, max_size=12),
    which=st.integers(0, 11), wait=st.integers(0, 600_000),
)
def test_a_refund_of_any_start_leaves_the_bucket_as_if_the_start_had_cost_nothing(
    limit, per_unit_us, burst, starts, which, wait
):
    # GCRA's state is a max over suffixes of the starts; taking one start's units out of it is
    # exact only if the units of it that had refilled before a later start are not given back twice.
    policy = TokenBucket("k", limit, timedelta(microseconds=per_unit_us * limit), burst=burst)
    timed, t = [], 0
    for gap, units in starts:
        t += gap
        timed.append((at(t), units))
    j = which % len(timed)
    now = at(t + wait)
    refunded = policy.refund(policy.replay(timed), now, timed[j][1], later=timed[j + 1:])
    without = policy.replay(timed[:j] + timed[j + 1:])
    assert policy.tokens(Reading(tat=refunded), now) == policy.tokens(Reading(tat=without), now)
    # A start the bucket never charged (it began after it) gives nothing back.
    after = policy.replay(timed[j + 1:])
    assert policy.refund(after, now, timed[j][1], later=timed[j + 1:]) == after


@settings(max_examples=100, deadline=None)
@given(
    limit=st.integers(1, 10), period_ms=st.integers(5, 2000), burst=st.integers(1, 12),
    guard_ms=st.integers(0, 100), steps=st.lists(st.tuples(st.integers(0, 200_000), st.integers(0, 100)), max_size=50),
)
def test_with_the_guard_arrivals_late_by_up_to_the_guard_still_keep_the_apis_policy(
    limit, period_ms, burst, guard_ms, steps
):
    period, guard = timedelta(milliseconds=period_ms), timedelta(milliseconds=guard_ms)
    window = SlidingWindow("k", limit, period, guard=guard)
    bucket = TokenBucket("k", limit, period, burst=burst, guard=guard)
    wmodel = WindowModel(window)
    tat = None
    t = 0
    window_arrivals, bucket_arrivals = [], []
    for gap, late_share in steps:
        t += gap
        now = at(t)
        late = guard_ms * 1000 * late_share // 100
        if window.room(wmodel.reading(now), now) >= 1:
            wmodel.start(now, 1)
            window_arrivals.append((t + late, 1))
        if bucket.room(Reading(tat=tat), now) >= 1:
            tat = bucket.charge(Reading(tat=tat), now, 1)
            bucket_arrivals.append((t + late, 1))
    window_arrivals.sort()
    bucket_arrivals.sort()
    assert max_units_in_span(window_arrivals, period_ms * 1000) <= limit
    assert bucket_conforms(bucket_arrivals, limit, period_ms * 1000, burst)


def test_the_guards_cost_in_throughput_is_what_the_docs_state():
    # A smooth rate of 5 per second with a 20 ms guard: one start every 220 ms (91%).
    smooth = TokenBucket("k", 5, timedelta(seconds=1), burst=1, guard=timedelta(milliseconds=20))
    assert smooth.interval == 220_000 and smooth.depth == 1
    # A slow bucket pays a little rate (4%) and keeps its whole burst: 40 deep at 2 per second.
    shopify = TokenBucket("k", 2, timedelta(seconds=1), burst=40, guard=timedelta(milliseconds=20))
    assert shopify.interval == 520_000 and shopify.depth == 40
    # A fast deep bucket pays from its burst, not its rate: 100 per second, 100 deep.
    stripe = TokenBucket("k", 100, timedelta(seconds=1), burst=100, guard=timedelta(milliseconds=20))
    assert stripe.interval == 10_000 and stripe.depth == 98
    window = SlidingWindow("k", 10, timedelta(seconds=2), guard=timedelta(milliseconds=20))
    assert window.span == timedelta(seconds=2, milliseconds=20)


def test_a_full_bucket_admits_its_burst_at_once_then_one_unit_per_interval():
    bucket = TokenBucket("k", 2, timedelta(seconds=1), burst=40)
    tat = None
    for _ in range(40):
        assert bucket.room(Reading(tat=tat), T0) >= 1
        tat = bucket.charge(Reading(tat=tat), T0, 1)
    assert bucket.room(Reading(tat=tat), T0) == 0
    assert bucket.frees_at(Reading(tat=tat), T0, 1) == T0 + timedelta(milliseconds=500)
    assert bucket.drain(0, 80) == timedelta(seconds=40)


def test_each_shape_explains_itself_in_one_line():
    assert make_policy("k", 10, timedelta(seconds=2)).explain() == "10 per 2s (sliding window: at most 10 in any 2s)"
    assert make_policy("k", 5, timedelta(seconds=1), burst=1).explain() == "5 per 1s, burst 1 (smooth rate: one every 200ms)"
    assert make_policy("k", 2, timedelta(seconds=1), burst=40).explain() == "2 per 1s, burst 40 (token bucket)"


def test_a_window_drain_counts_whole_windows_beyond_the_room_there_is_now():
    window = make_policy("k", 10, timedelta(seconds=2))
    assert window.drain(4, 4) == timedelta(0)
    assert window.drain(4, 25) == timedelta(seconds=6)


@pytest.mark.parametrize(
    ("limit", "period", "burst", "concurrency", "message"),
    [
        (0, timedelta(seconds=1), None, None, "limit"),
        (True, timedelta(seconds=1), None, None, "limit"),
        (5, timedelta(0), None, None, "period"),
        (5, timedelta(seconds=1), 0, None, "burst"),
        (5, timedelta(seconds=1), -3, None, "burst"),
        (5, timedelta(seconds=1), 2.5, None, "burst"),
        (5, timedelta(seconds=1), None, 0, "concurrency"),
        (2_000_000, timedelta(seconds=1), 5, None, "microsecond"),
    ],
)
def test_bad_policies_are_refused_with_a_clear_error(limit, period, burst, concurrency, message):
    with pytest.raises(PolicyError, match=message):
        validate(limit, period, burst, concurrency)


def test_an_edit_re_judges_a_bucket_state_no_start_could_have_left():
    """report_cost(2**31-1) once pushed a 2/s bucket's state to 2062; an edit to 1000/s carried a
    24-day wait. The units carried are at most twice the old depth (its burst plus one bounded
    correction), whatever was stored."""
    now = at(0)
    old = TokenBucket("k", 2, timedelta(seconds=1), burst=4)
    new = TokenBucket("k", 1000, timedelta(seconds=1), burst=4)
    frozen = now + timedelta(days=36 * 365)
    assert new.rebase(frozen, now, new) - now <= timedelta(milliseconds=8)
    carried = old.rebase(frozen, now, new)
    assert carried - now == timedelta(milliseconds=2 * old.depth)  # 2 x depth units at 1 ms each
    # A state a start could leave is carried whole.
    owed_three = now + timedelta(milliseconds=1500)
    assert old.rebase(owed_three, now, new) - now == timedelta(milliseconds=3)
