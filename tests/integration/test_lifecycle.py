"""A call's life through the manager and the worker code, without a broker in between."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, KeyState, StartLog
from dispatcher.worker import execute
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)


def claim_all(key_set_text: str, limit: int = 100):
    return claim(key_set_text, limit)


def claim_one(call: CallQueue):
    result = claim_all(call.key_set, 1)
    assert [c.id for c in result.calls] == [call.id]
    return result.calls[0]


def test_claim_respects_the_rate_limit_and_orders_by_priority_then_age():
    edit.set_policy("greeter", 2, timedelta(minutes=1))
    low = CallQueue.objects.send("greet", {"name": "x"}, priority=0)
    high = CallQueue.objects.send("greet", {"name": "x"}, priority=9)
    older = CallQueue.objects.send("greet", {"name": "x"}, priority=0)
    result = claim_all(low.key_set)
    assert [c.id for c in result.calls] == [high.id, low.id]
    assert CallQueue.objects.get(pk=older.pk).status == "pending"
    again = claim_all(low.key_set)
    assert again.calls == [] and again.verdict.blocked
    assert KeyState.objects.get(key="greeter").reserved == 2


def test_dispatched_calls_count_against_the_window_until_they_start():
    edit.set_policy("greeter", 1, timedelta(minutes=1))
    first = CallQueue.objects.send("greet", {"name": "a"})
    CallQueue.objects.send("greet", {"name": "b"})
    claimed = claim_one(first)
    assert execute(claimed.id, claimed.dispatch_no) == "done"
    assert StartLog.objects.filter(key="greeter").count() == 1
    blocked = claim_all(CallQueue.objects.get(params={"name": "b"}).key_set)
    assert blocked.calls == [] and blocked.verdict.until is not None
    assert blocked.verdict.until > CallQueue.objects.get(pk=first.pk).started_at + timedelta(seconds=59)


def test_concurrency_cap_counts_dispatched_and_running_calls():
    edit.set_policy("greeter", 100, timedelta(seconds=1), concurrency=1)
    a = CallQueue.objects.send("greet", {"name": "a"})
    b = CallQueue.objects.send("greet", {"name": "b"})
    claim_one(a)
    assert claim_all(b.key_set).calls == []


def test_pattern_gives_each_tenant_its_own_limit():
    edit.set_policy("greeter:*", 1, timedelta(minutes=1))
    a1 = CallQueue.objects.send("greet", {"name": "a"})
    CallQueue.objects.send("greet", {"name": "a"})
    b1 = CallQueue.objects.send("greet", {"name": "b"})
    assert [c.id for c in claim_all(a1.key_set).calls] == [a1.id]
    assert [c.id for c in claim_all(b1.key_set).calls] == [b1.id]


def test_every_policy_of_a_key_must_have_room():
    edit.set_policy("greeter", 10, timedelta(seconds=1))
    edit.set_policy("greeter", 3, timedelta(hours=1))
    calls = [CallQueue.objects.send("greet", {"name": "a"}) for _ in range(5)]
    assert len(claim_all(calls[0].key_set).calls) == 3


def test_paused_key_admits_nothing_until_resumed():
    call = CallQueue.objects.send("greet", {"name": "a"})
    edit.pause_key("greeter", timedelta(minutes=5))
    verdict = claim_all(call.key_set).verdict
    assert verdict.blocked and verdict.reason == "paused"
    edit.resume_key("greeter")
    assert len(claim_all(call.key_set).calls) == 1


def test_a_duplicate_message_runs_the_handler_once():
    call = CallQueue.objects.send("greet", {"name": "a"})
    claimed = claim_one(call)
    assert execute(claimed.id, claimed.dispatch_no) == "done"
    assert execute(claimed.id, claimed.dispatch_no) == "stale"
    assert Attempt.objects.filter(call=call).count() == 1
    assert CallQueue.objects.get(pk=call.pk).result == {"greeting": "hello a"}


def test_a_stale_message_from_an_earlier_dispatch_does_nothing():
    call = CallQueue.objects.send("greet", {"name": "a"})
    first = claim_one(call)
    CallQueue.objects.put_back([first])
    second = claim_one(call)
    assert execute(first.id, first.dispatch_no) == "stale"
    assert execute(second.id, second.dispatch_no) == "done"


def test_a_message_for_a_cancelled_call_does_nothing():
    call = CallQueue.objects.send("greet", {"name": "a"})
    assert CallQueue.objects.cancel([call.pk]) == 1
    assert execute(call.id, 1) == "stale"
    assert CallQueue.objects.get(pk=call.pk).status == "cancelled"


def test_errors_are_retried_until_max_attempts_then_fail():
    call = CallQueue.objects.send("explode", {}, max_attempts=2)
    claimed = claim_one(call)
    assert execute(claimed.id, claimed.dispatch_no) == "error"
    waiting = CallQueue.objects.get(pk=call.pk)
    assert waiting.status == "pending" and waiting.attempts == 1 and waiting.is_retry_wait
    assert "RuntimeError: boom" in waiting.last_error and "Traceback" in waiting.last_traceback
    CallQueue.objects.filter(pk=call.pk).update(run_at=waiting.created_at)  # skip the backoff
    claimed = claim_one(call)
    assert execute(claimed.id, claimed.dispatch_no) == "error"
    failed = CallQueue.objects.get(pk=call.pk)
    assert failed.status == "failed" and failed.attempts == 2
    assert list(Attempt.objects.filter(call=call).values_list("outcome", flat=True)) == ["error", "error"]


def test_permanent_error_fails_at_once():
    call = CallQueue.objects.send("explode", {"permanent": True}, max_attempts=5)
    claimed = claim_one(call)
    assert execute(claimed.id, claimed.dispatch_no) == "failed"
    failed = CallQueue.objects.get(pk=call.pk)
    assert failed.status == "failed" and failed.attempts == 1 and "cannot be done" in failed.last_error


def test_start_rechecks_the_window_when_a_policy_tightened_after_dispatch():
    a = CallQueue.objects.send("greet", {"name": "a"})
    b = CallQueue.objects.send("greet", {"name": "b"})
    ca, cb = claim_one(a), claim_one(b)
    edit.set_policy("greeter", 1, timedelta(minutes=1))
    assert execute(ca.id, ca.dispatch_no) == "done"
    assert execute(cb.id, cb.dispatch_no) == "deferred"
    deferred = CallQueue.objects.get(pk=b.pk)
    assert deferred.status == "pending" and deferred.attempts == 0
    assert KeyState.objects.get(key="greeter").reserved == 0


def test_rescue_returns_stuck_calls_and_counts_a_started_attempt(settings):
    settings.DISPATCHER_DISPATCH_TIMEOUT = "0s"
    settings.DISPATCHER_RUN_TIMEOUT = "0s"
    lost_message = CallQueue.objects.send("greet", {"name": "a"})
    died_mid_call = CallQueue.objects.send("greet", {"name": "b"})
    claim_one(lost_message)
    claimed = claim_one(died_mid_call)
    CallQueue.objects.start(claimed.id, claimed.dispatch_no)
    report = CallQueue.objects.rescue()
    assert (report.dispatched, report.running) == (1, 1)
    first, second = CallQueue.objects.get(pk=lost_message.pk), CallQueue.objects.get(pk=died_mid_call.pk)
    assert first.status == second.status == "pending"
    assert (first.attempts, second.attempts) == (0, 1)
    assert Attempt.objects.get(call=died_mid_call).outcome == "lost"
    assert KeyState.objects.get(key="greeter").reserved == 0
    assert not CallQueue.objects.filter(status="running").exists()


def test_retry_now_gives_a_failed_call_one_more_attempt():
    call = CallQueue.objects.send("explode", {"permanent": True}, max_attempts=1)
    claimed = claim_one(call)
    execute(claimed.id, claimed.dispatch_no)
    assert CallQueue.objects.retry_now([call.pk]) == 1
    again = CallQueue.objects.get(pk=call.pk)
    assert again.status == "pending" and again.max_attempts == 2


def test_cancel_leaves_calls_in_flight_alone():
    call = CallQueue.objects.send("greet", {"name": "a"})
    claim_one(call)
    assert CallQueue.objects.cancel([call.pk]) == 0
    assert CallQueue.objects.get(pk=call.pk).status == "dispatched"
