"""A late start (``guard.LateStart``): a start whose request arrived later than its windows
counted it under is counted by them, once their span no longer holds it, until a period after
its arrival, as the API's window holds it; no other start is taxed by its delay."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dispatcher.limits import gate, ledger
from dispatcher.limits.guard import LATE_MAX, LateStart, late_starts, late_text, merged_leaves_at
from dispatcher.limits.shapes import SlidingWindow
from dispatcher.models import KeyState, StartLog

AT = datetime(2030, 1, 1, tzinfo=UTC)
MS = timedelta(milliseconds=1)
SECOND = timedelta(seconds=1)


def test_late_starts_are_kept_as_text_and_read_back():
    starts = [LateStart(AT, 312 * MS, 1), LateStart(AT + SECOND, 45 * MS, 3)]
    assert late_starts(KeyState(key="k", late_starts=late_text(starts))) == starts
    assert late_starts(KeyState(key="k")) == []
    assert late_starts(None) == []


def test_the_nth_unit_to_leave_merges_the_late_starts_with_the_log():
    log = [AT + 10 * MS, AT + 20 * MS, AT + 30 * MS]

    def logged(n: int) -> datetime | None:
        return log[n - 1] if n <= len(log) else None

    late = [(AT + 15 * MS, 1), (AT + 40 * MS, 1)]
    merged = sorted(log + [at for at, _ in late])
    assert [merged_leaves_at(late, logged, n) for n in range(1, 6)] == merged
    assert merged_leaves_at(late, logged, 6) is None
    assert merged_leaves_at([], logged, 2) == log[1]


def one_unit_at_a_time(late: list[tuple[datetime, int]], logged, n: int) -> datetime | None:
    """The n-th unit to leave, trying every count of the late units first, one unit at a time."""
    units = [at for at, count in late for _ in range(count)]
    found = []
    for first in range(min(len(units), n) + 1):
        rest = logged(n - first) if n > first else None
        if n > first and rest is None:
            continue
        found.append(max(m for m in (units[first - 1] if first else None, rest) if m is not None))
    return min(found, default=None)


@given(
    log_gaps=st.lists(st.integers(1, 50), max_size=12),
    late=st.lists(st.tuples(st.integers(0, 600), st.integers(0, 6)), max_size=5),
    n=st.integers(1, 40),
)
def test_a_late_starts_units_leave_together_as_if_counted_one_by_one(log_gaps, late, n):
    """Trying only each late start's end gives what trying every one of its units gives."""
    log = [AT + sum(log_gaps[: i + 1]) * MS for i in range(len(log_gaps))]

    def logged(k: int) -> datetime | None:
        return log[k - 1] if k <= len(log) else None

    leaving = sorted((AT + at * MS, units) for at, units in late)
    assert merged_leaves_at(leaving, logged, n) == one_unit_at_a_time(leaving, logged, n)


def test_a_late_start_of_thousands_of_units_costs_a_probe_of_the_log_not_one_per_unit():
    """A token budget's late start of 5,000 units: when the 4,000th unit of its window leaves
    is found with one read of the log (none of the late units first; all 4,000 of them need
    none), not one for each count of them (4,000 reads)."""
    log = [AT + k * MS for k in range(1, 10_001)]
    probes = []

    def logged(k: int) -> datetime | None:
        probes.append(k)
        return log[k - 1] if k <= len(log) else None

    assert merged_leaves_at([(AT + 5 * SECOND, 5_000)], logged, 4_000) == log[3_999]
    assert len(probes) == 1
    probes.clear()
    assert merged_leaves_at([(AT + 50 * MS, 5_000)], logged, 4_000) == AT + 50 * MS
    assert len(probes) == 1


def window_reading(now: datetime, window: SlidingWindow):
    state = KeyState.objects.get(key="w")
    (reading,) = gate.read_policies({"w": [window]}, {"w": state}, now)["w"]
    return reading


