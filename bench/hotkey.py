"""A hot key's ceiling (issue 28): how many starts per second one key takes under a loose policy,
one call per message and grouped, beside the same starts spread over as many keys as threads.

Starts of one key serialise on its row lock (``limits.locks``): the ceiling is about one over the
time a start holds it. Eight threads start calls the dispenser claimed, as a worker's threads do;
each start is also finished, so the key's running calls stay as a worker leaves them.
"""
from __future__ import annotations

import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from bench.support import Figure, check, reset_tables
from dispatcher.limits import edit

THREADS = 8
CALLS = 1_600
GROUP = 10


def _claimed(keys: list[str]) -> list[Any]:
    from dispatcher.limits.catalog import Policies
    from dispatcher.models import CallQueue

    CallQueue.objects.send_many([{"method": "bench.noop", "keys": [keys[i % len(keys)]]} for i in range(CALLS)])
    claimed: list[Any] = []
    while len(claimed) < CALLS:
        batch = CallQueue.objects.claim_batch(CallQueue.objects.waiting_key_sets(), 500, Policies.load()).calls
        check(bool(batch), f"claimed {len(claimed)} of {CALLS}")
        claimed += batch
    return claimed


def _run(deliveries: list[list[Any]]) -> float:
    """Start and finish the deliveries on THREADS threads; return the starts per second."""
    from django.db import connections

    from dispatcher.models import CallQueue

    queue = list(deliveries)
    lock = threading.Lock()
    started = [0]

    def work() -> None:
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    group = queue.pop()
                results = CallQueue.objects.start_many([(c.id, c.dispatch_no) for c in group], "bench")
                done = [(r.call, r.attempt, None, False) for r in results if r.state == "started"]
                CallQueue.objects.finish_done_many(done)
                with lock:
                    started[0] += len(done)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    seconds = time.perf_counter() - begin
    check(started[0] == CALLS, f"{started[0]} of {CALLS} calls started")
    return started[0] / seconds


def _lock_hold_ms() -> float:
    """The median time one start takes alone (it holds its key's lock for most of it)."""
    from dispatcher.models import CallQueue

    claimed = _claimed(["hot"])[:200]
    times = []
    for call in claimed:
        begin = time.perf_counter()
        result = CallQueue.objects.start(call.id, call.dispatch_no, "bench")
        times.append(time.perf_counter() - begin)
        CallQueue.objects.finish_done(result.call, result.attempt, None, wake=False)
    return statistics.median(times) * 1000


def hot_key(ctx: Any) -> list[Figure]:
    """Starts per second of one key, one call per message and grouped, beside spread keys."""

    figures = {}
    for name, keys, size in (
        ("hot, 1 per message", ["hot"], 1), ("hot, 10 per message", ["hot"], GROUP),
        ("spread, 1 per message", [f"k{i}" for i in range(THREADS)], 1),
    ):
        reset_tables()
        edit.set_policy("hot", 1_000_000_000, timedelta(seconds=1))
        edit.set_policy("k*", 1_000_000_000, timedelta(seconds=1))
        claimed = _claimed(keys)
        groups = [claimed[i:i + size] for i in range(0, len(claimed), size)]
        figures[name] = _run(groups)
    reset_tables()
    edit.set_policy("hot", 1_000_000_000, timedelta(seconds=1))
    hold = _lock_hold_ms()
    ctx.broker.purge()
    one, grouped, spread = figures["hot, 1 per message"], figures["hot, 10 per message"], figures["spread, 1 per message"]
    return [
        Figure(
            f"a hot key's starts per second ({THREADS} threads, loose policy, no-op)",
            f"{one:,.0f}/s one per message, {grouped:,.0f}/s ten per message",
            f"bound: 1 / lock hold ({1000 / hold:,.0f}/s at {hold:.2f} ms a start alone)",
            f"{spread:,.0f}/s over {THREADS} keys, one per message",
            None,
            {"one_per_message": one, "grouped": grouped, "spread": spread, "start_alone_ms": hold},
        )
    ]
