"""A worker process's messages start their calls only as its handler threads can soon take them
(``dispatcher.handlerpool``): in-process, real database, several messages at once."""
from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta

import pytest
from django.db import connections

from dispatcher import handlerpool, liveness, worker
from dispatcher.calls import dispense
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue
from dispatcher.worker import execute_many
from tests.integration.test_lifecycle import claim_all
from tests.testapp.handlers import GATE

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = handlerpool.MESSAGE_THREADS


def _messages(count: int, size: int) -> list[list[tuple[int, int]]]:
    calls = [CallQueue.objects.send("waits_for_gate", {}, keys=["api"]) for _ in range(count * size)]
    claimed = sorted(claim_all(calls[0].key_set, count * size).calls, key=lambda call: call.id)
    deliveries = [(call.id, call.dispatch_no) for call in claimed]
    return [deliveries[i * size : (i + 1) * size] for i in range(count)]


def _run(message: list[tuple[int, int]]) -> None:
    """Run a message in a thread of its own, as a worker's slot does; close its connection after."""
    try:
        execute_many(message)
    finally:
        connections.close_all()


def _statuses() -> Counter:
    return Counter(CallQueue.objects.values_list("status", flat=True))


def _handlers_took(seconds: float) -> list[tuple[int, int]]:
    """Run a round of handlers held at the gate ``seconds``: the process knows its handlers take that long."""
    (warm,) = _messages(1, THREADS)
    runner = threading.Thread(target=_run, args=(warm,))
    runner.start()
    time.sleep(seconds)
    GATE.set()
    runner.join(60)
    GATE.clear()
    return warm


def _start_all(messages: list[list[tuple[int, int]]], running: int) -> list[threading.Thread]:
    """Run each message in a thread of its own; return once ``running`` calls run (at most 20 s), and a moment more."""
    runners = [threading.Thread(target=_run, args=(message,)) for message in messages]
    for runner in runners:
        runner.start()
    deadline = time.monotonic() + 20
    while _statuses()["running"] < running and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    return runners


def _open_gate_and_join(runners: list[threading.Thread]) -> None:
    GATE.set()
    for runner in runners:
        runner.join(60)
    assert not any(runner.is_alive() for runner in runners)


@pytest.fixture
def fresh_pool(monkeypatch):
    """A process whose worker said no pool size (a prefork child's MESSAGE_THREADS threads), the
    gate closed; every call's room is back at the end. (No handler of it has returned yet: the
    autouse fixture of tests/conftest.py.)"""
    monkeypatch.setattr(liveness, "_main_slots", None)
    GATE.clear()
    yield
    GATE.set()
    assert handlerpool.waiting() == 0


def test_a_new_process_starts_only_what_its_idle_threads_take_until_a_handler_returns(fresh_pool):
    messages = _messages(4, THREADS)
    runners = _start_all(messages, THREADS)
    # One message's calls started, a round at work (the handlers wait for the gate). Nothing is
    # known yet of how long handlers take: the others wait to start, none waits for a thread.
    assert _statuses() == {"running": THREADS, "dispatched": 3 * THREADS}
    assert handlerpool.waiting() == 0
    _open_gate_and_join(runners)
    # Every call ran once, its message's turn come as threads freed.
    assert _statuses() == {"done": 4 * THREADS}
    assert Counter(Attempt.objects.values_list("call_id", flat=True)) == {call: 1 for m in messages for call, _ in m}


def test_beyond_a_round_of_waiting_calls_messages_wait_for_threads_to_take_calls(fresh_pool):
    # Handlers known to take 0.15 s: those at work are expected back within AHEAD, yet a message
    # starts only while fewer calls wait for a thread than the process has threads.
    warm = _handlers_took(0.15)
    messages = _messages(4, THREADS)
    runners = _start_all(messages, 2 * THREADS)
    # Two messages' calls started: one round at work, one waiting for a thread. Nothing more
    # starts while no thread frees.
    assert _statuses() == {"done": THREADS, "running": 2 * THREADS, "dispatched": 2 * THREADS}
    assert handlerpool.waiting() == THREADS
    _open_gate_and_join(runners)
    assert _statuses() == {"done": 5 * THREADS}
    ran = Counter(Attempt.objects.values_list("call_id", flat=True))
    assert ran == {call: 1 for m in (warm, *messages) for call, _ in m}


def test_behind_slow_handlers_a_message_starts_only_the_calls_threads_can_soon_take(fresh_pool):
    # The process's handlers lately took about 2 s each.
    warm = _handlers_took(2.0)
    # A message of more calls than threads: the idle threads' worth starts; the others would wait
    # a whole slow round for a thread, so they wait unstarted (dispatched), not counted started
    # (looked at well before the round is expected to end: 2 s less AHEAD).
    (message,) = _messages(1, THREADS + 4)
    runners = _start_all([message], THREADS)
    assert _statuses() == {"done": THREADS, "running": THREADS, "dispatched": 4}
    assert handlerpool.waiting() == 0
    # As the threads come free, the rest start and run; every call ran once.
    _open_gate_and_join(runners)
    assert _statuses() == {"done": 2 * THREADS + 4}
    ran = Counter(Attempt.objects.values_list("call_id", flat=True))
    assert ran == {call: 1 for m in (warm, message) for call, _ in m}


def test_a_message_whose_start_fails_gives_its_room_back(fresh_pool, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the start failed")

    monkeypatch.setattr(CallQueue.objects, "start_many", broken)
    (message,) = _messages(1, 3)
    with pytest.raises(RuntimeError):
        execute_many(message)
    assert handlerpool.waiting() == 0



def test_a_messages_started_calls_run_while_its_early_ones_wait_for_room(fresh_pool, settings, monkeypatch):
    """Of a message's calls, those that start go to their handlers at once; one that came early
    for its key's room (claimed up to DISPATCH_AHEAD before it) waits for that room after. Held
    back with it, the started calls' handlers began up to that wait after their starts, which
    their key learnt as start-to-send delays: its guard grew, and a window of 50 per second used
    90% of its allowance (the `utilisation` benchmark row; 100% since)."""
    for module in (worker, dispense):  # a claim's look ahead, and so a start's allowed wait
        monkeypatch.setattr(module, "DISPATCH_AHEAD", timedelta(seconds=2))
    settings.DISPATCHER_ARRIVAL_GUARD = "0"  # also forgets the settings read, DISPATCH_AHEAD's included
    edit.set_policy("api", 10, timedelta(seconds=1))
    calls = [CallQueue.objects.send("db_clock", {}, keys=["api"]) for _ in range(4)]
    before, *claimed = sorted(claim_all(calls[0].key_set, 4).calls, key=lambda call: call.id)
    edit.set_policy("api", 3, timedelta(seconds=1))
    assert execute_many([(before.id, before.dispatch_no)]) == {"done": 1}

    # A message of three: two fit the window's room now, the third only once the first start leaves it.
    assert execute_many([(call.id, call.dispatch_no) for call in claimed]) == {"done": 3}

    started = dict(Attempt.objects.values_list("call_id", "started_at"))
    ran = {call.id: datetime.fromisoformat(call.result["at"]) for call in CallQueue.objects.all()}
    first, second, third = (call.id for call in claimed)
    assert started[third] - started[before.id] >= timedelta(seconds=1)
    # The two that started ran before the third could start, not after its wait.
    assert max(ran[first], ran[second]) < started[third]
