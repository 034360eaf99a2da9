"""The held-at-the-API scenario shared by tests/e2e/test_arrivals.py and the benchmark's arrival rows.

Fake partners on 127.0.0.1 enforce each policy shape on arrival (support.fakeapi); a backlog goes
to each through several dispensers and workers that start late; the figures say how many 429s
each partner answered and how much of its allowance each key used.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dispatcher.limits import edit
from support.fakeapi import Bucket, Smooth, Window
from support.processes import wait_until

# name: (what the partner enforces on arrival, our policy of the same numbers, calls, cost per call)
SHAPES: dict[str, tuple[Callable[[], Any], dict[str, Any], int, tuple[int, int] | None]] = {
    # The 10-per-2 s scenario: a sliding window.
    "window": (lambda: Window(10, 2.0), {"limit": 10, "period": timedelta(seconds=2)}, 40, None),
    # A token bucket with a burst (Shopify-like, scaled): 5 per second, 10 deep.
    "bucket": (lambda: Bucket(5.0, 10), {"limit": 5, "period": timedelta(seconds=1), "burst": 10}, 40, None),
    # nginx limit_req rate=2r/s without burst: any request closer than 500 ms is refused. (At 5r/s
    # a guard of 20 ms alone leaves 200/220 = 91%, and with a learnt delay of a few ms more less:
    # a smooth rate pays the whole guard on every request, see docs/policies.md.)
    "smooth": (lambda: Smooth(0.5), {"limit": 2, "period": timedelta(seconds=1), "burst": 1}, 20, None),
    # A unit budget fed by the cost each request carries: 30 units per 2 s.
    "units": (lambda: Window(30, 2.0), {"limit": 30, "period": timedelta(seconds=2)}, 40, (1, 3)),
}


def ideal_span(shape: str, arrivals: list[tuple[float, int]]) -> float:
    """Return the least time from the first to the last arrival the partner allows for these units.

    A bucket: a greedy client that finds it full spends its burst at once, then one interval per
    unit. A sliding window frees each unit one period after *that* unit arrived, so the spread of
    the first window's arrivals (workers starting late and cold) carries into every later window
    whatever the pacing: the greedy client starts from the same first window of arrivals and sends
    every later unit the moment the partner would admit it.
    """
    _, policy, _, _ = SHAPES[shape]
    units = [u for _, u in arrivals]
    rate = policy["limit"] / policy["period"].total_seconds()
    if "burst" in policy:
        return max(sum(units) - policy["burst"], 0) / rate
    limit, period = policy["limit"], policy["period"].total_seconds()
    ideal: list[tuple[float, int]] = []
    first_window = True
    for at, u in arrivals:
        first_window = first_window and sum(v for _, v in ideal) + u <= limit
        if first_window:
            ideal.append((at, u))  # the first window's arrivals, as they happened
            continue
        earliest, held = ideal[-1][0], u
        for t, v in reversed(ideal):
            held += v
            if held > limit:
                earliest = max(earliest, t + period)
                break
        ideal.append((earliest, u))
    return ideal[-1][0] - ideal[0][0]


def run_shapes(
    procs, fake_api, extra_env: dict[str, str] | None = None, method: str = "http", queue: str | None = None
) -> dict[str, dict[str, float]]:
    """Send a backlog to every shape's partner through 3 dispensers and 2 late workers; measure each."""
    from dispatcher.models import Attempt, CallQueue

    fake_api.shapes = {name: make() for name, (make, _, _, _) in SHAPES.items()}
    rng = random.Random(11)
    sent: dict[str, list[int]] = {}
    for name, (_, policy, n, costs) in SHAPES.items():
        edit.set_policy(f"api:{name}", **policy)
        sent[name] = [rng.randint(*costs) if costs else 1 for _ in range(n)]
        CallQueue.objects.send_many([
            {
                "method": method,
                "params": {"url": f"{fake_api.url}/{name}/{i}", "headers": {"x-call": f"{name}{i}", "x-cost": str(units)}}
                | ({"method": "GET"} if method == "http" else {}),
                "keys": [f"api:{name}"],
                "cost": units,
            }
            for i, units in enumerate(sent[name])
        ])
    for _ in range(3):
        procs.dispenser(extra_env=extra_env)
    # The workers come late: the first claims wait in the broker, and every start re-checks.
    time.sleep(2)
    for _ in range(2):
        procs.worker(queue or procs.queue, concurrency=4, extra_env=extra_env)
    done = wait_until(lambda: not CallQueue.objects.exclude(status__in=CallQueue.FINISHED).exists(), timeout=120, interval=0.5)
    if not done:
        raise RuntimeError("the backlog did not finish within 120 s:\n" + procs.logs())

    statuses = Counter(CallQueue.objects.values_list("status", flat=True))
    if statuses != {"done": sum(len(u) for u in sent.values())}:
        raise RuntimeError(f"not every call is done: {dict(statuses)}")
    # The start of each call's last attempt: the one whose request the partner answered.
    starts = {
        a.call.params["headers"]["x-call"]: a.started_at.timestamp()
        for a in Attempt.objects.select_related("call").order_by("id")
    }
    figures = {}
    for name in SHAPES:
        arrivals = sorted((a.at, a.units, a.call) for a in fake_api.answered if a.path.startswith(f"/{name}/"))
        delays = sorted(at - starts[call] for at, _, call in arrivals)
        figures[name] = {
            "refused": fake_api.refused.get(name, 0),
            "used": ideal_span(name, [(at, u) for at, u, _ in arrivals]) / (arrivals[-1][0] - arrivals[0][0]),
            "p50_ms": delays[len(delays) // 2] * 1000,
            "spread_ms": (delays[-1] - delays[0]) * 1000,
        }
    print("\n" + "\n".join(
        f"{name}: 429s {f['refused']}, used {f['used']:.1%} of the allowance, start-to-arrival"
        f" p50 {f['p50_ms']:.1f} ms, spread {f['spread_ms']:.1f} ms" for name, f in figures.items()
    ))
    return figures
