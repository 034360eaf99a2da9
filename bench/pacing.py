"""Send-time pacing, held at the API on a loaded machine (issue 28, item 1).

Smooth rates of 5 and 20 per second behind a real nginx ``limit_req`` without burst, and the
window, bucket and unit-budget partners of ``support.arrivals``, each with its calls sent through
several dispensers and workers that start late, at default settings, while a busy loop keeps
one core of the machine busy. Targets: 0 x 429, >= 95% of nginx's capacity, >= 97% of each
shaped partner's allowance.
"""
from __future__ import annotations

import os
import time
from typing import Any

from bench.support import Figure, check, reset_tables

RATES = {"r5": 5, "r20": 20}
# Seconds of sending per rate: the calls are the rate times this.
SECONDS = {"quick": 8, "full": 20}
# The workers behind nginx: the scenario's own, and a big thread pool that also runs a steady
# stream of 100 ms calls of another key (support.paced.BUSY_RATE a second; per second of sending).
WORKERS: dict[str, tuple[str, dict[str, Any]]] = {
    "prefork": ("1 late worker", {}),
    "threads": ("1 late -P threads -c 32 worker running 100 ms calls of another key", {
        "pool": "threads", "concurrency": 32, "busy_calls": 200,
    }),
    # The same thread pool and other calls, the paced calls routed to a queue and a `-c 4` prefork
    # worker of their own: what is left when they no longer wait behind the other calls.
    "routed": ("the same -P threads -c 32 worker for the other key, the paced calls on a queue and worker of their own", {
        "pool": "threads", "concurrency": 32, "busy_calls": 200, "paced_worker": {"concurrency": 4, "pool": "prefork"},
    }),
    # What the configured guard costs a smooth rate: the first row with it off, as for an API on
    # the same host (the network adds no spread the workers do not measure). Not the default.
    "guard0": ("1 late worker, DISPATCHER_ARRIVAL_GUARD=0", {"settings": {"DISPATCHER_ARRIVAL_GUARD": "0"}}),
}
# BENCH_PACING_ROWS: the rows to run, by the names above and "shapes" (comma-separated; default all).
ROWS = (*WORKERS, "shapes")
SHAPE_LABELS = {
    "window": "sliding window 10 per 2 s",
    "bucket": "token bucket 5/s, burst 10",
    "smooth": "smooth rate 2/s (burst 1)",
    "units": "unit budget 30 per 2 s, costs 1-3",
}

# What each shape must use of its allowance (97% unless named): a smooth rate 95%, as issue 28
# asks of smooth rates behind nginx. Its held guard costs it 2% by design (HELD_RATE_SHARE), so
# that with late requests' moves it loses under 5% (docs/policies.md, send-time pacing).
SHAPE_TARGETS = {"smooth": 0.95}


def _http_env() -> dict[str, str]:
    from bench.figures import _http_env as env

    return env()


def _nginx_run(ctx: Any, seconds: int, extra: dict[str, str], **workers: Any) -> dict[str, dict[str, float]]:
    from support.fakeapi import FakeAPI
    from support.nginx import Nginx
    from support.paced import load, run_behind_nginx

    reset_tables()
    api = FakeAPI().start()
    nginx = Nginx(api.url, RATES).start()
    procs = ctx.processes(**_http_env(), **extra)
    try:
        load(procs, seconds * 3 + 90)
        return run_behind_nginx(
            procs, api, nginx, {zone: rate * seconds for zone, rate in RATES.items()}, queue=ctx.queue, extra_env=extra,
            **workers,
        )
    finally:
        procs.stop_all()
        nginx.stop()
        api.stop()


def _shapes_run(ctx: Any, extra: dict[str, str]) -> dict[str, dict[str, float]]:
    from support.arrivals import run_shapes
    from support.fakeapi import FakeAPI
    from support.paced import load

    reset_tables()
    api = FakeAPI().start()
    procs = ctx.processes(**_http_env(), **extra)
    try:
        load(procs, 180)
        return run_shapes(procs, api, extra, queue=ctx.queue)
    finally:
        procs.stop_all()
        api.stop()


