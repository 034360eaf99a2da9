"""Every Celery pool runs the whole path exactly: threads and gevent workers on real parts."""
from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import psycopg
import pytest

from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, KeyState
from support.processes import wait_until
from support.windows import max_in_window
from tests.calls import all_finished, latency_spread, partner_call, start_times

CALLS = 60


class ConnectionSampler(threading.Thread):
    """Samples how many sessions the test database has, from a connection of its own, bounded in time."""

    def __init__(self, dsn: str, seconds: float = 120) -> None:
        super().__init__(daemon=True)
        self.dsn, self.deadline = dsn, time.monotonic() + seconds
        self.peak, self.backends, self.done = 0, set(), threading.Event()
        self.at_peak: list[tuple] = []
        self.others = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            while not self.done.is_set() and time.monotonic() < self.deadline:
                rows = db.execute(
                    "SELECT pid, backend_type, application_name, left(query, 60) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchall()
                # Client sessions only: a parallel query's workers and autovacuum show the database too.
                clients = [row for row in rows if row[1] == "client backend"]
                if len(clients) > self.peak:
                    self.peak, self.at_peak = len(clients), rows
                self.others = max(self.others, len(rows) - len(clients))
                self.backends.update(pid for pid, *_ in clients)
                time.sleep(0.05)

    def stop(self) -> None:
        self.done.set()
        self.join(timeout=10)


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize(
    ("pool", "concurrency", "per_message"),
    # With 4 calls per message, each message's calls start together and run at once in threads
    # (greenlets under gevent) of the message's own.
    [("threads", 8, 1), ("gevent", 16, 1), ("threads", 2, 4), ("gevent", 4, 4)],
)
def test_a_threads_or_gevent_worker_runs_every_call_once_within_every_policy(
    procs, fake_api, pool, concurrency, per_message
):
    edit.set_policy("partner", 12, timedelta(seconds=1), concurrency=5)
    edit.set_policy("tenant:*", 5, timedelta(seconds=1))
    calls = [partner_call(fake_api, "/slow?delay=0.25", "ab"[i % 2], i) for i in range(CALLS)]
    sampler = ConnectionSampler(procs.env["DATABASE_URL"])
    sampler.start()
    env = {"DISPATCHER_CALLS_PER_MESSAGE": str(per_message)}
    procs.worker(procs.queue, concurrency=concurrency, pool=pool)
    procs.dispenser(extra_env=env)
    procs.dispenser(extra_env=env)
    try:
        assert wait_until(all_finished, timeout=90, interval=0.5), procs.logs()
    finally:
        sampler.stop()

    assert Counter(CallQueue.objects.values_list("status", flat=True)) == {"done": CALLS}, procs.logs()
    # None lost, none run twice: one attempt per call, one request per call at the API.
    assert Counter(Attempt.objects.values_list("call_id", flat=True)) == {c.id: 1 for c in calls}
    assert Counter(a.call for a in fake_api.arrivals) == {str(i): 1 for i in range(CALLS)}
    # The pool really ran calls side by side, and never more than the policy's concurrency.
    assert 2 <= fake_api.max_in_flight <= 5

    partner = start_times("partner")
    assert len(partner) == CALLS
    assert max_in_window(partner, 1.0) <= 12
    for tenant in "ab":
        assert max_in_window(start_times(f"tenant:{tenant}"), 1.0) <= 5
    index = {c.id: str(i) for i, c in enumerate(calls)}
    spread = latency_spread(fake_api, {index[a.call_id]: a.started_at.timestamp() for a in Attempt.objects.all()})
    assert max_in_window(fake_api.times(), 1.0 - spread) <= 12
    for tenant in "ab":
        assert max_in_window(fake_api.times(lambda a, t=tenant: a.tenant == t), 1.0 - spread) <= 5
    assert not KeyState.objects.filter(reserved__gt=0).exists()
    assert not CallQueue.objects.filter(status="running").exists()
    # One pooled HTTP client per process: the calls reused a handful of kept-alive connections.
    assert fake_api.connections <= concurrency * per_message
    # Database sessions stay within the pool's size, plus the two dispensers' two each (work and
    # LISTEN), the worker's main process, its delay writer (from its first request later than its
    # key's memory covered; counted without it, -c 8 once peaked one over) and this test's own: 7,
    # as docs/pools.md counts them.
    # Under gevent a task's connection closes when its greenlet ends instead of lingering until
    # garbage collection. With several calls per message, each handler thread of a message may
    # open one too (the http handler stores the API's rate-limit signals), closed when its
    # handler returns.
    sessions = concurrency * (1 + per_message) if per_message > 1 else concurrency
    assert sampler.peak <= sessions + 7, f"peak {sampler.peak} database sessions: {sampler.at_peak}"
    print(
        f"\n{pool} -c {concurrency}, {per_message} per message: peak starts {max_in_window(partner, 1.0)}/1s (limit 12), peak in flight"
        f" {fake_api.max_in_flight} (limit 5), {fake_api.connections} connections, database sessions peak {sampler.peak}"
        f" ({len(sampler.backends)} opened), spread {spread * 1000:.0f} ms"
    )
