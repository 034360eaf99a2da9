"""A late start (``guard.LateStart``): a start whose request arrived later than its windows
counted it under is counted by them, once their span no longer holds it, until a period after
its arrival, as the API's window holds it; no other start is taxed by its delay."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

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

    late = [AT + 15 * MS, AT + 40 * MS]
    merged = sorted(log + late)
    assert [merged_leaves_at(late, logged, n) for n in range(1, 6)] == merged
    assert merged_leaves_at(late, logged, 6) is None
    assert merged_leaves_at([], logged, 2) == log[1]


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
