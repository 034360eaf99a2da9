"""An API that says nothing but Retry-After on its 429s: the limit is inferred from what it admitted.

Calls run one by one in this process (``worker.execute``) against a fake API on 127.0.0.1; the
multi-process version with a policy 100x too loose is in test_http_learnt_limits.py.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher.limiter import Policies
from dispatcher.models import CallQueue, KeyState, LearntLimit, RateLimit
from dispatcher.worker import execute
from support.fakeapi import FakeAPI

pytestmark = pytest.mark.django_db(transaction=True)


def run_next(n: int = 1) -> list[str]:
    """Claim up to ``n`` due calls of the key set and run them here, in order."""
    key_set = CallQueue.objects.filter(status="pending").values_list("key_set", flat=True).first()
    claimed = CallQueue.objects.claim(key_set, n, Policies.load()).calls if key_set else []
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
    RateLimit.objects.set_policy("partner", 300, timedelta(seconds=60))  # 100x too loose
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
    from dispatcher.learning import infer_from_retry_after, running_call
    from dispatcher.models import Attempt

    send(api, 4)
    assert run_next(4) == ["done", "done", "done", "rate_limited"]
    (first,) = LearntLimit.objects.filter(key="partner").values_list("pk", "limit", "period", "observed_at")
    refused = Attempt.objects.get(outcome="rate_limited")
    # Another call refused in flight: it started with the refused one, before the lesson.
    with running_call(["partner"], refused.started_at):
        infer_from_retry_after(30.0)
    # And one that started later, with no call admitted since the lesson.
    with running_call(["partner"], db_now()):
        infer_from_retry_after(30.0)
    assert list(LearntLimit.objects.filter(key="partner").values_list("pk", "limit", "period", "observed_at")) == [first]


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
