"""Smooth rates held behind a real nginx ``limit_req`` (no burst): the scenario of bench/pacing.py
and tests/e2e/test_arrivals.py.

A backlog per rate goes to nginx through several dispensers and a worker that starts late, at
default settings, our policy ``limit N per 1s, burst 1`` for nginx's ``rate=Nr/s``. Measured at
the fake API behind nginx: how much of nginx's capacity the calls used (the requests it let
through over the time from the first to the last, against one per interval), and, from nginx's
own log, how many it refused (429).
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from datetime import timedelta
from typing import Any

from dispatcher.limits import edit
from support.processes import wait_until

# A bounded busy loop: one core of the 2-core machine kept busy while a scenario runs.
BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


# Calls a second of the other key's 100 ms calls (``busy_calls``): 20 at once on the API.
BUSY_RATE = 200


def load(procs, seconds: float) -> Any:
    """Start a process that keeps one core busy for at most ``seconds`` (stopped with ``procs``)."""
    return procs.start("load", sys.executable, "-c", BUSY_LOOP, str(seconds))


def run_behind_nginx(
    procs, api, nginx, calls: dict[str, int], *, dispensers: int = 2, workers: int = 1, concurrency: int = 4,
    queue: str | None = None, extra_env: dict[str, str] | None = None, pool: str = "prefork", busy_calls: int = 0,
    paced_worker: dict[str, Any] | None = None,
) -> dict[str, dict[str, float]]:
    """Send ``calls[zone]`` http calls to each nginx zone; return per zone the 429s, the share of
    nginx's capacity used, the smallest gap at the API and the runs per call.

    ``busy_calls``: as many calls of 100 ms to the fake API go through the same workers at the
    same time, on a key of their own limited to ``BUSY_RATE`` a second (under ``-P threads`` they
    keep the worker's GIL busy, as a real site's other calls do; the limit keeps the broker's
    queue short, so the paced calls do not wait behind them).

    ``paced_worker`` (its ``concurrency`` and ``pool``): the paced calls go to a queue of their own,
    served by a worker of their own (one more, on the same machine), as a site routes a paced
    key away from its other calls; the workers above serve the other calls."""
    from dispatcher.models import CallQueue

    if busy_calls:
        edit.set_policy("busy", BUSY_RATE, timedelta(seconds=1))
        CallQueue.objects.send_many([
            {"method": "http", "params": {"method": "GET", "url": f"{api.url}/slow?delay=0.1"}, "keys": ["busy"]}
            for _ in range(busy_calls)
        ])
    for zone, n in calls.items():
        edit.set_policy(f"nginx:{zone}", nginx.rates[zone], timedelta(seconds=1), burst=1)
        CallQueue.objects.send_many([
            {
                "method": "http",
                "params": {"method": "GET", "url": f"{nginx.url}/{zone}/{i}", "headers": {"x-call": f"{zone}-{i}"}},
                "keys": [f"nginx:{zone}"],
            } | ({"queue": f"{queue or procs.queue}-paced"} if paced_worker is not None else {})
            for i in range(n)
        ])
    for _ in range(dispensers):
        procs.dispenser(extra_env=extra_env)
    # The worker comes late: the first claims wait in the broker, and every start re-checks.
    time.sleep(2)
    for _ in range(workers):
        procs.worker(queue or procs.queue, concurrency=concurrency, extra_env=extra_env, pool=pool)
    if paced_worker is not None:
        procs.worker(f"{queue or procs.queue}-paced", extra_env=extra_env, **paced_worker)
    longest = max(n / nginx.rates[zone] for zone, n in calls.items())
    done = wait_until(
        lambda: not CallQueue.objects.exclude(status__in=CallQueue.FINISHED).exists(), timeout=longest * 3 + 60, interval=0.5
    )
    if not done:
        raise RuntimeError(f"the backlog did not finish within {longest * 3 + 60:.0f} s:\n" + procs.logs())
    statuses = Counter(CallQueue.objects.values_list("status", flat=True))
    if statuses != {"done": sum(calls.values()) + busy_calls}:
        raise RuntimeError(f"not every call is done: {dict(statuses)}")
    logged = nginx.logged()
    figures = {}
    for zone, n in calls.items():
        served = sorted(a.at for a in api.arrivals if a.path.startswith(f"/{zone}/"))
        runs = Counter(a.call for a in api.arrivals if a.path.startswith(f"/{zone}/") and a.status == 200)
        interval = 1 / nginx.rates[zone]
        span = served[-1] - served[0]
        gaps = [b - a for a, b in zip(served, served[1:], strict=False)]
        figures[zone] = {
            "rate": nginx.rates[zone],
            "calls": n,
            "refused": sum(1 for r in logged if r.path.startswith(f"/{zone}/") and r.status == 429),
            "used": (len(served) - 1) * interval / span if span > 0 else 0.0,
            "min_gap_ms": min(gaps) * 1000 if gaps else 0.0,
            # Where the rest of the capacity goes: the gaps' spread (the guard sets only the least).
            "gap_p50_ms": sorted(gaps)[len(gaps) // 2] * 1000 if gaps else 0.0,
            "gap_p90_ms": sorted(gaps)[len(gaps) * 9 // 10] * 1000 if gaps else 0.0,
            "runs_per_call": max(runs.values(), default=0),
            "lost": n - len(runs),
        }
    print("\n" + "\n".join(
        f"nginx {f['rate']}r/s: {f['calls']} calls, 429s {f['refused']}, used {f['used']:.1%} of nginx's capacity,"
        f" gaps at the API: smallest {f['min_gap_ms']:.1f} ms, p50 {f['gap_p50_ms']:.1f} ms, p90 {f['gap_p90_ms']:.1f} ms"
        for f in figures.values()
    ), flush=True)
    return figures
