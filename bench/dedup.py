"""``python -m bench.dedup``: send() with a unique key against without, and send_many of 20,000 calls with
10% duplicates, on PostgreSQL.

Runs on its own database (``BENCH_DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432/bench_dedup``;
the name must start with ``bench``), created and dropped here. Needs no broker: nothing is dispatched.
Sends alternate in rounds (plain, keyed, plain, ...) so a drift of the machine touches both alike; the
figure is the median round.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

TARGET = 0.9  # keyed sends per second over plain sends per second


def _rate(n: int, fn: Callable[[int], object]) -> float:
    began = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - began)


def _truncate() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE dispatcher_attempt, dispatcher_call RESTART IDENTITY")


def _measure(rounds: int, per_round: int, batch: int) -> list[tuple[str, str]]:
    from dispatcher.models import CallQueue

    send = CallQueue.objects.send
    plain, keyed, dup = [], [], []
    for r in range(rounds):
        plain.append(_rate(per_round, lambda i: send("bench.noop", {"i": i}, keys=["k"])))
        _truncate()  # each kind starts on an empty table
        keyed.append(_rate(per_round, lambda i, r=r: send("bench.noop", {"i": i}, keys=["k"], unique_key=f"u-{r}-{i}")))
        # Every one a duplicate of a key held by a waiting call: nothing stored, the holder returned.
        dup.append(_rate(per_round, lambda i, r=r: send("bench.noop", {"i": i}, keys=["k"], unique_key=f"u-{r}-{i}")))
        _truncate()
    p, k, d = (statistics.median(x) for x in (plain, keyed, dup))
    rows = [
        ("send(), no unique key", f"{p:,.0f}/s"),
        ("send(), a fresh unique key", f"{k:,.0f}/s = {k / p:.2f}x (target >= {TARGET}x)"),
        ("send(), a duplicate (holder returned)", f"{d:,.0f}/s = {d / p:.2f}x"),
    ]

    rng = random.Random(29)
    distinct = batch - batch // 10
    specs = [{"method": "bench.noop", "params": {"i": i}, "keys": ["k"], "unique_key": f"m-{i}"} for i in range(distinct)]
    specs += [{**specs[rng.randrange(distinct)], "params": {"dup": i}} for i in range(batch // 10)]
    rng.shuffle(specs)
    bare = [{key: value for key, value in spec.items() if key != "unique_key"} for spec in specs]
    times: dict[str, list[float]] = {"plain": [], "in batch": [], "held": []}
    for _ in range(rounds):
        began = time.perf_counter()
        CallQueue.objects.send_many(bare)
        times["plain"].append(time.perf_counter() - began)
        _truncate()
        began = time.perf_counter()
        stored = CallQueue.objects.send_many(specs)
        times["in batch"].append(time.perf_counter() - began)
        assert len(stored) == batch and sum(c.created for c in stored) == distinct, "duplicates stored"
        # 10% of the keys already held by waiting calls (from a batch before), the rest fresh.
        _truncate()
        CallQueue.objects.send_many(specs[: batch // 10])
        held = [{**spec, "unique_key": "h" + spec["unique_key"]} for spec in specs[batch // 10:]] + specs[: batch // 10]
        began = time.perf_counter()
        CallQueue.objects.send_many(held)
        times["held"].append(time.perf_counter() - began)
        _truncate()
    t = {name: statistics.median(values) for name, values in times.items()}
    rows += [
        (f"send_many({batch:,}), no unique key", f"{t['plain']:.2f}s ({batch / t['plain']:,.0f}/s)"),
        (f"send_many({batch:,}), 10% duplicates inside the batch",
         f"{t['in batch']:.2f}s ({batch / t['in batch']:,.0f}/s) = {t['plain'] / t['in batch']:.2f}x"),
        (f"send_many({batch:,}), 10% keys held by waiting calls",
         f"{t['held']:.2f}s ({batch / t['held']:,.0f}/s) = {t['plain'] / t['held']:.2f}x"),
    ]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dedup", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=1000, help="sends per round and kind")
    parser.add_argument("--batch", type=int, default=20_000, help="calls per send_many")
    args = parser.parse_args(argv)
    db_url = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_dedup")
    os.environ.update(DATABASE_URL=db_url, DJANGO_SETTINGS_MODULE="bench.settings", DISPATCHER_LOG_LEVEL="WARNING")
    from bench import support

    support.recreate_database(db_url)
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        try:
            rows = _measure(args.rounds, args.per_round, args.batch)
        finally:
            connections.close_all()
    finally:
        support.drop_database(db_url)
    width = max(len(name) for name, _ in rows)
    for name, figure in rows:
        print(f"{name.ljust(width)} | {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
