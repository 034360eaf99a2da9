"""The threads of one worker process start their calls together (dispatcher.combiner): real
threads, each with its own PostgreSQL connection, against one key's limits."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connections, transaction

from dispatcher.combiner import StartCombiner
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, KeyState, StartLog
from tests.integration.test_lifecycle import claim_all

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _claimed(n: int) -> list[tuple[int, int]]:
    calls = [CallQueue.objects.send("noop", {}, keys=["api"]) for _ in range(n)]
    claimed = claim_all(calls[0].key_set, n).calls
    assert len(claimed) == n
    return [(c.id, c.dispatch_no) for c in claimed]


class Recording(StartCombiner):
    """The combiner, noting the size of every group it starts."""

    def __init__(self) -> None:
        self.groups: list[int] = []
        manager = CallQueue.objects

        def one(*args, **kwargs):
            self.groups.append(1)
            return manager.start(*args, **kwargs)

        def many(deliveries, *args, **kwargs):
            self.groups.append(len(deliveries))
            return manager.start_many(deliveries, *args, **kwargs)

        super().__init__(one, many)


def _spawn(combiner: StartCombiner, deliveries: list[tuple[int, int]]) -> tuple[list[threading.Thread], dict]:
    """Start every delivery from a thread of its own; the dict fills with {delivery: result or exception}."""
    results: dict = {}

    def run(delivery):
        try:
            results[delivery] = combiner.start(*delivery, "w")
        except Exception as exc:  # noqa: BLE001 - the test looks at what each thread got
            results[delivery] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(d,)) for d in deliveries]
    for thread in threads:
        thread.start()
    return threads, results


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)


def _wait(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_threads_waiting_on_a_busy_key_start_as_one_group_exactly_within_the_limit():
    deliveries = _claimed(12)
    # Set while the messages waited in the broker: only seven of the twelve fit.
    edit.set_policy("api", 7, timedelta(minutes=1))
    combiner = Recording()
    # Hold the key's row from another connection: the first thread's start waits on it, and
    # the other eleven queue behind that thread meanwhile.
    with transaction.atomic():
        KeyState.objects.select_for_update().get(key="api")
        threads, results = _spawn(combiner, deliveries)
        _wait(lambda: len(combiner._waiting) == len(deliveries) - 1)
    _join(threads)  # the block's end released the row
    assert sorted(combiner.groups, reverse=True)[0] == len(deliveries) - 1
    states = sorted(result.state for result in results.values())
    assert states == ["deferred"] * 5 + ["started"] * 7
    for (call_id, _), result in results.items():
        if result.state == "started":
            assert result.call.id == call_id  # each thread gets its own call back
    assert Attempt.objects.count() == 7
    assert KeyState.objects.get(key="api").total == 7
    assert StartLog.objects.filter(key="api").count() == 7
    assert CallQueue.objects.filter(status="running").count() == 7
    assert CallQueue.objects.filter(status="pending").count() == 5


def test_a_failed_group_start_reaches_every_thread_of_the_group_and_the_next_group_still_starts():
    deliveries = _claimed(6)
    failing = {"on": True}
    manager = CallQueue.objects

    def many(group, *args, **kwargs):
        if failing["on"]:
            raise RuntimeError("database went away")
        return manager.start_many(group, *args, **kwargs)

    def one(*args, **kwargs):
        if failing["on"]:
            raise RuntimeError("database went away")
        return manager.start(*args, **kwargs)

    combiner = StartCombiner(one, many)
    threads, results = _spawn(combiner, deliveries)
    _join(threads)
    assert all(isinstance(r, RuntimeError) for r in results.values())
    assert not combiner._leading and not combiner._waiting
    assert Attempt.objects.count() == 0  # nothing started: each thread's start can be retried
    failing["on"] = False
    threads, results = _spawn(combiner, deliveries)
    _join(threads)
    assert sorted(r.state for r in results.values()) == ["started"] * 6
    assert Attempt.objects.count() == 6
