"""``python -m bench.failures``: the failures view and a bulk retry's confirmation with 100,000 calls over
300 keys (a fifth failed, a tenth waiting for a retry, errors of eight classes), on PostgreSQL.

Runs on its own database (``BENCH_DATABASE_URL``, default
``postgres://postgres@127.0.0.1:5432/bench_failures``; the name must start with ``bench``), created
and dropped here. Pages are served in-process by Django's test client as a logged-in superuser, so
the figure is the server's time (queries, templates), not the network's. Pages alternate in rounds
(failures, calls list, confirmation, ...) so a drift of the machine touches all alike; the figure
is the median round, with the fastest and slowest beside it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

TARGET_MS = 500.0
ERRORS = [
    "dispatcher.handlers.RetryableHTTPError: HTTP 503: upstream down",
    "dispatcher.handlers.RetryableHTTPError: HTTP 502: bad gateway",
    "dispatcher.exceptions.PermanentError: HTTP 404: no such item",
    "dispatcher.handlers.RetryableHTTPError: http: api.example.com: connection refused",
    "dispatcher.handlers.RetryableHTTPError: http: api.example.com: timeout (no complete answer within 30s)",
    "dispatcher.handlers.RetryableHTTPError: http: no usable answer from api.example.com:8443 within 30s",
    "ValueError: bad payload",
    "lost: no result within DISPATCHER_RUN_TIMEOUT (15m)",
]


def _fill(calls: int, keys: int) -> None:
    """Store the calls in batches, then mark a fifth failed and a tenth waiting for a retry, in SQL."""
    from django.db import connection

    from dispatcher.models import CallQueue

    batch = 10_000
    for start in range(0, calls, batch):
        CallQueue.objects.send_many([
            {"method": "http", "params": {"method": "GET", "url": f"http://127.0.0.1:9/v1/items/{i}"}, "keys": [f"key-{i % keys:03}"]}
            for i in range(start, min(start + batch, calls))
        ])
    with connection.cursor() as cursor:
        for n, error in enumerate(ERRORS):
            # Calls whose id mod 10 is 0 or 1 fail; mod 10 == 2 wait for a retry; the error by id mod 80.
            cursor.execute(
                "UPDATE dispatcher_call SET status = 'failed', attempts = 3, last_error = %s, finished_at = now()"
                " WHERE id %% 10 IN (0, 1) AND (id / 10) %% %s = %s",
                [error, len(ERRORS), n],
            )
            cursor.execute(
                "UPDATE dispatcher_call SET attempts = 1, last_error = %s, started_at = now(), run_at = now() + interval '1 hour'"
                " WHERE id %% 10 = 2 AND (id / 10) %% %s = %s",
                [error, len(ERRORS), n],
            )
        cursor.execute("ANALYZE dispatcher_call")


def _measure(rounds: int) -> list[tuple[str, str]]:
    from django.contrib.auth.models import User
    from django.test import Client

    from dispatcher import failures

    client = Client()
    client.force_login(User.objects.create_superuser("bench", "bench@example.com", "bench-pw"))
    group = failures.groups().groups[0]
    confirm = ("/admin/dispatcher/callqueue/failures/group/",
               {"key_set": group.key_set, "state": group.state, "class": group.error_class, "do": "retry"})
    pages = {
        "failures view, page 1": ("/admin/dispatcher/callqueue/failures/", {}),
        "failures view, one key": ("/admin/dispatcher/callqueue/failures/", {"key": "key-150"}),
        "failures view, page 5": ("/admin/dispatcher/callqueue/failures/", {"p": "5"}),
        "a group's retry confirmation": confirm,
        "calls list, failed": ("/admin/dispatcher/callqueue/", {"state": "failed"}),
    }
    times: dict[str, list[float]] = {name: [] for name in pages}
    for name, (url, query) in pages.items():  # warm: templates compiled, connections open
        assert client.get(url, query).status_code == 200, name
    for _ in range(rounds):
        for name, (url, query) in pages.items():
            began = time.perf_counter()
            response = client.get(url, query)
            times[name].append((time.perf_counter() - began) * 1000)
            assert response.status_code == 200, name
    return [
        (name, f"median {statistics.median(t):.0f} ms (min {min(t):.0f}, max {max(t):.0f}; target <= {TARGET_MS:.0f} ms)")
        for name, t in times.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.failures", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=300)
    args = parser.parse_args(argv)
    db_url = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_failures")
    os.environ.update(DATABASE_URL=db_url, DJANGO_SETTINGS_MODULE="bench.settings", DISPATCHER_LOG_LEVEL="WARNING")
    os.environ.setdefault("DISPATCHER_HTTP_ALLOWED_HOSTS", "127.0.0.1:*")
    from bench import support

    with support.migrated_database(db_url):
        from django.conf import settings

        settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
        # Pages link their static files by name: no collectstatic manifest is needed for timing them.
        settings.STORAGES = {**settings.STORAGES, "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}
        began = time.perf_counter()
        _fill(args.calls, args.keys)
        print(f"stored {args.calls:,} calls over {args.keys} keys in {time.perf_counter() - began:.1f} s")
        rows = _measure(args.rounds)
    support.print_rows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
