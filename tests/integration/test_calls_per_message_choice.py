"""Adaptive calls per message: the dispenser packs one call per message while the backlog fits the
workers' slots and more as it deepens, never over DISPATCHER_CALLS_PER_MESSAGE; a slow call of a
message holds back no other's result."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from dispatcher import dispenser as dispenser_module
from dispatcher import liveness
from dispatcher.dispenser import RUN_CALL, UNKNOWN_SLOTS, Dispenser, calls_per_message, plan_messages
from dispatcher.limits import edit
from dispatcher.managers import Claimed
from dispatcher.models import Attempt, CallQueue, Heartbeat, KeyState
from dispatcher.worker import execute, execute_many
from support.processes import ROOT
from tests.claims import claim


@pytest.mark.parametrize(
    ("backlog", "slots", "most", "expected"),
    [
        (1, 32, 16, 1),  # a lone call goes alone
        (32, 32, 16, 1),  # fits the slots: one call each
        (33, 32, 16, 2),  # one more than the slots: two per message, every slot still gets one
        (100, 4, 16, 16),  # deep: the maximum
        (10_000, 4, 16, 16),  # never over it
        (100, 4, 10, 10),
        (100, 4, 1, 1),  # 1: always one per message
        (16, None, 16, 2),  # no worker said its slots: UNKNOWN_SLOTS (8)
    ],
)
def test_the_choice_spreads_the_backlog_over_the_slots_up_to_the_maximum(backlog, slots, most, expected):
    assert UNKNOWN_SLOTS == 8
    assert calls_per_message(backlog, slots, most) == expected


@pytest.fixture
def published(monkeypatch):
    """What the dispenser publishes, with the calls per message it chose, instead of a broker write."""
    sent: list = []
    monkeypatch.setattr(
        dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.append((len(calls), per_message, len(alone)))
    )
    return sent


def _worker(name: str, slots: int | None) -> None:
    liveness.beat(liveness.WORKER, name, force=True, slots=slots)


def _backlog(n: int) -> None:
    edit.set_policy("api:*", 1_000_000, timedelta(seconds=1))
    CallQueue.objects.send_many([{"method": "noop", "keys": [f"api:{i % 5}"]} for i in range(n)])


@pytest.mark.django_db(transaction=True)
def test_a_shallow_backlog_goes_one_call_per_message(published):
    _worker("worker a", 4)
    _backlog(3)
    report = Dispenser().run_once()
    assert report.moved == 3 and report.per_message == 1
    assert published == [(3, 1, 0)]


@pytest.mark.django_db(transaction=True)
def test_a_deep_backlog_packs_up_to_the_maximum_and_never_more(published, settings):
    _worker("worker a", 2)
    _worker("worker b", 2)
    _backlog(30)
    # 30 calls over 4 slots: 8 per message, one message for each slot.
    assert Dispenser().run_once().per_message == 8
    CallQueue.objects.all().delete()
    _backlog(300)
    assert Dispenser().run_once().per_message == 16  # the default maximum
    settings.DISPATCHER_CALLS_PER_MESSAGE = 5
    CallQueue.objects.all().delete()
    _backlog(300)
    assert Dispenser().run_once().per_message == 5
    settings.DISPATCHER_CALLS_PER_MESSAGE = 1
    CallQueue.objects.all().delete()
    _backlog(300)
    assert Dispenser().run_once().per_message == 1


@pytest.mark.django_db(transaction=True)
def test_calls_the_workers_have_not_started_deepen_the_backlog(published):
    """Workers that lag (calls dispatched, not yet started) make a small pass pack its calls."""
    _worker("worker a", 2)
    _backlog(40)
    first = Dispenser(batch=2).run_once()
    assert (first.moved, first.per_message) == (2, 1)
    # 2 still at the workers and 2 claimed now: 4 over 2 slots, 2 per message.
    second = Dispenser(batch=2).run_once()
    assert (second.moved, second.per_message) == (2, 2)
    assert CallQueue.objects.filter(status="dispatched").count() == 4


@pytest.mark.django_db(transaction=True)
def test_only_live_workers_slots_count(published):
    _worker("worker gone", 1000)
    Heartbeat.objects.filter(name="worker gone").update(stopped_at=Heartbeat.objects.get().seen_at)
    _worker("worker old", None)  # a worker that does not say its slots
    assert liveness.worker_slots() is None
    _worker("worker a", 3)
    assert liveness.worker_slots() == 3


@pytest.mark.parametrize(("value", "check"), [("0", "dispatcher.E002"), ("-4", "dispatcher.E002"), ("many", "dispatcher.E001")])
def test_a_bad_maximum_stops_the_dispenser_at_startup_with_a_clear_error(value, check, tmp_path):
    env = {**os.environ, "DISPATCHER_CALLS_PER_MESSAGE": value, "DISPATCHER_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    run = subprocess.run(
        [sys.executable, "manage.py", "dispense"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode != 0
    assert check in run.stderr and "DISPATCHER_CALLS_PER_MESSAGE" in run.stderr, run.stderr


@pytest.mark.django_db(transaction=True)
def test_a_slow_call_of_a_message_holds_back_no_other_result():
    edit.set_policy("api", 1_000_000, timedelta(seconds=1))
    slow = CallQueue.objects.send("late_send", {"delay": 3.0}, keys=["api"])
    fast = [CallQueue.objects.send("late_send", {"delay": 0.0}, keys=["api"]) for _ in range(5)]
    claimed = sorted(claim(slow.key_set, 6).calls, key=lambda c: c.id)
    assert [c.id for c in claimed] == [slow.id] + [c.id for c in fast]
    outcomes = execute_many([(c.id, c.dispatch_no) for c in claimed])
    assert outcomes == {"done": 6}
    attempts = {a.call_id: a for a in Attempt.objects.all()}
    assert len(attempts) == 6
    slow_done = attempts[slow.id].finished_at
    assert slow_done - attempts[slow.id].started_at >= timedelta(seconds=3)
    for call in fast:
        # Recorded when its handler returned, not when the slow one did.
        assert slow_done - attempts[call.id].finished_at > timedelta(seconds=2)
        assert CallQueue.objects.get(id=call.id).status == "done"


def _claimed(key_set: str, n: int) -> list[Claimed]:
    return [Claimed(id=i, dispatch_no=1, queue="q", key_set=key_set) for i in range(n)]


def test_the_calls_of_key_sets_sent_alone_go_one_per_message_and_the_rest_share():
    calls = _claimed('["fresh"]', 3) + _claimed('["heard"]', 5)
    messages = plan_messages(calls, 4, alone={'["fresh"]'})
    sizes = [1 if task == RUN_CALL else len(args[0]) for _, task, args in messages]
    assert sizes == [1, 1, 1, 4, 1]
    assert sum(sizes) == len(calls)
    carried = [c for _, task, args in messages for c in ([list(args)] if task == RUN_CALL else args[0])]
    assert sorted(c[0] for c in carried) == sorted(c.id for c in calls)


@pytest.mark.django_db(transaction=True)
def test_keys_no_call_has_finished_under_go_one_per_message_until_one_does(published):
    """A group starts its calls at once, before the API's first answer could teach its limit:
    the calls of a key go one per message until a call of it has finished."""
    _worker("worker a", 1)
    edit.set_policy("api:*", 1_000_000, timedelta(seconds=1))
    CallQueue.objects.send_many(
        [{"method": "noop", "keys": ["api:a"]} for _ in range(6)]
        + [{"method": "noop", "keys": ["api:a", "api:b"]} for _ in range(6)]
        + [{"method": "noop", "keys": ["api:c"]} for _ in range(6)]
    )
    dispenser = Dispenser(batch=3)
    dispenser.run_once()
    # Three calls, one of each key set, over one slot: three per message, but every key set is
    # new, so each call goes alone.
    assert published == [(3, 3, 3)]
    # A worker finishes a call of api:a: api:a's calls share messages; api:a + api:b's still wait
    # for api:b, and api:c's for their own.
    call = CallQueue.objects.filter(status="dispatched").first()
    assert execute(call.id, call.dispatch_no) == "done"
    CallQueue.objects.filter(status="dispatched").update(status="done")
    assert KeyState.objects.get(key="api:a").answered_at is not None
    claims = [d.unanswered_key_sets(claim(k, 1).calls) for d, k in
              [(dispenser, '["api:a"]'), (dispenser, '["api:a","api:b"]'), (dispenser, '["api:c"]')]]
    assert claims == [set(), {'["api:a","api:b"]'}, {'["api:c"]'}]
