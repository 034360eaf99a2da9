"""A token bucket that holds no request back (a burst, or a window beside it) charges each start
under the guard its key's measured delays call for. A request that goes out later than that moves
the bucket on by its lateness as it goes out, so that a start judged after it leaves the API's
bucket the token the late request takes there, even while its answer is still on its way (a slow
API). Before, the bucket moved on only once the answer came back."""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from unittest import mock

import pytest

from dispatcher.clock import db_now
from dispatcher.limits import edit, ledger
from dispatcher.limits.guard import SEND_SLACK
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState
from dispatcher.worker import execute_many
from support.fakeapi import Bucket
from tests.integration.test_shapes import claim_all, run_all
from tests.integration.test_window_late_send import in_thread, run_as_they_fit, sent_at

MS = timedelta(milliseconds=1)
pytestmark = pytest.mark.django_db(transaction=True)


def refused_by(bucket: Bucket, moments: list[float]) -> list[float]:
    """The arrivals an API's token bucket refuses, in the order they arrive."""
    return [at for at in sorted(moments) if bucket.admit(at, 1) is not None]


def late_on_a_thread(work: float, answer: float) -> tuple[CallQueue, threading.Thread, dict[int, str]]:
    """A bucket of 5 per 2 s with a burst of 3, and a call on it whose handler works ``work``
    seconds before it sends and whose answer comes ``answer`` seconds later, claimed and run on a
    thread of its own; return the call, the thread and where it puts the outcome."""
    edit.set_policy("bkt", 5, timedelta(seconds=2), burst=3)
    call = CallQueue.objects.send("marked_clock", {"work": work, "answer": answer}, keys=["bkt"])
    (claimed,) = claim_all(call.key_set).calls
    outcomes: dict[int, str] = {}
    return call, in_thread(call.id, claimed.dispatch_no, outcomes), outcomes


def test_a_late_request_behind_a_slow_api_leaves_the_token_it_takes_at_the_api():
    """A bucket of 5 per 2 s with a burst of 3 (one token per 400 ms; the default guard costs it
    20 ms of each interval, no token). The first call's handler works 500 ms before it sends and
    its answer takes 2 s; the bucket is full again 420 ms after its start. A burst started 600 ms
    after it must leave at the API the token the late request took there at 500 ms. Before, the
    bucket moved on only with the answer, 2.5 s later: the burst of three found it full and the
    API's third refusal came 100 ms after the late request."""
    late, thread, outcomes = late_on_a_thread(work=0.5, answer=2.0)
    time.sleep(0.6)  # its request went out, its answer has not come
    after = [CallQueue.objects.send("marked_clock", {}, keys=["bkt"]) for _ in range(3)]
    run_as_they_fit(after, time.monotonic() + 6)
    thread.join(10)
    assert outcomes == {late.id: "done"}
    moments = [m.timestamp() for m in sent_at([late, *after])]
    assert refused_by(Bucket(rate=5 / 2, burst=3), moments) == [], sorted(moments)


@pytest.mark.postgres  # a message's calls start together on PostgreSQL
def test_the_late_calls_of_one_start_move_its_bucket_on_by_the_latest_not_by_each():
    """Three calls of one message on one bucket, started together and each sent 300 ms after
    their start: their bucket moves on by about 300 ms (and a pad) in all, as they go out, and
    not again after their answers. Moved on for each call after its answer (before), it stood
    900 ms further on for a lateness of 300 ms: three tokens of its rate lost."""
    edit.set_policy("bkt", 10, timedelta(seconds=1), burst=5)
    calls = [CallQueue.objects.send("late_send", {"delay": 0.3}, keys=["bkt"]) for _ in range(3)]
    claimed = claim_all(calls[0].key_set).calls
    assert len(claimed) == 3
    with mock.patch.object(ledger, "push_buckets", wraps=ledger.push_buckets) as pushes:
        assert execute_many([(c.id, c.dispatch_no) for c in claimed]) == {"done": 3}
    moved = [by for call in pushes.call_args_list for _, by in call.args[0].values()]
    assert 300 * MS <= sum(moved, timedelta(0)) < 400 * MS, pushes.call_args_list
    assert KeyBucket.objects.get(key="bkt").tat_us - _charged_from(calls) < 400_000 + 4 * 100_000