@pytest.mark.django_db
def test_a_window_counts_a_late_start_until_a_period_after_its_arrival_and_no_longer():
    """A window of 2 per second under a guard of 20 ms. Its first start's request arrived up to
    300 ms after it: the log stops counting it 1.02 s after it, the API's window holds it until
    1.3 s after it. Counted once while the log holds it, then as a late start, then not at all."""
    StartLog.objects.create(key="w", started_at=AT, units=1, cum=1, call_id=1)
    StartLog.objects.create(key="w", started_at=AT + 500 * MS, units=1, cum=2, call_id=2)
    KeyState.objects.create(key="w", total=2, late_starts=late_text([LateStart(AT, 300 * MS, 1)]))
    window = SlidingWindow("w", 2, SECOND, guard=20 * MS)
    assert window_reading(AT + 900 * MS, window).used == 2
    # Past the log's span the late start still counts: the window is full until 1.3 s.
    later = window_reading(AT + 1100 * MS, window)
    assert later.used == 2
    assert window.frees_at(later, AT + 1100 * MS, 1) == AT + 1300 * MS + timedelta(microseconds=1)
    assert window_reading(AT + 1301 * MS, window).used == 1
    # Without it the window had freed its slot at 1.02 s (what the API's window would refuse).
    KeyState.objects.filter(key="w").update(late_starts="")
    assert window_reading(AT + 1100 * MS, window).used == 1


@pytest.mark.django_db
def test_a_full_token_budget_with_a_late_start_of_thousands_of_units_says_when_it_frees_in_a_few_reads():
    """A budget of 10,000 units a minute; a process's first request of 4,000 units, its
    connection's opening 300 ms long, was kept as a late start, and 6,000 units of starts after
    it fill the rest. Just past the log's span of it, judging when 3,000 more fit reads the log
    once, not once per count of late units tried (3,001 reads at every blocked check before)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    minute = timedelta(minutes=1)
    for n in range(6):
        StartLog.objects.create(key="w", started_at=AT + (n + 1) * SECOND, units=1_000, cum=(n + 1) * 1_000, call_id=n + 1)
    late = LateStart(AT - 20 * SECOND, 300 * MS, 4_000)
    KeyState.objects.create(key="w", total=6_000, late_starts=late_text([late]))
    window = SlidingWindow("w", 10_000, minute, guard=20 * MS)
    now = late.at + window.span + 80 * MS
    reading = window_reading(now, window)
    assert reading.used == 10_000
    with CaptureQueriesContext(connection) as reads:
        frees = window.frees_at(reading, now, 3_000)
    # The late units leave together, a minute after their arrival by the window's reckoning.
    assert frees == late.arrives_by() - window.guard + window.span + timedelta(microseconds=1)
    assert len(reads) <= 1, [q["sql"] for q in reads]


@pytest.mark.django_db(transaction=True)
def test_keep_late_keeps_the_calls_latest_start_drops_old_ones_and_says_which_keys_are_full():
    from dispatcher.clock import db_now

    now = db_now()
    StartLog.objects.create(key="a", started_at=now - SECOND, units=1, cum=1, call_id=7)
    StartLog.objects.create(key="a", started_at=now, units=2, cum=3, call_id=7)  # started again
    StartLog.objects.create(key="b", started_at=now, units=1, cum=1, call_id=7)
    old = LateStart(now - timedelta(minutes=5), 50 * MS, 1)
    KeyState.objects.create(key="a", total=3, late_starts=late_text([old]))
    KeyState.objects.create(key="b", total=1, late_starts=late_text([LateStart(now, MS, 1)] * LATE_MAX))
    KeyState.objects.create(key="c")  # no start of the call: nothing to keep
    spans = {"a": 2 * SECOND, "b": 2 * SECOND, "c": 2 * SECOND}
    assert ledger.keep_late(spans, 7, 80 * MS) == ["b"]
    assert late_starts(KeyState.objects.get(key="a")) == [LateStart(now, 80 * MS, 2)]
    assert len(late_starts(KeyState.objects.get(key="b"))) == LATE_MAX
    assert KeyState.objects.get(key="c").late_starts == ""
