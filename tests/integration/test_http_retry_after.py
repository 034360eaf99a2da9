"""An API that says nothing but Retry-After on its 429s: the limit is inferred from what it admitted.

Calls run one by one in this process (``worker.execute``) against a fake API on 127.0.0.1; the
multi-process version with a policy 100x too loose is in test_http_learnt_limits.py.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher.limits import edit
from dispatcher.models import CallQueue, KeyState, LearntLimit, RateLimit
from dispatcher.worker import execute
from support.fakeapi import FakeAPI
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)


def run_next(n: int = 1) -> list[str]:
    """Claim up to ``n`` due calls of the key set and run them here, in order."""
    key_set = CallQueue.objects.filter(status="pending").values_list("key_set", flat=True).first()
    claimed = claim(key_set, n).calls if key_set else []
    return [execute(c.id, c.dispatch_no) for c in claimed]


@pytest.fixture
def api():
    api = FakeAPI(enforce=(3, 60.0), announce="retry-after").start()
    yield api
    api.stop()


def send(api: FakeAPI, n: int, key: str = "partner") -> None:
    for i in range(n):
        CallQueue.objects.send("http", {"method": "GET", "url": f"{api.url}/ok", "headers": {"x-call": str(i)}}, keys=[key])


def test_the_calls_admitted_before_the_429_and_the_reset_become_a_learnt_window(api):
    edit.set_policy("partner", 300, timedelta(seconds=60))  # 100x too loose
    send(api, 5)
    assert run_next(5) == ["done", "done", "done", "rate_limited", "deferred"]  # the 5th waits behind the pause
    (learnt,) = LearntLimit.objects.filter(key="partner")
    assert learnt.source == "retry-after" and learnt.limit == 3
    # From the first admitted start to the reset (about 60 s), with the learnt margin.
    assert timedelta(seconds=59) <= learnt.period <= timedelta(seconds=60 * 1.05 + 0.05 + 5)
    assert "3 admitted" in learnt.signal
    assert KeyState.objects.get(key="partner").paused_until is not None
    # A learnt window is one more policy on the key: the configured one is untouched.
    assert RateLimit.objects.get(key="partner").limit == 300


def test_the_others_refused_in_the_same_window_teach_nothing_more(api):
    from dispatcher.clock import db_now
    from dispatcher.learning import infer_from_retry_after
    from dispatcher.models import Attempt
    from dispatcher.running import running

    send(api, 4)
    assert run_next(4) == ["done", "done", "done", "rate_limited"]
    (first,) = LearntLimit.objects.filter(key="partner").values_list("pk", "limit", "period", "observed_at")
    refused = Attempt.objects.get(outcome="rate_limited")
    assert first[3] == refused.started_at  # the start of the call whose refusal taught it
    # Another call refused in flight: it started after the teacher, before the lesson was drawn.
    with running(keys=["partner"], started_at=refused.started_at + timedelta(microseconds=1)):
        infer_from_retry_after(30.0)
    # And one that started later, with no call admitted since the lesson.
    with running(keys=["partner"], started_at=db_now()):
        infer_from_retry_after(30.0)
    assert list(LearntLimit.objects.filter(key="partner").values_list("pk", "limit", "period", "observed_at")) == [first]
    # One refused in flight that started before the teacher was counted as admitted: taken back.
    with running(keys=["partner"], started_at=refused.started_at - timedelta(milliseconds=1)):
        infer_from_retry_after(30.0)
    assert LearntLimit.objects.get(pk=first[0]).limit == first[1] - 1


def test_a_hostile_retry_after_learns_at_most_an_hour_window(settings):
    settings.DISPATCHER_MAX_PAUSE = "10d"
    api = FakeAPI(enforce=(1, 10**7), announce="retry-after").start()
    try:
        send(api, 2)
        assert run_next(2) == ["done", "rate_limited"]
    finally:
        api.stop()
    (learnt,) = LearntLimit.objects.filter(key="partner")
    assert learnt.limit == 1 and learnt.period <= timedelta(hours=1)


# --- "r remain": at most r, less the calls in flight, start before the reset ----------------------


def test_r_remaining_caps_the_starts_before_the_reset_at_r_less_the_calls_in_flight():
    """Others use the API's quota too (our log does not see them); two calls of ours are in flight
    (started, their requests not yet arrived) when a third is answered "3 remain"."""
    import httpx

    api = FakeAPI(enforce=(10, 60.0), announce="x-seconds").start()
    try:
        for _ in range(4):  # another client of the same account
            assert httpx.get(f"{api.url}/ok").status_code == 200
        edit.set_policy("partner", 1000, timedelta(seconds=60))  # far too loose
        send(api, 10)
        key_set = CallQueue.objects.first().key_set
        first, second, answered = claim(key_set, 3).calls
        for call in (first, second):  # in flight: started, not yet arrived
            assert CallQueue.objects.start(call.id, call.dispatch_no).state == "started"
        assert execute(answered.id, answered.dispatch_no) == "done"
        # The API counted 4 + 1 of 10 over the window: 5 remain; 2 of ours are still on their way.
        budget = LearntLimit.objects.get(key="partner", source="x-ratelimit:remaining")
        assert "5 remaining" in budget.signal and "3 may start before the reset" in budget.signal
        # Every window the limiter reads admits three more starts, then none before the reset.
        assert len(claim(key_set, 10).calls) == 3
        assert claim(key_set, 10).calls == []
    finally:
        api.stop()


def test_r_remaining_with_nothing_in_flight_caps_at_r():
    import httpx

    api = FakeAPI(enforce=(10, 60.0), announce="x-seconds").start()
    try:
        for _ in range(6):
            assert httpx.get(f"{api.url}/ok").status_code == 200
        edit.set_policy("partner", 1000, timedelta(seconds=60))
        send(api, 10)
        assert run_next(1) == ["done"]  # 3 remain
        key_set = CallQueue.objects.filter(status="pending").first().key_set
        assert len(claim(key_set, 10).calls) == 3
    finally:
        api.stop()
