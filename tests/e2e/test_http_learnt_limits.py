"""An API that announces its limit is obeyed even when our own policy is far too loose."""
from __future__ import annotations

import math
from datetime import timedelta

import pytest

from dispatcher.handlerpool import MESSAGE_THREADS
from dispatcher.limits import edit
from dispatcher.models import CallQueue, LearntLimit
from support.fakeapi import FakeAPI
from support.processes import wait_until

LIMIT, PERIOD = 10, 2.0
CALLS = 40


def allowance(times: list[float]) -> int:
    """Most requests the API allows between the first and last of these arrival times."""
    return LIMIT * (math.floor((max(times) - min(times)) / PERIOD) + 1)


@pytest.mark.postgres
@pytest.mark.parametrize("announce", ["x-seconds", "x-epoch", "ietf", "retry-after"])
def test_a_policy_far_too_loose_learns_the_limit_the_api_announces(procs, announce):
    api = FakeAPI(enforce=(LIMIT, PERIOD), announce=announce).start()
    try:
        edit.set_policy("partner", LIMIT * 100, timedelta(seconds=PERIOD))  # 100x too loose
        for n in range(CALLS):
            CallQueue.objects.send("http", {"method": "GET", "url": f"{api.url}/ok", "headers": {"x-call": str(n)}},
                                   keys=["partner"])
        procs.worker(procs.queue, concurrency=4)
        procs.dispenser()
        finished = wait_until(lambda: not CallQueue.objects.exclude(status__in=CallQueue.FINISHED).exists(), timeout=60)
        assert finished, procs.logs()
        assert CallQueue.objects.filter(status="done").count() == CALLS
        times = api.times(lambda a: True)
        first = min(times)
        late = [t for t in api.rejected_at if t > first + PERIOD]
        print(f"{announce}: {api.rejected_429} 429s, {CALLS} calls in {max(times) - first:.2f}s, allowance {allowance(times)}")
        assert api.rejected_429 <= 5, f"{api.rejected_429} answers were 429"
        assert late == [], f"429s after the first window at {[round(t - first, 2) for t in late]}"
        served = CALLS
        assert served / allowance(times) >= 0.7, f"{served} of {allowance(times)} allowed in {max(times) - first:.1f}s"
        rows = list(LearntLimit.objects.filter(key="partner").exclude(source__endswith=":remaining"))
        assert len(rows) == 1, rows
        learnt = rows[0]
        if announce == "retry-after":
            # Inferred: the calls admitted before the first 429, from the first of them to the reset.
            assert learnt.source == "retry-after" and learnt.limit <= LIMIT, learnt
        else:
            assert learnt.limit == LIMIT
        assert learnt.period >= timedelta(seconds=PERIOD), learnt
        # Each process keeps one pooled client. A message of several calls runs up to MESSAGE_THREADS
        # of them at once, each on a kept-alive connection of that client, so 4 processes open at
        # most 4 x MESSAGE_THREADS. A client per call would open one for each of the 40-odd requests.
        bound = 4 * MESSAGE_THREADS
        assert api.connections <= bound < CALLS, f"{api.connections} connections for {CALLS} calls from 4 worker processes"
    finally:
        api.stop()


@pytest.mark.postgres
def test_the_threads_pool_shares_one_pooled_client(procs, fake_api):
    import sys

    for n in range(30):
        CallQueue.objects.send("http", {"method": "GET", "url": f"{fake_api.url}/ok", "headers": {"x-call": str(n)}})
    # One call per message: the pool's 4 threads are then the most requests in flight at once (a
    # message of several calls runs them on threads of its own, up to MESSAGE_THREADS), so a
    # client per call (or per thread beyond them) would show as more connections than 4.
    env = {"DISPATCHER_CALLS_PER_MESSAGE": "1"}
    procs.start(
        "worker", sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", procs.queue, "-P", "threads",
        "-c", "4", "-l", "info", "--without-mingle", "--without-gossip", "--without-heartbeat", "-n", "threads@%h",
        extra_env=env,
    )
    procs.dispenser(extra_env=env)
    assert wait_until(lambda: CallQueue.objects.filter(status="done").count() == 30, timeout=60), procs.logs()
    assert fake_api.connections <= 4, f"{fake_api.connections} connections for 30 calls from 4 threads"
