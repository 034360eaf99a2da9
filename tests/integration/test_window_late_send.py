"""A sliding window counts each start with the guard its key's measured start-to-send delays call
for, so a delay measured on one request protects the starts after it. A request that goes out
later than its key remembers is remembered before it goes: a start judged after it then counts
it, even while its answer is still on its way (a slow API), where the delay was kept only once
the answer came back before."""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from unittest import mock

import pytest
from django.db import connections
from django.db.backends.signals import connection_created

from dispatcher.clock import db_now
from dispatcher.limits import edit, ledger
from dispatcher.models import Attempt, CallQueue, KeyState
from dispatcher.worker import execute, execute_many
from support.processes import wait_until
from support.windows import max_in_window
from tests.integration.test_shapes import claim_all, run_all

MS = timedelta(milliseconds=1)
SECOND = timedelta(seconds=1)
pytestmark = pytest.mark.django_db(transaction=True)


def in_thread(call_id: int, dispatch_no: int, outcomes: dict[int, str]) -> threading.Thread:
    """Run one delivery on a thread of its own (a worker's other slot); return the thread."""
    def run() -> None:
        try:
            outcomes[call_id] = execute(call_id, dispatch_no)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def sent_at(calls: list[CallQueue]) -> list[datetime]:
    """When each call's handler sent its request, on the database clock."""
    moments = []
    for call in calls:
        call.refresh_from_db()
        moments.append(datetime.fromisoformat(call.result["at"]))
    return moments


def run_as_they_fit(calls: list[CallQueue], deadline: float) -> None:
    """Claim and start the calls as soon as their window lets them (a dispenser and a worker that
    are never late), until all ran or ``deadline`` (monotonic) passes."""
    waiting = {call.id for call in calls}
    while waiting and time.monotonic() < deadline:
        for claimed in claim_all(calls[0].key_set).calls:
            if execute(claimed.id, claimed.dispatch_no) == "done":
                waiting.discard(claimed.id)
        time.sleep(0.005)
    assert not waiting, "calls the window should have let through in time"


@pytest.mark.parametrize("work", [0.15, 0.4], ids=["within-the-cap", "past-the-cap"])
def test_a_late_request_behind_a_slow_api_is_counted_by_the_starts_a_period_later(work):
    """A window of 5 per second. The first call's handler works 150 ms before it sends and its
    answer takes 2 s; four more go at once. The window frees a second after those starts: the
    five calls then admitted must leave the late request's second alone. Before, its delay was
    kept only with its answer, 2 s later: the next five started 1.02 s after it and went out
    within a second of its request, six in one second at the API.

    Working 400 ms, its delay is more than any guard a window counts under (``GUARD_MAX``, 250
    ms, less the configured 20 ms): kept, it let the next starts wait 250 ms more, not enough,
    and six went out within one second of it. Its start is now logged again as it goes out."""
    moments = late_then_five_more({"work": work, "answer": 2.0})
    # What a sliding window at the API counts: the most in any closed interval of a second.
    assert max_in_window([m.timestamp() for m in moments], 1.0) <= 5, sorted(moments)


def late_then_five_more(late_params: dict) -> list[datetime]:
    """Under a window of 5 per second, start a call of ``late_params`` and four quick ones at
    once, the late one on a thread of its own; then five more as soon as the window lets them.
    Return when each of the ten sent its request, on the database clock."""
    edit.set_policy("win", 5, SECOND)
    late = CallQueue.objects.send("marked_clock", late_params, keys=["win"])
    quick = [CallQueue.objects.send("marked_clock", {}, keys=["win"]) for _ in range(4)]
    claimed = {c.id: c for c in claim_all(late.key_set).calls}
    assert set(claimed) == {late.id, *(c.id for c in quick)}
    outcomes: dict[int, str] = {}
    thread = in_thread(late.id, claimed[late.id].dispatch_no, outcomes)
    assert run_all([claimed[c.id] for c in quick]) == ["done"] * 4
    after = [CallQueue.objects.send("marked_clock", {}, keys=["win"]) for _ in range(5)]
    run_as_they_fit(after, time.monotonic() + 6)
    thread.join(10)
    assert outcomes == {late.id: "done"}
    return sent_at([late, *quick, *after])


def test_a_window_key_remembers_a_late_requests_delay_before_its_answer_comes():
    edit.set_policy("win", 5, SECOND)
    call = CallQueue.objects.send("marked_clock", {"work": 0.1, "answer": 0.6}, keys=["win"])
    (claimed,) = claim_all(call.key_set).calls
    outcomes: dict[int, str] = {}
    thread = in_thread(call.id, claimed.dispatch_no, outcomes)
    time.sleep(0.35)  # its request went out, its answer has not come
    remembered = KeyState.objects.get(key="win").send_delay_us
    thread.join(10)
    assert outcomes == {call.id: "done"}
    assert remembered >= 100_000


