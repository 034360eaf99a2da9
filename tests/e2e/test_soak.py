"""A bounded soak: several dispensers and workers, random faults, over a thousand calls."""
from __future__ import annotations

import random
import signal
import time
from collections import Counter
from datetime import timedelta

import pytest

from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue
from support.fakeapi import max_in_window
from tests.calls import all_finished
from tests.e2e.test_faults import terminate_other_backends

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CALLS = 1500
SOAK_SECONDS = 90


def _api_starts() -> list[float]:
    return [a.timestamp() for a in Attempt.objects.filter(call__keys__contains=["api"]).values_list("started_at", flat=True)]


def test_soak_with_random_faults_loses_nothing_and_keeps_every_limit(procs, fake_api, settings):
    settings.DISPATCHER_DISPATCH_TIMEOUT = "3s"
    settings.DISPATCHER_RUN_TIMEOUT = "8s"
    edit.set_policy("api", 40, timedelta(seconds=1))
    edit.set_policy("tenant:*", 15, timedelta(seconds=1))
    specs = [
        {"method": "http", "params": {"method": "GET", "url": f"{fake_api.url}/ok", "headers": {"x-call": str(i)}},
         "keys": ["api", f"tenant:{i % 3}"], "max_attempts": 5}
        for i in range(CALLS)
    ]
    CallQueue.objects.send_many(specs)
    workers = [procs.worker(procs.queue, concurrency=2) for _ in range(2)]
    for _ in range(3):
        procs.dispenser()
    rng = random.Random(6)
    faults: Counter = Counter()
    deadline = time.monotonic() + SOAK_SECONDS
    while time.monotonic() < deadline and not all_finished():
        time.sleep(rng.uniform(1.0, 3.0))
        fault = rng.choice(["kill_worker", "kill_connections", "none"])
        if fault == "kill_worker":
            victim = workers.pop(rng.randrange(len(workers)))
            procs.stop(victim, signal.SIGKILL)
            workers.append(procs.worker(procs.queue, concurrency=2))
        elif fault == "kill_connections":
            terminate_other_backends()
        faults[fault] += 1
        CallQueue.objects.rescue()
    end = time.monotonic() + 120
    while time.monotonic() < end and not all_finished():
        CallQueue.objects.rescue()
        time.sleep(0.5)

    status = Counter(CallQueue.objects.values_list("status", flat=True))
    lost = CALLS - status["done"] - status["failed"] - status["cancelled"]
    over = sum(1 for limit in [40] if max_in_window(_api_starts(), 1.0) > limit)
    for tenant in range(3):
        times = [a.timestamp() for a in Attempt.objects.filter(call__keys__contains=[f"tenant:{tenant}"])
                 .values_list("started_at", flat=True)]
        over += max_in_window(times, 1.0) > 15
    arrivals = Counter(a.call for a in fake_api.arrivals)
    duplicates = sum(n - 1 for n in arrivals.values() if n > 1)
    print(f"\nsoak: sent={CALLS} done={status['done']} failed={status['failed']} lost={lost} "
          f"windows_over_limit={over} duplicates={duplicates} faults={dict(faults)}")
    assert lost == 0, status
    assert over == 0
    assert status["failed"] == 0