def test_a_request_no_later_than_its_key_allows_moves_no_bucket():
    """The steady state: the key remembers a delay that covers the request's, nothing is written."""
    edit.set_policy("bkt", 10, timedelta(seconds=1), burst=5)
    KeyState.objects.update_or_create(key="bkt", defaults={"send_delay_us": 200_000, "send_delay_since": db_now()})
    call = CallQueue.objects.send("marked_clock", {}, keys=["bkt"])
    with mock.patch.object(ledger, "push_buckets", wraps=ledger.push_buckets) as pushes:
        assert run_all(claim_all(call.key_set).calls) == ["done"]
    assert pushes.call_count == 0


def test_a_late_request_moves_its_bucket_on_once_before_its_answer_comes():
    """One token per 420 ms as applied (400 ms and the guard's 20 ms): a request 300 ms late moves
    its bucket on by that and a pad as it goes out, and not again when its answer comes."""
    call, thread, outcomes = late_on_a_thread(work=0.3, answer=0.8)
    time.sleep(0.55)  # its request went out, its answer has not come
    moved = KeyBucket.objects.get(key="bkt").tat_us - _charged_from([call]) - 420_000
    thread.join(10)
    assert outcomes == {call.id: "done"}
    after = KeyBucket.objects.get(key="bkt").tat_us - _charged_from([call]) - 420_000
    assert moved >= 300_000, moved
    assert 300_000 <= after < 330_000, after


def _charged_from(calls: list[CallQueue]) -> int:
    """The earliest recorded start of these calls, in µs (the bucket is charged from it)."""
    from dispatcher.clock import to_us

    return min(to_us(CallQueue.objects.get(pk=c.pk).started_at) for c in calls)


@pytest.mark.parametrize("burst", [5, None], ids=["bucket", "window"])
def test_a_handler_run_outside_a_worker_after_a_late_call_moves_and_writes_nothing(burst):
    """A thread that ran a call keeps nothing of its send for the next handler it runs outside a
    worker's run (a plain Celery task calling a handler): before, that handler's send was judged
    against the last call's start, long past, and its window key kept the time since as a delay."""
    from dispatcher import delaywriter
    from tests.testapp.handlers import late_send

    edit.set_policy("bkt", 10, timedelta(seconds=1), burst=burst)
    call = CallQueue.objects.send("late_send", {"delay": 0.05}, keys=["bkt"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    time.sleep(0.1)
    with (
        mock.patch.object(ledger, "push_buckets") as pushes,
        mock.patch.object(ledger, "move_on") as moves,
        mock.patch.object(ledger, "remember_send_delay_kept") as kept,
    ):
        late_send(delay=0.01)
        delaywriter._executor().submit(lambda: None).result(5)  # what was handed over is done
    assert (pushes.call_count, moves.call_count, kept.call_count) == (0, 0, 0)


@pytest.mark.postgres  # SQLite's write lock, which the handler's transaction holds, keeps the move out
def test_a_held_request_late_inside_the_handlers_own_transaction_moves_its_bucket_on_and_goes():
    """A held key (its delay measured, its bucket owing), a handler that opens a transaction of
    its own and sends 150 ms after it is invoked: its request reaches its moment late. Its
    connection's move would be seen only once the handler commits, so the process's delay
    writer makes it on its own; the request then goes. Before, it was not sent and waited again."""
    from tests.integration.test_send_time_pacing import bucket_state, measured, owing

    edit.set_policy("paced", 5, timedelta(seconds=1), burst=1)
    measured("paced", 80 * MS)
    tat = owing("paced")
    call = CallQueue.objects.send("marked_clock", {"work": 0.15, "atomic": True}, keys=["paced"])
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    sent = datetime.fromisoformat(call.result["at"])
    # Charged 206 ms from its moment (the start plus its hold, or the bucket's state), moved on
    # by at least its lateness past that moment, less the slack its guard allows.
    judged = datetime.fromisoformat(call.result["judged"])
    moment = max(tat, judged + 80 * MS)
    assert bucket_state("paced") - (moment + 206 * MS) >= sent - moment - SEND_SLACK - 10 * MS
    assert list(Attempt.objects.values_list("outcome", flat=True)) == ["done"]