def test_a_delay_the_key_already_remembers_is_not_written_before_the_send():
    """The steady state: what the start read covers the delay, so nothing is written as the
    request goes out (nor after its answer)."""
    edit.set_policy("win", 5, SECOND)
    KeyState.objects.update_or_create(key="win", defaults={"send_delay_us": 200_000, "send_delay_since": db_now()})
    call = CallQueue.objects.send("marked_clock", {"work": 0.05}, keys=["win"])
    with (
        mock.patch.object(ledger, "remember_send_delay", wraps=ledger.remember_send_delay) as after,
        mock.patch.object(ledger, "remember_send_delay_kept", wraps=ledger.remember_send_delay_kept) as ahead,
    ):
        assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert (ahead.call_count, after.call_count) == (0, 0)
    assert KeyState.objects.get(key="win").send_delay_us == 200_000


def test_a_request_sent_inside_the_handlers_own_transaction_still_goes_and_its_delay_is_kept_after():
    """Inside the handler's transaction its own connection's write would be seen only once the
    handler commits: the process's delay writer keeps it on a connection of its own."""
    edit.set_policy("win", 5, SECOND)
    call = CallQueue.objects.send("marked_clock", {"work": 0.1, "atomic": True}, keys=["win"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert KeyState.objects.get(key="win").send_delay_us >= 100_000
    assert list(Attempt.objects.values_list("outcome", flat=True)) == ["done"]


def test_a_messages_handler_threads_hand_their_delays_to_one_writer_and_open_no_session():
    """A message's calls run on the process's handler threads, which close their connections
    after each handler. Their late requests' delays are kept as they go out all the same, by the
    process's delay writer, on one connection it keeps for the next ones. (The handler marks its
    send after it was invoked, where it was held: its send's delay counts.)"""
    edit.set_policy("win:*", 5, SECOND)
    calls = [CallQueue.objects.send("late_send", {"delay": 0.1, "answer": 0.6}, keys=[f"win:{i}"]) for i in range(3)]
    claimed = [c for call in calls for c in claim_all(call.key_set, 1).calls]
    opened: list[str] = []

    def count(sender, connection, **kwargs):
        opened.append(threading.current_thread().name)

    outcomes: dict[str, int] = {}

    def run() -> None:
        try:
            outcomes.update(execute_many([(c.id, c.dispatch_no) for c in claimed]))
        finally:
            connections.close_all()

    connection_created.connect(count)
    try:
        thread = threading.Thread(target=run, name="slot")
        thread.start()
        time.sleep(0.4)  # the requests went out, their answers have not come
        remembered = dict(KeyState.objects.filter(key__startswith="win:").values_list("key", "send_delay_us"))
        thread.join(10)
    finally:
        connection_created.disconnect(count)
    assert outcomes == {"done": 3}
    assert all(state.send_delay_us >= 100_000 for state in KeyState.objects.filter(key__startswith="win:"))
    assert sorted(remembered) == ["win:0", "win:1", "win:2"]
    assert min(remembered.values()) >= 100_000
    # The slot's own and the writer's (the three writes share it); no handler thread's.
    assert sorted(opened) == ["dispatcher-delays_0", "slot"], opened


def test_the_late_calls_of_one_start_write_their_delay_once_not_each():
    """Six calls of one message on one window key, each sent 100 ms after the start: the writer
    keeps the first one's delay (with headroom) and judges the others again when their turn
    comes, finding it kept, rather than writing it each."""
    edit.set_policy("win", 50, SECOND)
    calls = [CallQueue.objects.send("late_send", {"delay": 0.1}, keys=["win"]) for _ in range(6)]
    claimed = claim_all(calls[0].key_set).calls
    assert len(claimed) == 6
    with mock.patch.object(ledger, "remember_send_delay_kept", wraps=ledger.remember_send_delay_kept) as writes:
        assert execute_many([(c.id, c.dispatch_no) for c in claimed]) == {"done": 6}
    # (The handler is held, and measured, when invoked too: the first invocations' few ms may write.)
    late = [c for c in writes.call_args_list if c.args[1] >= timedelta(milliseconds=100)]
    # Once, or twice where a loaded machine spread the six sends by more than the headroom (it
    # did one run in a few beside other tests); not six.
    assert len(late) <= 2, writes.call_args_list
    assert KeyState.objects.get(key="win").send_delay_us >= 100_000


def test_a_start_logged_again_counts_its_units_from_now_and_keeps_the_logs_totals_in_order():
    """``ledger.count_again``: the call's start once more in its window's log, with the units its
    start logged, at the database clock, after every start logged, its running total the key's
    next; a window counting now counts both. No call of its own: a cost correction finds the
    call's own start."""
    from dispatcher.models import StartLog

    edit.set_policy("win", 20, SECOND)
    late = CallQueue.objects.send("marked_clock", {}, keys=["win"], cost=3)
    other = CallQueue.objects.send("marked_clock", {}, keys=["win"])
    assert run_all(claim_all(late.key_set).calls) == ["done", "done"]
    assert ledger.count_again(["win"], late.id) == {"win": 3}
    rows = list(StartLog.objects.filter(key="win").order_by("cum").values_list("started_at", "units", "cum", "call_id"))
    assert [(units, cum, call) for _, units, cum, call in rows] == [(3, 3, late.id), (1, 4, other.id), (3, 7, None)]
    assert [at for at, *_ in rows] == sorted(at for at, *_ in rows)
    assert KeyState.objects.get(key="win").total == 7
    # The window counts 7 of its 20 now: 13 more fit, not 14.
    more = [CallQueue.objects.send("marked_clock", {}, keys=["win"]) for _ in range(14)]
    assert len(claim_all(more[0].key_set).calls) == 13


@pytest.mark.parametrize("alone", [True, False], ids=["one-per-message", "in-a-message-of-several"])
def test_a_late_request_that_cost_more_than_declared_is_counted_from_its_send_at_its_real_cost(alone):
    """A window of 5 units per 2 s. A call declared at 1 unit works 1.5 s before its request goes
    out (past any guard: its start is logged again as it goes out, with the 1 unit known then)
    and its answer says it cost 3. Once its start's own 2 s have passed, the API still counts its
    3 units (they arrived 1.5 s after the start): 2 more fit, not 4. Before, the correction
    reached the start's own row alone, gone by then, and the row logged again kept 1 unit."""
    from dispatcher.models import StartLog

    edit.set_policy("win", 5, 2 * SECOND)
    late = CallQueue.objects.send("marked_clock", {"work": 1.5, "answer": 0.2, "reports": 3}, keys=["win"])
    claimed = claim_all(late.key_set).calls
    if alone:
        assert run_all(claimed) == ["done"]
    else:
        assert execute_many([(c.id, c.dispatch_no) for c in claimed]) == {"done": 1}
    late.refresh_from_db()
    sent = sent_at([late])[0]
    assert sent - late.started_at >= 1500 * MS
    # The start's own row has left the window (under any guard, 250 ms at most); the send's
    # 2 s are still on at the API.
    while db_now() < late.started_at + 2 * SECOND + 600 * MS:
        time.sleep(0.01)
    more = [CallQueue.objects.send("marked_clock", {}, keys=["win"]) for _ in range(5)]
    fitted = claim_all(more[0].key_set).calls
    assert db_now() < sent + 2 * SECOND, "judged after the send's window ended: too late to tell"
    assert len(fitted) == 2, StartLog.objects.filter(key="win").values_list("started_at", "units", "call_id")


def test_a_late_start_kept_for_its_opening_counts_a_higher_cost_from_the_correction():
    """A request late for opening its connection is kept as a late start with the units known
    then (1); its answer says it cost 3. The 2 more are logged from the correction, after its
    arrival: a window judged until a period after its arrival counts all 3 (the kept late start
    and the 2), as the API does."""
    from dispatcher.limits.guard import late_starts
    from dispatcher.models import StartLog

    edit.set_policy("win", 5, SECOND)
    late = CallQueue.objects.send("marked_clock", {"work": 0.15, "opens": True, "answer": 0.3, "reports": 3}, keys=["win"])
    assert run_all(claim_all(late.key_set).calls) == ["done"]
    late.refresh_from_db()
    sent = sent_at([late])[0]
    (kept,) = late_starts(KeyState.objects.get(key="win"))
    assert kept.at == late.started_at
    again = list(StartLog.objects.filter(key="win", call_id=None).values_list("started_at", "units"))
    assert again and all(at > sent for at, _ in again)
    # From its send on, its windows count the late start kept (1 unit, the cost known as it went
    # out; 3 had the writer kept it only after the correction) and the units logged again: all 3.
    assert kept.units + sum(units for _, units in again) >= 3
    assert StartLog.objects.get(key="win", call_id=late.id).units == 3


def test_a_quick_call_that_cost_more_is_corrected_in_its_own_start_alone():
    """On time, the correction moves the start's own row; nothing is logged again."""
    from dispatcher.models import StartLog

    edit.set_policy("win", 5, SECOND)
    call = CallQueue.objects.send("marked_clock", {"reports": 3}, keys=["win"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert list(StartLog.objects.filter(key="win").values_list("units", "call_id")) == [(3, call.id)]
    assert KeyState.objects.get(key="win").total == 3


def test_a_request_late_for_opening_its_connection_is_kept_as_a_late_start_not_remembered():
    """A window of 5 per second. The first call's request opens its process's first connection
    to the API, which takes 150 ms (a TLS handshake, a new process's first request): a delay the
    key's next requests, on that connection, do not pay. It is not remembered, so the starts of
    the next span or two are not counted under a guard 150 ms larger; its start is kept as a late
    start instead, counted until a period after its arrival, and the starts a period later leave
    its second alone all the same. Before, the key kept 150 ms for a span or two (the shaped
    benchmark's window: 96% of its allowance used); logged again instead, it took a second slot
    for a period wherever its window was not full."""
    from dispatcher.limits.guard import late_starts
    from dispatcher.models import StartLog

    moments = late_then_five_more({"work": 0.15, "opens": True, "answer": 0.5})
    # The quick calls' few ms are remembered, the opening's 150 ms not.
    state = KeyState.objects.get(key="win")
    assert state.send_delay_us < 100_000
    (late,) = late_starts(state)
    assert late.reach >= timedelta(milliseconds=150) + 20 * MS
    assert late.at in set(StartLog.objects.filter(key="win").values_list("started_at", flat=True))
    assert not StartLog.objects.filter(key="win", call_id=None).exists()
    assert max_in_window([m.timestamp() for m in moments], 1.0) <= 5, sorted(moments)


def test_a_request_that_opened_its_connection_within_its_guard_is_neither_remembered_nor_kept_late():
    from dispatcher.models import StartLog

    edit.set_policy("win", 5, SECOND)
    KeyState.objects.update_or_create(key="win", defaults={"send_delay_us": 200_000, "send_delay_since": db_now()})
    call = CallQueue.objects.send("marked_clock", {"work": 0.05, "opens": True}, keys=["win"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    state = KeyState.objects.get(key="win")
    assert (state.send_delay_us, state.late_starts) == (200_000, "")
    assert StartLog.objects.filter(key="win").count() == 1


def test_a_late_start_that_cannot_be_kept_is_remembered_as_a_delay():
    """The late start's write fails (its database session lost, say): the key remembers the
    request's delay instead, as it would any other, so its windows still count it."""
    from django.db import DatabaseError

    edit.set_policy("win", 5, SECOND)
    call = CallQueue.objects.send("marked_clock", {"work": 0.15, "opens": True}, keys=["win"])
    with mock.patch("dispatcher.limits.ledger.keep_late", side_effect=DatabaseError("connection lost")):
        assert run_all(claim_all(call.key_set).calls) == ["done"]
        remembered = wait_until(
            lambda: KeyState.objects.get(key="win").send_delay_us >= 150_000, timeout=5, interval=0.01
        )
    assert remembered, KeyState.objects.get(key="win").send_delay_us
    assert KeyState.objects.get(key="win").late_starts == ""


@pytest.mark.parametrize("close_connections", [False, True], ids=["kept-alive", "closed-after-each-answer"])
def test_only_the_processs_first_connection_to_an_api_is_a_delay_its_key_does_not_remember(close_connections):
    """The real client against a fake API on 127.0.0.1. Its first request opens the process's
    first connection to the API: not remembered, and, later than the nothing a new key
    remembers, kept as a late start. The second goes on that connection, kept alive, or, where
    the API closes every connection, opens another: a delay every request to that API pays,
    which its key must remember (kept late each, a busy window would keep a late start per call)."""
    from dispatcher.limits.guard import late_starts
    from dispatcher.models import StartLog
    from support.fakeapi import FakeAPI

    api = FakeAPI(close_connections=close_connections).start()
    try:
        edit.set_policy("win", 50, SECOND)
        calls = [CallQueue.objects.send("http", {"method": "GET", "url": f"{api.url}/ok"}, keys=["win"]) for _ in range(2)]
        first, second = ([c for c in claim_all(call.key_set, 1).calls] for call in calls)
        assert run_all(first) == ["done"]
        # A new key remembers no delay: the first request, later than none, is kept late (the
        # process's delay writer writes it; the request does not wait for it under a 1 s window).
        kept = wait_until(lambda: KeyState.objects.get(key="win").late_starts != "", timeout=5, interval=0.01)
        opened = KeyState.objects.get(key="win").send_delay_us
        assert run_all(second) == ["done"]
    finally:
        api.stop()
    assert api.connections == (2 if close_connections else 1)
    assert (opened, kept) == (0, True)
    state = KeyState.objects.get(key="win")
    assert state.send_delay_us > 0
    assert [late.units for late in late_starts(state)] == [1]
    assert not StartLog.objects.filter(key="win", call_id=None).exists()
