"""The operator's pages with a day of history (issue 27): 100,000 calls over 300 keys, each page
timed through Django's test client with DEBUG off (the project's settings, the test client's WSGI
request, a logged-in superuser; the static files' manifest replaced by plain storage, a dict
lookup either way).

The calls are bulk inserted (``bulk_create``, not ``send``: a day of traffic in seconds) as the
dispatcher stores them: 300 keys, ten of them a shared key and its nine tenants, the rest tenants
under a pattern policy; every state, a third of the finished calls in the last hour, an attempt
per call that ran, a start logged per attempt of the last two hours (the windows read those), a
paused key; then VACUUM ANALYZE, as autovacuum would have run on a day-old table. ``PAGES`` lists what is timed: a name and the path, given the ids seeded.
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench.support import Figure, check, reset_tables, tables
from dispatcher.limits import edit

TARGET_MS = 500
REQUESTS = 7
TENANTS, SHARED = 290, 9
BATCH = 5_000
ERRORS = (
    "ConnectError: name resolution failed for api.example.com",
    "ConnectError: connection refused by api.example.com",
    "ReadTimeout: no answer from api.example.com within 30s",
    "HTTPStatusError: 500 Internal Server Error from api.example.com",
    "ValueError: the answer is not JSON",
)


def _keys(i: int) -> list[str]:
    if i % 10 == 0:
        return ["mail", f"mail:t{i // 10 % SHARED}"]
    return [f"tenant:{(i - i // 10) % TENANTS:03d}"]  # counted over the calls not of mail: every tenant


def seed(calls: int, seed_value: int = 27) -> dict[str, Any]:
    """Store ``calls`` calls over 300 keys as a day of traffic would leave them; return ids to visit."""
    from django.db import connection

    from dispatcher.clock import db_now
    from dispatcher.keys import key_set
    from dispatcher.models import Attempt, CallQueue, KeyState, StartLog

    rng = random.Random(seed_value)
    edit.set_policy("tenant:*", 100, timedelta(minutes=1))
    edit.set_policy("tenant:*", 3_000, timedelta(hours=1))
    edit.set_policy("mail", 20, timedelta(minutes=1), concurrency=5)
    now = db_now()
    rows, plans = [], []
    for i in range(calls):
        keys = _keys(i)
        roll = rng.random()
        status = ("done" if roll < 0.70 else "failed" if roll < 0.75 else "cancelled" if roll < 0.77
                  else "running" if roll < 0.79 else "dispatched" if roll < 0.80 else "pending")
        created = now - timedelta(seconds=rng.uniform(0, 3 * 3600) if status != "cancelled" else rng.uniform(0, 86400))
        finished = min(created + timedelta(seconds=rng.uniform(0.1, 5)), now) if status in ("done", "failed", "cancelled") else None
        retry = status == "pending" and rng.random() < 0.2
        error = rng.choice(ERRORS) if status == "failed" or retry else ""
        rows.append(CallQueue(
            method="http", params={"url": f"https://api.example.com/v1/items/{i}", "method": "GET"}, keys=keys,
            key_set=key_set(keys), status=status, created_at=created, run_at=created, finished_at=finished,
            started_at=created if status in ("done", "failed", "running") else None,
            dispatched_at=created if status in ("dispatched", "running") else None,
            attempts=3 if status == "failed" else 1 if retry or status in ("done", "running") else 0,
            last_error=error, result={"status": 200} if status == "done" else None,
        ))
        plans.append((status, created, finished, error, retry))
    stored: list[Any] = []
    for start in range(0, len(rows), BATCH):
        stored += CallQueue.objects.bulk_create(rows[start:start + BATCH], batch_size=BATCH)
    attempts, starts = [], {}
    for call, (status, created, finished, error, retry) in zip(stored, plans, strict=True):
        if status in ("done", "failed", "running") or retry:
            outcome = {"done": "done", "failed": "failed", "running": "running"}.get(status, "error")
            attempts.append(Attempt(call=call, number=1, started_at=created, outcome=outcome, error=error,
                                    finished_at=finished or (None if status == "running" else created), worker="bench"))
            if created >= now - timedelta(hours=2):
                for key in call.keys:
                    starts.setdefault(key, []).append((created, call.id))
    Attempt.objects.bulk_create(attempts, batch_size=BATCH)
    logs, totals = [], {}
    for key, found in starts.items():
        for n, (moment, call_id) in enumerate(sorted(found), start=1):
            logs.append(StartLog(key=key, started_at=moment, units=1, cum=n, call_id=call_id))
        totals[key] = len(found)
    StartLog.objects.bulk_create(logs, batch_size=BATCH)
    KeyState.objects.bulk_create(
        [KeyState(key=key, total=total) for key, total in totals.items()], batch_size=BATCH,
        update_conflicts=True, unique_fields=["key"], update_fields=["total"],
    )
    edit.pause_key("tenant:007", timedelta(minutes=30), reason="partner maintenance")
    # What autovacuum does to a table a day old: statistics for the planner, the visibility map.
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {tables()}")
    failed = next(c for c, plan in zip(stored, plans, strict=True) if plan[0] == "failed")
    keys = {k for c in stored for k in c.keys}
    check(len(keys) == TENANTS + 1 + SHARED, f"{len(keys)} keys seeded, expected {TENANTS + 1 + SHARED}")
    return {"call": failed.id, "key": "tenant:042", "keys": len(keys), "attempts": len(attempts), "starts": len(logs)}


# Each page: its name and its path given the seeded ids. Add a page here to time it too.
PAGES: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("overview", lambda ids: "/dispatcher/dashboard/"),
    ("calls list", lambda ids: "/admin/dispatcher/callqueue/"),
    ("calls list, failed", lambda ids: "/admin/dispatcher/callqueue/?state=failed"),
    ("a call's page", lambda ids: f"/admin/dispatcher/callqueue/{ids['call']}/change/"),
    ("a key's page", lambda ids: f"/dispatcher/dashboard/key/{ids['key']}/"),
    ("failures view", lambda ids: "/admin/dispatcher/callqueue/failures/"),
]


def time_pages(ids: dict[str, Any], requests: int = REQUESTS) -> dict[str, list[float]]:
    """Request each page ``requests`` times in turn (interleaved: load hits every page alike); ms per request."""
    from django.conf import settings
    from django.contrib.auth.models import User
    from django.test import Client, override_settings

    check(not settings.DEBUG, "the pages are timed with DEBUG off")
    storages = {**settings.STORAGES, "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
    with override_settings(STORAGES=storages):
        client = Client(SERVER_NAME="localhost")
        client.force_login(User.objects.create_superuser("bench", "bench@example.com", "bench-pw"))
        paths = [(name, path(ids)) for name, path in PAGES]
        for name, path in paths:  # warm: templates, policies, the connection
            response = client.get(path)
            check(response.status_code == 200, f"{name} ({path}) answered {response.status_code}")
        timings: dict[str, list[float]] = {name: [] for name, _ in paths}
        for _ in range(requests):
            for name, path in paths:
                begin = time.perf_counter()
                response = client.get(path)
                timings[name].append((time.perf_counter() - begin) * 1000)
                check(response.status_code == 200, f"{name} answered {response.status_code}")
    return timings


def console(ctx: Any) -> list[Figure]:
    """Time the operator's pages over a day of stored calls (``ctx.sizes.console_calls``, 300 keys)."""
    reset_tables()
    begin = time.perf_counter()
    ids = seed(ctx.sizes.console_calls)
    seeded = time.perf_counter() - begin
    timings = time_pages(ids)
    reset_tables()
    calls = ctx.sizes.console_calls
    figures = []
    for name, values in timings.items():
        median, worst = statistics.median(values), max(values)
        figures.append(Figure(
            f"{name}, {calls:,} calls / {ids['keys']} keys",
            f"median {median:.0f} ms, max {worst:.0f} ms ({len(values)} requests)",
            f"<= {TARGET_MS} ms", f"seeded in {seeded:.0f} s", median <= TARGET_MS,
            {"median_ms": median, "max_ms": worst, "all_ms": values, **ids},
        ))
    return figures