def paced_at_the_api(ctx: Any) -> list[Figure]:
    """The rows: each rate and shape, on a machine with one core kept busy."""
    from bench.figures import FULL
    from support import nginx

    mode = "full" if ctx.sizes == FULL else "quick"
    rows: list[Figure] = []
    load_before = os.getloadavg()[0]
    if not nginx.available():
        rows.append(Figure("paced behind nginx", "skipped: no nginx (make bench-deps)", "", "", None))
    chosen = [row.strip() for row in os.environ.get("BENCH_PACING_ROWS", ",".join(ROWS)).split(",") if row.strip()]
    unknown = set(chosen) - set(ROWS)
    if unknown:
        raise ValueError(f"BENCH_PACING_ROWS: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
    for workers, setup in (WORKERS[row] for row in chosen if row in WORKERS and nginx.available()):
        started = time.monotonic()
        setup = dict(setup)
        settings = setup.pop("settings", {})
        busy = setup.get("busy_calls", 0) * SECONDS[mode]
        found = _nginx_run(ctx, SECONDS[mode], settings, **{**setup, "busy_calls": busy})
        for zone, f in found.items():
            check(f["lost"] == 0 and f["runs_per_call"] == 1, f"nginx {zone}: {f['lost']} calls lost, runs per call {f['runs_per_call']}")
            rows.append(Figure(
                f"paced: smooth {f['rate']}/s behind nginx limit_req (2 dispensers, {workers}, busy machine)",
                f"{f['used']:.1%} of nginx's capacity, {f['refused']} 429s ({f['calls']} calls)",
                ">= 95%, 0 429s",
                f"load {load_before:.1f}; gaps at the API: smallest {f['min_gap_ms']:.1f} ms,"
                f" p50 {f['gap_p50_ms']:.1f} ms, p90 {f['gap_p90_ms']:.1f} ms",
                f["used"] >= 0.95 and f["refused"] == 0,
                {**f, "load_before": load_before, "seconds": time.monotonic() - started},
            ))
    shapes = _shapes_run(ctx, {}) if "shapes" in chosen else {}
    for name, f in shapes.items():
        target = SHAPE_TARGETS.get(name, 0.97)
        rows.append(Figure(
            f"paced: {SHAPE_LABELS[name]} (3 dispensers, 2 late workers, busy machine)",
            f"{f['used']:.1%} used, {f['refused']} 429s",
            f">= {target:.0%}, 0 429s",
            f"load {load_before:.1f}; start->arrival p50 {f['p50_ms']:.0f} ms",
            f["used"] >= target and f["refused"] == 0,
            {**f, "load_before": load_before},
        ))
    return rows


# The bound: a single process holding its requests exactly `interval + guard` apart (sleeping to
# each moment on its own clock, one kept-alive connection), with no database, broker or worker
# in the way, against the same nginx zone of 20 per second on the same loaded machine. What it
# needs to meet no 429 is what nginx's own stamping (its process scheduled late on a busy host)
# asks of any pacer; its use at that guard is the most any pacer gets there.
PACER_GUARDS_MS = (0, 1, 2, 3, 5, 8)
PACER_REQUESTS = 200


def paced_bound(ctx: Any) -> list[Figure]:
    """The rows: per guard, the 429s a near-perfect pacer meets at 20 per second behind nginx."""
    import httpx

    from support import nginx
    from support.fakeapi import FakeAPI
    from support.nginx import Nginx
    from support.paced import load

    if not nginx.available():
        return [Figure("pacer bound behind nginx", "skipped: no nginx (make bench-deps)", "", "", None)]
    api = FakeAPI().start()
    server = Nginx(api.url, {"r20": 20}).start()
    procs = ctx.processes()
    rows: list[Figure] = []
    # BENCH_PACER_LOAD: how many cores busy loops keep busy meanwhile (1, as the pacing rows; 2:
    # the whole machine, as when the pacing rows' own workers, database and dispensers run too).
    loops = int(os.environ.get("BENCH_PACER_LOAD", "1"))
    try:
        for _ in range(loops):
            load(procs, 30 + len(PACER_GUARDS_MS) * PACER_REQUESTS * 0.06)
        with httpx.Client(timeout=5) as client:
            for guard_ms in PACER_GUARDS_MS:
                time.sleep(1.2)  # nginx's zone forgets the requests before
                spacing = 1 / 20 + guard_ms / 1000
                start = time.monotonic() + 0.1
                codes, late = [], []
                for i in range(PACER_REQUESTS):
                    moment = start + i * spacing
                    wait = moment - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    late.append((time.monotonic() - moment) * 1000)
                    codes.append(client.get(f"{server.url}/r20/{guard_ms}-{i}").status_code)
                late.sort()
                refused = codes.count(429)
                rows.append(Figure(
                    f"pacer bound: requests {guard_ms} ms over 50 ms apart, one process, behind nginx 20/s"
                    f" ({loops} core{'s' if loops > 1 else ''} kept busy)",
                    f"{refused} 429s ({PACER_REQUESTS} requests), at most {50 / (50 + guard_ms):.1%} of nginx's capacity",
                    "-",
                    f"the pacer's own lateness: p50 {late[len(late) // 2]:.2f} ms, p99 {late[int(len(late) * 0.99)]:.2f} ms,"
                    f" max {late[-1]:.2f} ms",
                    None,
                    {"guard_ms": guard_ms, "refused": refused, "late_p99_ms": late[int(len(late) * 0.99)]},
                ))
    finally:
        procs.stop_all()
        server.stop()
        api.stop()
    return rows
