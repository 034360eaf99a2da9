"""Send-time pacing: a key whose policies are all buckets (a smooth rate, a token bucket) has its
buckets judge and charge each start at the moment its request goes out, the start plus the delay
its workers measured lately, and the worker holds the request until then. The guard then covers
only what a hold leaves, not the whole start-to-send delay."""
from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from dispatcher.clock import db_now, from_us, to_us
from dispatcher.limits import edit
from dispatcher.limits.catalog import Policies
from dispatcher.limits.guard import HOLD_SPREAD, held_guard
from dispatcher.limits.shapes import Reading, TokenBucket
from dispatcher.models import CallQueue, KeyBucket, KeyState
from tests.integration.test_shapes import claim_all, run_all

MS = timedelta(milliseconds=1)
T0 = datetime(2026, 1, 1, 12, 0)
pytestmark = pytest.mark.django_db(transaction=True)


def measured(key: str, delay: timedelta) -> None:
    """Say that the key's workers measured this start-to-send delay just now."""
    KeyState.objects.update_or_create(
        key=key, defaults={"send_delay_us": delay // timedelta(microseconds=1), "send_delay_since": db_now()}
    )


def owing(key: str) -> datetime:
    """Leave the key's bucket (1 s) owing 100 ms, as under a backlog (a full bucket is not held);
    return its state."""
    tat = db_now() + 100 * MS
    KeyBucket.objects.update_or_create(
        key=key, period=timedelta(seconds=1), defaults={"tat_us": to_us(tat), "since": db_now() - timedelta(seconds=1)}
    )
    return tat


def sent_after_judged(call: CallQueue) -> timedelta:
    """How long after the clock its start was judged on the handler sent (read the database clock)."""
    call.refresh_from_db()
    return datetime.fromisoformat(call.result["at"]) - datetime.fromisoformat(call.result["judged"])


@pytest.mark.parametrize("method", ["db_clock", "marked_clock"])
def test_a_held_request_goes_out_no_sooner_than_its_bucket_was_charged_for(method):
    """Held before the handler (a handler that marks no send), or where it marks its send."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send(method, {}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert sent_after_judged(call) >= 80 * MS
    # Charged from the recorded start (a little later than the clock it was judged on) plus the
    # hold, or from the bucket's state if later: one interval of 200 ms, lengthened by the guard
    # (20 ms + the 5 ms a hold leaves). (More only if the request went out later than the guard
    # allows: the bucket moves on by that.)
    (bucket,) = KeyBucket.objects.filter(key="paced")
    charged = from_us(bucket.tat_us) - max(tat, call.started_at + 80 * MS)
    assert 225 * MS <= charged < 225 * MS + 20 * MS


def test_a_full_bucket_is_not_held_its_guard_takes_the_delay():
    """At low load (the bucket full) the guard with the whole delay admits the call at once: it
    is not held, and costs no latency."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 150 * MS)
    call = CallQueue.objects.send("db_clock", {}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert sent_after_judged(call) < 150 * MS
    # Charged at the start: one interval lengthened by the whole guard, 20 ms + 150 ms measured.
    (bucket,) = KeyBucket.objects.filter(key="paced")
    assert from_us(bucket.tat_us) - call.started_at == 200 * MS + 170 * MS


def test_a_key_with_a_window_is_not_held_its_guard_takes_the_delay():
    edit.set_policy("mixed", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 1000, timedelta(hours=1))
    measured("mixed", 80 * MS)
    call = CallQueue.objects.send("db_clock", {}, keys=["mixed"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    (bucket,) = KeyBucket.objects.filter(key="mixed")
    # Charged at the start, one interval lengthened by the whole guard: 20 ms + 80 ms measured.
    assert from_us(bucket.tat_us) - call.started_at == 200 * MS + 100 * MS


def test_a_held_key_remembers_the_delay_before_its_hold_so_a_hold_never_feeds_itself():
    """A hold of 80 ms and a handler that works 30 ms before it sends: the request goes out 80 ms
    after its start or later, but the key keeps what it took without the hold (30-odd ms)."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    owing("paced")
    call = CallQueue.objects.send("marked_clock", {"work": 0.03}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert sent_after_judged(call) >= 80 * MS
    # Within its span the memory only grows: the delay after the hold (80 ms and more) would
    # have raised it; the one before did not.
    assert KeyState.objects.get(key="paced").send_delay_us == 80_000
    # In a new span (the memory's is 1 s) the delay before the hold is what the key keeps.
    KeyState.objects.filter(key="paced").update(send_delay_since=db_now() - timedelta(seconds=5))
    second = CallQueue.objects.send("marked_clock", {"work": 0.03}, keys=["paced"])
    owing("paced")
    assert run_all(claim_all(second.key_set).calls) == ["done"]
    assert 30_000 <= KeyState.objects.get(key="paced").send_delay_us < 80_000


def test_the_guards_and_holds_a_start_applies():
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 1000, timedelta(hours=1))
    measured("paced", 80 * MS)
    measured("mixed", 80 * MS)
    measured("fresh", timedelta(0))
    edit.set_policy("fresh", 5, timedelta(seconds=1), burst=1)
    policies = Policies.load()
    states = {s.key: s for s in KeyState.objects.all()}
    policies.apply_guards(["paced", "mixed", "fresh"], states, db_now())
    assert policies.holds == {"paced": 80 * MS, "fresh": timedelta(0)}
    assert policies.guards == {"paced": 20 * MS + HOLD_SPREAD, "mixed": 100 * MS, "fresh": 20 * MS}
    # What the guard allows a request after its start: the hold and the spread a hold leaves.
    assert policies.learnt_delays == {"paced": 80 * MS + HOLD_SPREAD, "mixed": 80 * MS, "fresh": timedelta(0)}
    (paced,) = policies.for_key("paced")
    assert isinstance(paced, TokenBucket) and paced.hold == 80 * MS
    # Released (its bucket full): the guard with the whole delay, no hold.
    policies.release("paced")
    assert (policies.holds, policies.guards["paced"], policies.learnt_delays["paced"]) == (
        {"fresh": timedelta(0)}, 100 * MS, 80 * MS,
    )
    (paced,) = policies.for_key("paced")
    assert isinstance(paced, TokenBucket) and (paced.hold, paced.guard) == (timedelta(0), 100 * MS)


def test_held_guard_stays_within_the_cap():
    floor, cap = 20 * MS, 250 * MS
    assert held_guard(floor, cap, timedelta(0)) == (floor, timedelta(0))
    assert held_guard(floor, cap, 2 * MS) == (22 * MS, 2 * MS)
    assert held_guard(floor, cap, 80 * MS) == (floor + HOLD_SPREAD, 80 * MS)
    assert held_guard(floor, cap, 900 * MS) == (floor + HOLD_SPREAD, 230 * MS)
    # A lateness after the hold measured lately widens the guard by it (within the cap).
    assert held_guard(floor, cap, 80 * MS, 12 * MS) == (32 * MS, 80 * MS)
    assert held_guard(floor, cap, 80 * MS, 2 * MS) == (floor + HOLD_SPREAD, 80 * MS)
    assert held_guard(floor, cap, 80 * MS, 900 * MS) == (cap, 80 * MS)
    # Learning off (the cap is the floor): no hold, the configured guard.
    assert held_guard(floor, floor, 80 * MS, 12 * MS) == (floor, timedelta(0))


def test_a_held_key_learns_how_late_its_requests_go_out_after_the_hold_and_its_guard_absorbs_it():
    """A handler held before it is invoked that works 40 ms before it sends: its requests go out
    40-odd ms after their hold. The bucket moves on by what the guard did not allow for, and the
    key keeps the lateness: the next start's guard absorbs it."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send("late_send", {"delay": 0.04}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    state = KeyState.objects.get(key="paced")
    assert 40_000 <= state.hold_late_us < 80_000
    assert state.send_delay_us == 80_000  # the delay before the hold did not grow
    (bucket,) = KeyBucket.objects.filter(key="paced")
    late = timedelta(microseconds=state.hold_late_us)
    # Charged from the start plus the hold (or the bucket's state), then moved on by the lateness
    # beyond the 5 ms its guard allowed.
    assert from_us(bucket.tat_us) - max(tat, call.started_at + 80 * MS) >= 225 * MS + late - 5 * MS
    policies = Policies.load()
    policies.apply_guards(["paced"], {"paced": state}, db_now())
    assert policies.guards["paced"] == 20 * MS + late
    assert policies.holds["paced"] == 80 * MS


@pytest.mark.parametrize("burst", [1, 3])
def test_a_held_bucket_judges_and_charges_a_start_at_its_send_moment(burst):
    plain = TokenBucket("k", 5, timedelta(seconds=1), burst=burst, guard=25 * MS)
    held = plain.with_hold(25 * MS, 80 * MS)
    tat = None
    for i in range(12):
        now = T0 + i * 37 * MS
        reading = Reading(tat=tat)
        assert held.room(reading, now) == plain.room(reading, now + 80 * MS)
        assert held.alone(reading, now) == plain.alone(reading, now + 80 * MS)
        assert held.charge(reading, now, 1) == plain.charge(reading, now + 80 * MS, 1)
        frees = plain.frees_at(reading, now + 80 * MS, burst)
        assert held.frees_at(reading, now, burst) == max(now, frees - 80 * MS)
        if held.room(reading, now) >= 1:
            tat = held.charge(reading, now, 1)


def test_what_a_held_call_keeps_the_delay_before_its_hold_and_its_lateness_after_it():
    """A call of a held key (80 ms) and a key with a window: the held key keeps the delay before
    the hold and how much later than the hold, or than that delay, the request went out; the
    other key the delay after the hold."""
    from dispatcher import arrivals

    span = timedelta(seconds=1)
    with arrivals.reading_clock():
        pass
    clock_read, _ = arrivals.begin()
    noted = arrivals.Noted({"k": span, "w": span}, {}, T0, {}, {}, {"k": 80 * MS}, {})
    assert arrivals.to_write(clock_read, noted, arrivals.Sent.of(85 * MS, 30 * MS)) == {
        ("send_delay", 30 * MS): {"k": span}, ("hold_late", 5 * MS): {"k": span}, ("send_delay", 85 * MS): {"w": span},
    }
    # Later than the hold before it: the delay raises the next hold, only what followed it the guard.
    assert arrivals.to_write(clock_read, noted, arrivals.Sent.of(102 * MS, 100 * MS)) == {
        ("send_delay", 100 * MS): {"k": span}, ("hold_late", 2 * MS): {"k": span}, ("send_delay", 102 * MS): {"w": span},
    }


def test_several_calls_measured_together_never_keep_less_lateness_than_one_of_them():
    """A message's calls of the same keys are kept as one measurement (the largest of each)."""
    from dispatcher import arrivals

    hold = 80 * MS
    calls = [arrivals.Sent.of(100 * MS, 30 * MS), arrivals.Sent.of(95 * MS, 95 * MS), arrivals.Sent.of(84 * MS, 20 * MS)]
    together = None
    for sent in calls:
        together = sent.most(together)
    assert together is not None
    assert together.late(hold) >= max(sent.late(hold) for sent in calls) == 20 * MS
    assert (together.delay, together.natural) == (100 * MS, 95 * MS)
