"""DISPATCHER_CALLS_PER_MESSAGE: several calls in one Celery message, started together and run at once."""
from __future__ import annotations

import re
from collections import Counter
from datetime import timedelta

import pytest

from dispatcher import liveness
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, StartLog
from support.fakeapi import max_in_window
from support.keys import mark_answered
from support.processes import wait_until
from tests.claims import claim

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _calls_per_message(procs) -> list[int]:
    """How many calls each message the workers ran carried, read from their full logs."""
    logs = "".join(path.read_text(errors="replace") for _, path in procs.procs)
    single = len(re.findall(r"Task dispatcher\.run_call\[[^\]]+\] succeeded", logs))
    batched = [
        sum(int(n) for n in re.findall(r": (\d+)", outcome))
        for outcome in re.findall(r"Task dispatcher\.run_calls\[[^\]]+\] succeeded in [\d.]+s: \{([^}]*)\}", logs)
    ]
    return [1] * single + batched


def test_calls_share_messages_and_each_still_runs_once_within_its_limit(procs, fake_api):
    edit.set_policy("partner", 5, timedelta(seconds=1))
    # A key in use: otherwise its first calls go alone and, started one by one, leave the window
    # one by one, so every later pass finds room for one call only (seen in CI: ten messages of one).
    mark_answered(["partner"])
    calls = [
        CallQueue.objects.send(
            "http", {"method": "GET", "url": f"{fake_api.url}/ok/{i}"}, keys=["partner"]
        )
        for i in range(10)
    ]
    env = {"DISPATCHER_CALLS_PER_MESSAGE": "4"}
    procs.worker(procs.queue, concurrency=2, extra_env=env)
    # The dispenser sizes messages by the slots the live workers say they have (2 here).
    assert wait_until(lambda: liveness.worker_slots() == 2, timeout=30), procs.logs()
    procs.dispenser(extra_env=env)
    assert wait_until(lambda: CallQueue.objects.filter(status="done").count() == 10, timeout=60), procs.logs()

    # Every call travelled in some message, none carried more than 4, and some carried several
    # (the first pass finds the window's five free: 3 and 2 over the 2 slots).
    # (A worker logs a message's outcome after its calls are recorded done: wait for the lines.)
    wait_until(lambda: sum(_calls_per_message(procs)) >= 10, timeout=15)
    sizes = _calls_per_message(procs)
    assert sum(sizes) == 10 and max(sizes) <= 4 and len(sizes) < 10, (sizes, procs.logs())
    assert Counter(Attempt.objects.values_list("call_id", flat=True)) == {c.id: 1 for c in calls}
    assert sum(fake_api.counters[f"/ok/{i}"] for i in range(10)) == 10
    starts = [t.timestamp() for t in StartLog.objects.filter(key="partner").values_list("started_at", flat=True)]
    assert max_in_window(starts, 1.0) <= 5


def test_a_stale_delivery_in_a_message_does_not_stop_the_others(procs, fake_api):
    from kombu import Connection

    from dispatcher.tasks import run_calls

    first, second = (
        CallQueue.objects.send("http", {"method": "GET", "url": f"{fake_api.url}/ok/{i}"}) for i in range(2)
    )
    claimed = claim(first.key_set, 2).calls
    stale = [claimed[0].id, claimed[0].dispatch_no + 7]
    with Connection(procs.env["CELERY_BROKER_URL"]) as conn:
        run_calls.apply_async(([stale, *([c.id, c.dispatch_no] for c in claimed)],), queue=procs.queue, connection=conn)
    procs.worker(procs.queue, concurrency=1)
    assert wait_until(lambda: CallQueue.objects.filter(status="done").count() == 2, timeout=30), procs.logs()
    assert f"run_skipped call={first.id}" in procs.logs()
    assert Attempt.objects.filter(call__in=[first, second]).count() == 2


def test_a_threads_worker_runs_no_more_calls_at_once_than_its_concurrency(procs, fake_api):
    """Messages of several calls under a deep backlog: a `-P threads -c 6` worker's process runs
    at most max(6, MESSAGE_THREADS) handlers at once, not 6 messages times MESSAGE_THREADS (the
    process's one GIL: past about 40 threads at work its CPU per call doubled, handlerpool.handler_threads)."""
    from dispatcher.handlerpool import MESSAGE_THREADS

    slots = 12
    bound = max(slots, MESSAGE_THREADS)
    edit.set_policy("partner", 1_000_000, timedelta(seconds=1))
    mark_answered(["partner"])
    calls = 120
    CallQueue.objects.send_many(
        [{"method": "http", "params": {"method": "GET", "url": f"{fake_api.url}/slow?delay=0.2"}, "keys": ["partner"]}
         for _ in range(calls)]
    )
    procs.worker(procs.queue, concurrency=slots, pool="threads")
    assert wait_until(lambda: liveness.worker_slots() == slots, timeout=30), procs.logs()
    procs.dispenser()
    assert wait_until(lambda: CallQueue.objects.filter(status="done").count() == calls, timeout=90), procs.logs()
    wait_until(lambda: sum(_calls_per_message(procs)) >= calls, timeout=15)
    sizes = _calls_per_message(procs)
    # The backlog went in messages of several calls (120 over 12 slots: 10 each) ...
    assert sum(sizes) == calls and max(sizes) > MESSAGE_THREADS, sizes
    # ... and the API never had more of them at once than the worker's concurrency (the old
    # bound, 12 messages x 8 threads, let 96 through).
    assert fake_api.max_serving <= bound, f"{fake_api.max_serving} requests at once from a -c {slots} worker"
    assert fake_api.max_serving >= MESSAGE_THREADS, "the messages' calls did not run at once"
    assert Attempt.objects.count() == calls
