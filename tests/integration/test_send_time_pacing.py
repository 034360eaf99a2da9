"""Send-time pacing: a key whose policies are all buckets (a smooth rate, a token bucket) has its
buckets judge and charge each start at the moment its request goes out, the start plus the delay
its workers measured lately, and the worker holds the request until then. Its guard covers the
network and how late after that moment a request may go out; a request later than that moves
its buckets on before it goes, or, once a later start was charged on them, is not sent."""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from unittest import mock

import pytest
from django.db import connections

from dispatcher import arrivals
from dispatcher.calls import start as start_module
from dispatcher.clock import Offsets, db_now, from_us, to_us
from dispatcher.limits import edit, ledger
from dispatcher.limits.catalog import Policies
from dispatcher.limits.guard import SEND_SLACK
from dispatcher.limits.shapes import Reading, TokenBucket
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState
from dispatcher.worker import execute
from tests.integration.test_shapes import claim_all, run_all

MS = timedelta(milliseconds=1)
T0 = datetime(2026, 1, 1, 12, 0)
pytestmark = pytest.mark.django_db(transaction=True)


def measured(key: str, delay: timedelta) -> None:
    """Say that the key's workers measured this start-to-send delay just now."""
    KeyState.objects.update_or_create(
        key=key, defaults={"send_delay_us": delay // timedelta(microseconds=1), "send_delay_since": db_now()}
    )


def owing(key: str, period: timedelta = timedelta(seconds=1)) -> datetime:
    """Leave the key's bucket owing 100 ms, as under a backlog (a full bucket is not held), as a
    start of before left it (its token 1); return its state."""
    tat = db_now() + 100 * MS
    KeyBucket.objects.update_or_create(
        key=key, period=period, defaults={"tat_us": to_us(tat), "since": db_now() - timedelta(seconds=1), "start": 1}
    )
    return tat


def bucket_state(key: str) -> datetime:
    (bucket,) = KeyBucket.objects.filter(key=key)
    return from_us(bucket.tat_us)


def sent_after_judged(call: CallQueue) -> timedelta:
    """How long after the clock its start was judged on the handler sent (read the database clock)."""
    call.refresh_from_db()
    return datetime.fromisoformat(call.result["at"]) - datetime.fromisoformat(call.result["judged"])


# --- the held bucket's arithmetic (pure) ---------------------------------------------------------


@pytest.mark.parametrize(("limit", "configured", "net", "guard"), [
    # A smooth rate gives its guard at most 2% of its interval, the network's part never under 5 ms.
    (20, 20 * MS, 5 * MS, 6 * MS),     # 2% of 50 ms is 1 ms: the floor
    (5, 20 * MS, 5 * MS, 6 * MS),      # 2% of 200 ms is 4 ms: the floor
    (2, 20 * MS, 9 * MS, 10 * MS),     # 2% of 500 ms is 10 ms, 1 of it the slack
    (1, 20 * MS, 19 * MS, 20 * MS),    # 2% of a second is 20 ms
    (20, 2 * MS, 2 * MS, 3 * MS),      # a configured guard under the floor is kept
])
def test_a_smooth_rate_gives_its_guard_a_share_of_its_rate_and_the_network_at_least_the_floor(limit, configured, net, guard):
    held = TokenBucket("k", limit, timedelta(seconds=1), burst=1).with_hold(configured, 30 * MS, SEND_SLACK)
    assert (held.net, held.guard, held.hold) == (net, guard, 30 * MS)
    # What a request may take after its moment is the slack alone: the rest is the network's.
    assert held.lateness == SEND_SLACK
    assert held.interval == (timedelta(seconds=1) / limit + guard) // timedelta(microseconds=1)


def test_a_bucket_that_holds_a_token_back_keeps_the_whole_guard_and_a_wider_slack():
    """5 per second, 10 deep: the guard costs a token of the burst, not rate, so the network keeps
    the configured 20 ms, and a request may go out 20 ms late (a burst's requests go out together)."""
    held = TokenBucket("k", 5, timedelta(seconds=1), burst=10).with_hold(20 * MS, 30 * MS, SEND_SLACK)
    assert (held.depth, held.interval, held.guard, held.net) == (9, 200_000, 40 * MS, 20 * MS)
    assert held.lateness == TokenBucket.HELD_BURST_SLACK == 20 * MS
    # 50 per second, 50 deep: the 41 ms guard holds back 2 tokens (a third: 61 ms would need 4).
    fast = TokenBucket("k", 50, timedelta(seconds=1), burst=50).with_hold(20 * MS, 30 * MS, SEND_SLACK)
    assert (fast.depth, fast.guard, fast.lateness) == (48, 40 * MS, 20 * MS)


@pytest.mark.parametrize("burst", [1, 3])
def test_a_held_bucket_judges_and_charges_a_start_at_its_send_moment(burst):
    held = TokenBucket("k", 5, timedelta(seconds=1), burst=burst).with_hold(24 * MS, 80 * MS, SEND_SLACK)
    # The same bucket unheld, under the held one's guard, judged at the send moment.
    plain = TokenBucket("k", 5, timedelta(seconds=1), burst=burst, guard=held.guard)
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


def test_the_guards_and_holds_a_start_applies():
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 1000, timedelta(hours=1))
    edit.set_policy("fresh", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    measured("mixed", 80 * MS)
    measured("fresh", timedelta(0))
    policies = Policies.load()
    states = {s.key: s for s in KeyState.objects.all()}
    policies.apply_guards(["paced", "mixed", "fresh"], states, db_now())
    # Nothing measured yet: not held, the configured guard; but a smooth rate's request is
    # settled as it goes out, later than that guard allows (a key with a window never is).
    assert policies.holds == {"paced": 80 * MS}
    assert policies.guards == {"paced": 20 * MS, "mixed": 100 * MS, "fresh": 20 * MS}
    assert policies.settled == {"fresh": 20 * MS}
    # What a request may take after its start: the hold and the slack.
    assert policies.learnt_delays == {"paced": 80 * MS + SEND_SLACK, "mixed": 80 * MS, "fresh": timedelta(0)}
    (paced,) = policies.for_key("paced")
    assert isinstance(paced, TokenBucket) and (paced.hold, paced.net, paced.guard) == (80 * MS, 5 * MS, 6 * MS)
    # Released (its bucket full): the guard with the whole delay, no hold, and settled.
    policies.release("paced")
    assert (policies.holds, policies.guards["paced"], policies.learnt_delays["paced"]) == ({}, 100 * MS, 80 * MS)
    assert policies.settled == {"fresh": 20 * MS, "paced": 100 * MS}
    assert policies.send_holds() == (
        {"fresh": timedelta(0), "paced": timedelta(0)}, {"fresh": 20 * MS, "paced": 100 * MS}
    )
    (paced,) = policies.for_key("paced")
    assert isinstance(paced, TokenBucket) and (paced.hold, paced.guard) == (timedelta(0), 100 * MS)


# --- held requests, through a worker's start and run ---------------------------------------------


@contextlib.contextmanager
def moves_noted(late: Callable[[int], float] = lambda n: 0.0) -> Iterator[list[tuple[timedelta, timedelta | None]]]:
    """Note each bucket move a request makes (``ledger.move_on``): its pad and how far past its
    start's state it left the buckets; the n-th move's answer comes back ``late(n)`` s late."""
    noted: list[tuple[timedelta, timedelta | None]] = []
    real_move = ledger.move_on

    def move(moved, start, deadline, pad, using=None):
        by = real_move(moved, start, deadline, pad, using=using)
        noted.append((pad, by))
        time.sleep(late(len(noted)))
        return by

    with mock.patch.object(ledger, "move_on", move):
        yield noted


@pytest.mark.parametrize("method", ["db_clock", "marked_clock"])
def test_a_held_request_goes_out_no_sooner_than_its_bucket_was_charged_for(method):
    """Held before the handler (a handler that marks no send), or where it marks its send."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send(method, {}, keys=["paced"])
    with moves_noted() as moves:
        assert run_all(claim_all(call.key_set).calls) == ["done"]
    sent = sent_after_judged(call)
    assert sent >= 80 * MS
    # Charged one interval, 200 ms lengthened by the guard (6 ms), from its send moment: the
    # clock it was judged on plus the hold (or the bucket's state, if later). Not from its
    # recorded start plus the hold: the start's record comes a little after it was judged, and
    # charging from there cost a smooth rate that much of every interval.
    judged = datetime.fromisoformat(call.result["judged"])
    charged = bucket_state("paced") - max(tat, judged + 80 * MS)
    if charged != 206 * MS:
        # Sent later than its moment allows (a loaded machine): the bucket moved on by that
        # lateness and the pad before the request went (``arrivals.release``: MOVE_PAD, or for a
        # move made again as long as the move before took too), never by more (the handler
        # reads its clock after the move).
        assert sent - 80 * MS > SEND_SLACK
        assert 206 * MS < charged <= 206 * MS + (sent - 80 * MS) + max((pad for pad, _ in moves), default=arrivals.MOVE_PAD)
    assert call.started_at >= judged


def test_a_full_bucket_is_not_held_its_guard_takes_the_delay():
    """At low load (the bucket full) the guard with the whole delay admits the call at once: it
    is not held, and costs no latency."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 150 * MS)
    call = CallQueue.objects.send("db_clock", {}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert sent_after_judged(call) < 150 * MS
    # Charged at the start: one interval lengthened by the whole guard, 20 ms + 150 ms measured.
    assert bucket_state("paced") - call.started_at == 200 * MS + 170 * MS


def test_a_key_with_a_window_is_not_held_its_guard_takes_the_delay():
    edit.set_policy("mixed", 5, timedelta(seconds=1), burst=1)
    edit.set_policy("mixed", 1000, timedelta(hours=1))
    measured("mixed", 80 * MS)
    call = CallQueue.objects.send("db_clock", {}, keys=["mixed"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    # Charged at the start, one interval lengthened by the whole guard: 20 ms + 80 ms measured.
    assert bucket_state("mixed") - call.started_at == 200 * MS + 100 * MS


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


# A key whose workers measured a delay (held, its bucket charged 200 ms and its guard of 6 ms),
# and one nothing was measured for yet (its first calls, a new process's first start and
# connection: not held, charged 200 ms and the configured guard of 20 ms, its request settled as
# it goes out all the same).
HOLDS = [(80 * MS, 206 * MS), (timedelta(0), 220 * MS)]


@pytest.mark.parametrize(("hold", "charged"), HOLDS)
def test_a_late_held_request_moves_its_bucket_on_by_its_lateness_before_it_goes(hold, charged):
    """Held 80 ms (or nothing measured: not held), a handler that works 150 ms before it sends:
    its request reaches its moment 70-odd ms (150) late. No later start was charged on its bucket,
    so the bucket moves on by the lateness (and MOVE_PAD) before the request goes out."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    if hold:
        measured("paced", hold)
    tat = owing("paced")
    call = CallQueue.objects.send("marked_clock", {"work": 0.15}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    judged = datetime.fromisoformat(call.result["judged"])
    sent = datetime.fromisoformat(call.result["at"])
    moment = max(tat, judged + hold)
    moved = bucket_state("paced") - (moment + charged)
    # At least its lateness past what its moment allowed (the slack), the pad on top; the handler
    # reads its clock (``sent``) after the move's statement, up to a few ms later when loaded.
    assert moved >= sent - moment - SEND_SLACK - 10 * MS
    assert moved >= arrivals.MOVE_PAD and sent - judged >= 150 * MS
    assert list(Attempt.objects.values_list("outcome", flat=True)) == ["done"]


@pytest.mark.parametrize(("hold", "charged"), HOLDS)
def test_a_late_held_request_after_a_later_start_is_not_sent_and_waits_again(hold, charged):
    """A smooth 20 per second, held 80 ms (or nothing measured yet: not held). The first call's
    handler works 150 ms before it sends; meanwhile the second call starts, charged on the bucket
    as the first left it. The first request may then not go out (it would arrive too close to the
    second's): it is not sent, and the call waits again, its attempt refunded. (Not held, before
    anything was measured, it went out, and moved the bucket only after its answer.)"""
    edit.set_policy("paced", 20, timedelta(seconds=1), burst=1)
    if hold:
        measured("paced", hold)
        owing("paced")  # else not held: a full bucket is not (a key not held starts at once)
    first = CallQueue.objects.send("marked_clock", {"work": 0.15}, keys=["paced"])
    second = CallQueue.objects.send("marked_clock", {}, keys=["paced"])
    claimed = claim_all(first.key_set).calls
    assert [c.id for c in claimed][:1] == [first.id]
    outcomes: dict[int, str] = {}

    def run(call_id: int, dispatch_no: int) -> None:
        try:
            outcomes[call_id] = execute(call_id, dispatch_no)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(c.id, c.dispatch_no)) for c in claimed[:1]]
    threads[0].start()
    time.sleep(0.03)  # the first has started and is at work
    more = claimed[1:] or claim_all(first.key_set).calls
    for _ in range(10):  # the second's slot is due well before the first's handler sends
        if more:
            break
        time.sleep(0.01)
        more = claim_all(first.key_set).calls
    threads.append(threading.Thread(target=run, args=(second.id, more[0].dispatch_no)))
    threads[1].start()
    for thread in threads:
        thread.join(10)
    assert outcomes[first.id] == "missed"
    if outcomes[second.id] != "done":
        # Its own start's durable commit stalled on a loaded disk (CI once: 500 ms, the first's
        # miss committed in the same flush): a request past GUARD_MAX after its start may not go
        # either, and waits again, as any that late. Never because of the first.
        (late,) = Attempt.objects.filter(call=second)
        assert (outcomes[second.id], late.outcome) == ("missed", Attempt.Outcome.MISSED)
        assert "ms after its start" in late.error, late.error
    first.refresh_from_db()
    assert (first.status, first.attempts, first.deferrals) == ("pending", 0, 1)
    assert first.result is None  # its handler never got past the send
    (attempt,) = Attempt.objects.filter(call=first)
    assert attempt.outcome == Attempt.Outcome.MISSED and "after a later start" in attempt.error


@pytest.mark.postgres  # SQLite's write lock keeps a move out of a start's transaction
def test_a_start_written_after_a_move_carries_it_and_holds_its_request_that_much_longer():
    """A late request moves the bucket on between a start's judgement and its write: the start
    writes the move on top of its charge and its request is held that much longer."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send("db_clock", {}, keys=["paced"])
    (claimed,) = claim_all(call.key_set).calls
    mark = start_module._mark_running

    def mark_after_a_move(*args, **kwargs):
        # Another worker's late request, on a connection of its own, while this start holds the
        # key's lock: the move takes the bucket's row alone.
        def move() -> None:
            try:
                start = KeyBucket.objects.get(key="paced").start
                by = ledger.move_on({"paced": [(timedelta(seconds=1), to_us(tat))]}, start, db_now() - 40 * MS, timedelta(0))
                assert by is not None and by >= 40 * MS
            finally:
                connections.close_all()

        mover = threading.Thread(target=move)
        mover.start()
        mover.join(10)
        return mark(*args, **kwargs)

    with mock.patch.object(start_module, "_mark_running", mark_after_a_move):
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    moved = from_us(KeyBucket.objects.get(key="paced").tat_us) - (max(tat, datetime.fromisoformat(sent_clock(call)["judged"]) + 80 * MS) + 206 * MS)
    assert moved >= 40 * MS
    # Held the move longer: sent no sooner than its moment and the move.
    assert sent_after_judged(call) >= 80 * MS + moved


def sent_clock(call: CallQueue) -> dict[str, str]:
    call.refresh_from_db()
    return call.result


def test_what_a_held_call_keeps_the_delay_before_its_hold_and_other_keys_the_delay_after_it():
    """A call of a held key (80 ms) and a key with a window: the held key keeps the delay before
    the hold, the other key the delay after it."""
    span = timedelta(seconds=1)
    with arrivals.reading_clock():
        pass
    clock_read, _ = arrivals.begin()
    noted = arrivals.Noted({"k": span, "w": span}, {}, T0, {}, {}, {"k": 80 * MS})
    assert arrivals.to_write(clock_read, noted, arrivals.Sent(85 * MS, 30 * MS)) == {30 * MS: {"k": span}, 85 * MS: {"w": span}}


def test_a_held_send_marked_later_than_its_release_allowed_moves_its_buckets_after_it():
    """A handler held when it is invoked that marks its send 40 ms later: the lateness after its
    release is known only then, and its buckets move on by it (``overdue``)."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send("late_send", {"delay": 0.04}, keys=["paced"])
    (claimed,) = claim_all(call.key_set).calls
    assert execute(claimed.id, claimed.dispatch_no) == "done"
    call.refresh_from_db()
    # Charged from its moment (80 ms after the start's clock, a few ms before the recorded start:
    # 14 ms once on a loaded CI machine), then moved on by the 40-odd ms the handler took beyond
    # the slack. Not moved, it would stand at most 206 ms past that moment.
    assert bucket_state("paced") - max(tat, call.started_at + 80 * MS) >= 206 * MS + 40 * MS - SEND_SLACK - 25 * MS


# --- what an answer says, and the process's reading of the database clock -------------------------


def run_http(url: str, key: str) -> CallQueue:
    """Send an http call of the key, claim it once its turn is near (bounded) and run it."""
    call = CallQueue.objects.send("http", {"method": "GET", "url": url}, keys=[key])
    for _ in range(40):
        claimed = claim_all(call.key_set).calls
        if claimed:
            break
        time.sleep(0.05)
    (one,) = claimed
    assert execute(one.id, one.dispatch_no) == "done"
    call.refresh_from_db()
    return call


def test_an_answer_later_than_the_keys_round_trips_moves_its_bucket_on(fake_api):
    """The API may stamp a request late (an nginx whose process was busy): its answer then comes
    late too. A held request whose answer takes longer than the key's least recent round trip,
    by more than its guard lets it arrive late, moves its bucket on by the difference (while no
    later start was charged on it); an answer on time moves nothing."""
    edit.set_policy("answers", 5, timedelta(seconds=1), burst=1)
    measured("answers", 20 * MS)
    owing("answers")
    for _ in range(4):  # the key's round trips, answered at once (the first opens the connection)
        run_http(f"{fake_api.url}/ok", "answers")
    before = bucket_state("answers")
    call = run_http(f"{fake_api.url}/ok", "answers")
    # Answered on time: charged one interval (206 ms) from its moment, and no more than a loaded
    # machine's spread of round trips beyond its guard (a CI run saw 0.2 ms more). On a loaded
    # machine this answer itself may come later than the least before it (a CI run: 14 ms more);
    # the bucket then moves on by that much, and no more.
    *earlier, took = arrivals._round_trips["answers"]
    late = timedelta(seconds=max(0.0, took - min(earlier)))
    assert bucket_state("answers") - max(before, call.started_at) <= 206 * MS + 10 * MS + late
    before = bucket_state("answers")
    judged_moment = max(before, db_now())
    run_http(f"{fake_api.url}/slow?delay=0.05", "answers")
    # Its answer came ~50 ms later than the others': the API may have seen it that late, of
    # which the guard (6 ms) covers some; the bucket moved on by the rest and a millisecond.
    moved = bucket_state("answers") - max(before, judged_moment) - 206 * MS
    assert moved >= 50 * MS - 6 * MS - 10 * MS


def test_a_late_request_whose_move_comes_back_late_moves_again_before_it_goes():
    """A move's own round trip can take longer than the pad it adds: the request then moves its
    buckets on again from the state the first move left, rather than not going at all."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send("marked_clock", {"work": 0.15}, keys=["paced"])
    (claimed,) = claim_all(call.key_set).calls
    # The first move's answer comes back 10 ms late: beyond its pad.
    with moves_noted(lambda n: 0.01 if n == 1 else 0.0) as noted:
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    moves = [by for _, by in noted]
    assert len(moves) == 2 and all(by is not None for by in moves)
    call.refresh_from_db()
    judged = datetime.fromisoformat(call.result["judged"])
    # The second move took the bucket further than the first, as far as the request was late
    # then: at least its lateness past its moment.
    total = bucket_state("paced") - (max(tat, judged + 80 * MS) + 206 * MS)
    assert total == moves[1] > moves[0]
    assert total >= datetime.fromisoformat(call.result["at"]) - max(tat, judged + 80 * MS) - SEND_SLACK


def test_a_request_whose_every_move_comes_back_later_than_its_pad_still_goes():
    """Every move's answer comes back 10 ms late, five times its 2 ms pad (a loaded machine's, or
    SQLite's, write): the second move is padded by as long as the first took, and the request
    goes (with every move padded by 2 ms alone it moved three times and was not sent)."""
    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    owing("paced")
    call = CallQueue.objects.send("marked_clock", {"work": 0.15}, keys=["paced"])
    (claimed,) = claim_all(call.key_set).calls
    with moves_noted(lambda n: 0.01) as noted:
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    pads = [pad for pad, _ in noted]
    assert len(pads) == 2 and pads[0] == arrivals.MOVE_PAD and pads[1] >= 10 * MS + arrivals.MOVE_PAD


def test_a_process_reads_the_database_clock_from_its_best_recent_start():
    """Each start bounds where the database's clock stands on the process's own clock: between
    just before and just after its query. A thread that runs again late after its query (a late
    upper bound) is held on the best bound of the recent starts, not on its own."""
    offsets = Offsets()
    base = time.monotonic()
    clock = datetime(2026, 1, 1, 12, 0).astimezone()
    # The database's clock read at `clock`, the process's at base (+ its offset, 0 here).
    epoch = clock.timestamp() - base
    offsets.note(base - 0.0005, base + 0.0004, clock)
    # One reading: at the latest 0.4 ms after, and as much as its whole round trip (0.9 ms) earlier.
    at, spread = offsets.at(clock, fallback=0.0)
    assert abs(at - (base + 0.0004)) < 1e-6 and abs(spread - 0.0009) < 1e-6
    late = clock + timedelta(seconds=1)
    offsets.note(base + 1 - 0.0002, base + 1 + 0.006, late)  # back 6 ms late
    at, spread = offsets.at(late, fallback=0.0)
    assert abs(at - (base + 1 + 0.0004)) < 1e-6
    assert at - epoch - late.timestamp() < 0.001
    # The best bounds of both readings: 0.2 ms before to 0.4 ms after.
    assert abs(spread - 0.0006) < 1e-6
    # A clock that stepped (here the database's, 300 ms on): the new reading contradicts those
    # kept, which are dropped, and it stands alone.
    stepped = late + timedelta(milliseconds=500)
    offsets.note(base + 1.2, base + 1.2005, stepped)
    at, spread = offsets.at(stepped, fallback=0.0)
    assert abs(at - (base + 1.2005)) < 1e-6 and abs(spread - 0.0005) < 1e-6
    assert offsets.at(stepped, fallback=7.0) != (7.0, 0.0)
    assert Offsets().at(stepped, fallback=7.0) == (7.0, 0.0)


def test_the_requests_of_one_start_each_move_its_buckets_as_far_as_they_need_and_no_later_start_is_overtaken():
    """A burst's requests share their start: each late one moves the buckets as far as it is late
    (the latest wins, none moves them back), until a later start charges them."""
    second = timedelta(seconds=1)
    KeyBucket.objects.create(key="burst", period=second, tat_us=1_000_000, since=T0.astimezone(), start=7)
    KeyBucket.objects.create(key="other", period=second, tat_us=5_000_000, since=T0.astimezone(), start=7)
    state = {"burst": [(second, 1_000_000)]}
    # By the pad alone (no deadline): 3 ms, then 2 ms (no further), then 5 ms.
    assert ledger.move_on(state, 7, None, 3 * MS) == 3 * MS
    assert ledger.move_on(state, 7, None, 2 * MS) == 3 * MS
    assert ledger.move_on(state, 7, None, 5 * MS) == 5 * MS
    assert KeyBucket.objects.get(key="burst").tat_us == 1_005_000
    # Several keys: all or none.
    both = {**state, "other": [(second, 5_000_000)]}
    assert ledger.move_on(both, 7, None, 6 * MS) is not None
    assert dict(KeyBucket.objects.values_list("key", "tat_us")) == {"burst": 1_006_000, "other": 5_006_000}
    # A later start charged "other": neither moves any more.
    KeyBucket.objects.filter(key="other").update(start=8)
    assert ledger.move_on(both, 7, None, 9 * MS) is None
    assert dict(KeyBucket.objects.values_list("key", "tat_us")) == {"burst": 1_006_000, "other": 5_006_000}
    assert ledger.move_on(state, 8, None, 9 * MS) is None
