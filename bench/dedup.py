"""``python -m bench.dedup``: send() with a unique key against without, and send_many of 20,000 calls with
10% duplicates, on PostgreSQL.

Runs on its own database (``BENCH_DATABASE_URL``, default ``postgres://postgres@127.0.0.1:5432/bench_dedup``;
the name must start with ``bench``), created and dropped here. Needs no broker: nothing is dispatched.

Single sends are measured where a view makes them: each send in its own transaction (``atomic``, as
with ``ATOMIC_REQUESTS``), then each send committing alone (autocommit). The kinds are interleaved in
blocks, each round ``plain, keyed, duplicate, duplicate, keyed, plain`` (a palindrome: a drift of the
shared machine touches every kind alike); a figure is the median over rounds of the kind's rate over
the plain rate of the same round, with the quartiles of those ratios. Beside the rates, the profile
of one send of each kind: the statements (round trips) it makes, and per send the server backend's
CPU time (its ``/proc/<pid>/schedstat``, when the server runs on this machine) and this process's CPU
time. The CPU figure (server and client CPU of a kind over the plain sends', per round) moves far less
with the machine's load than wall time, which a loaded machine fills with waits (a commit's flush
behind other sessions' WAL) that every kind pays alike.
"""
from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

TARGET = 0.9  # keyed sends per second over plain sends per second
KINDS = ("plain", "keyed", "duplicate")


@dataclass
class _Server:
    """The benchmark connection's backend: its CPU time, when readable."""

    pid: int
    readable: bool = field(init=False)

    def __post_init__(self) -> None:
        self.readable = self.cpu_ns() is not None

    def cpu_ns(self) -> int | None:
        try:
            with open(f"/proc/{self.pid}/schedstat") as stat:
                return int(stat.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None



@dataclass
class _Block:
    """One block of sends of one kind: per send, wall, client CPU and server CPU (µs)."""

    wall: float
    client: float
    server: float | None

    @property
    def cpu(self) -> float:
        return self.client + (self.server or 0)


def _one(sql: str, params: list[Any] | None = None) -> Any:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchone()[0]


def _truncate() -> None:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE dispatcher_attempt, dispatcher_call RESTART IDENTITY")


def _senders(tag: str, held: int) -> dict[str, Callable[[int], Any]]:
    """Return a send of each kind, the i-th with params and a key of its own; a duplicate sends the key of
    keyed's (i mod held)-th, which must be stored before."""
    from dispatcher.models import CallQueue

    send = CallQueue.objects.send

    def plain(i: int) -> Any:
        return send("bench.noop", {"i": i}, keys=["k"])

    def keyed(i: int) -> Any:
        return send("bench.noop", {"i": i}, keys=["k"], unique_key=f"{tag}-{i}")

    def duplicate(i: int) -> Any:
        # The key is held by the waiting call keyed(i) stored: nothing stored, the holder returned.
        return send("bench.noop", {"i": -i}, keys=["k"], unique_key=f"{tag}-{i % held}")

    return {"plain": plain, "keyed": keyed, "duplicate": duplicate}



def _statements(atomic: bool) -> dict[str, list[str]]:
    """Return the statements one send of each kind makes (each one round trip)."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    sends = _senders("profile", 1)
    out = {}
    for kind in KINDS:
        with CaptureQueriesContext(connection) as captured, transaction.atomic() if atomic else nullcontext():
            created = sends[kind](0).created
        assert created == (kind != "duplicate"), f"{kind}: created is {created}"
        out[kind] = [_statement(query["sql"]) for query in captured.captured_queries]
    return out


def _statement(sql: str) -> str:
    """Name a statement by its verb and table: ``INSERT dispatcher_call``, ``COMMIT``."""
    table = re.search(r'\b(?:INTO|FROM)\s+"?(\w+)', sql)
    return sql.split()[0] + (f" {table.group(1)}" if table else "")


def _block(server: _Server, send: Callable[[int], Any], start: int, n: int, atomic: bool) -> _Block:
    from django.db import transaction

    cpu0, client0, wall0 = server.cpu_ns(), time.thread_time_ns(), time.perf_counter_ns()
    if atomic:
        for i in range(start, start + n):
            with transaction.atomic():
                send(i)
    else:
        for i in range(start, start + n):
            send(i)
    wall1, client1, cpu1 = time.perf_counter_ns(), time.thread_time_ns(), server.cpu_ns()
    server_us = (cpu1 - cpu0) / n / 1000 if cpu0 is not None and cpu1 is not None else None
    return _Block((wall1 - wall0) / n / 1000, (client1 - client0) / n / 1000, server_us)


def _single_sends(server: _Server, rounds: int, block: int, atomic: bool) -> list[tuple[str, str]]:
    """Measure plain, keyed and duplicate sends interleaved; return the table's rows."""
    _truncate()
    blocks: dict[str, list[_Block]] = {kind: [] for kind in KINDS}
    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    cpu_ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    warm = _senders("warm", 100)
    for i in range(100):
        warm["plain"](i)
        warm["keyed"](i)
        warm["duplicate"](i)
    for r in range(rounds):
        sends = _senders(f"r{r}", block)
        got: dict[str, list[_Block]] = {kind: [] for kind in KINDS}
        for kind, first in (("plain", 0), ("keyed", 0), ("duplicate", 0), ("duplicate", block), ("keyed", block),
                            ("plain", block)):
            got[kind].append(_block(server, sends[kind], first, block, atomic))
        wall = {kind: sum(b.wall for b in got[kind]) for kind in KINDS}
        cpu = {kind: sum(b.cpu for b in got[kind]) for kind in KINDS}
        for kind in KINDS:
            blocks[kind] += got[kind]
            ratios[kind].append(wall["plain"] / wall[kind])
            cpu_ratios[kind].append(cpu["plain"] / cpu[kind])
    where = "in its own transaction" if atomic else "committing alone"
    rows = []
    for kind in KINDS:
        rate = 1e6 / statistics.median(b.wall for b in blocks[kind])
        figure = f"{rate:,.0f}/s"
        if kind != "plain":
            q, c = statistics.quantiles(ratios[kind], n=4), statistics.quantiles(cpu_ratios[kind], n=4)
            figure += (
                f" = {statistics.median(ratios[kind]):.2f}x (quartiles {q[0]:.2f}-{q[2]:.2f});"
                f" {'CPU' if server.readable else 'client CPU'} {statistics.median(cpu_ratios[kind]):.2f}x"
                f" (quartiles {c[0]:.2f}-{c[2]:.2f})"
            )
            if kind == "keyed":
                figure += f" (target >= {TARGET}x)"
        label = {"plain": "no unique key", "keyed": "a fresh unique key", "duplicate": "a duplicate (holder returned)"}
        rows.append((f"send() {where}, {label[kind]}", figure))
    profile = []
    for kind in KINDS:
        server_us = [b.server for b in blocks[kind] if b.server is not None]
        server_text = f"server CPU {statistics.median(server_us):.0f} µs" if server_us else "server CPU n/a"
        profile.append(
            f"{kind} {server_text}, client CPU {statistics.median(b.client for b in blocks[kind]):.0f} µs"
        )
    rows.append((f"  per send ({where}), medians", "; ".join(profile)))
    return rows


def _send_many(rounds: int, batch: int) -> list[tuple[str, str]]:
    from dispatcher.models import CallQueue

    rng = random.Random(29)
    distinct = batch - batch // 10
    specs = [{"method": "bench.noop", "params": {"i": i}, "keys": ["k"], "unique_key": f"m-{i}"} for i in range(distinct)]
    specs += [{**specs[rng.randrange(distinct)], "params": {"dup": i}} for i in range(batch // 10)]
    rng.shuffle(specs)
    bare = [{key: value for key, value in spec.items() if key != "unique_key"} for spec in specs]
    times: dict[str, list[float]] = {"plain": [], "in batch": [], "held": []}
    _truncate()
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
        stored = CallQueue.objects.send_many(held)
        times["held"].append(time.perf_counter() - began)
        fresh = len({spec["unique_key"] for spec in held[: batch - batch // 10]})
        assert sum(c.created for c in stored) == fresh, "a held key stored again"
        _truncate()
    t = {name: statistics.median(values) for name, values in times.items()}
    return [
        (f"send_many({batch:,}), no unique key", f"{t['plain']:.2f}s ({batch / t['plain']:,.0f}/s)"),
        (f"send_many({batch:,}), 10% duplicates inside the batch",
         f"{t['in batch']:.2f}s ({batch / t['in batch']:,.0f}/s) = {t['plain'] / t['in batch']:.2f}x"),
        (f"send_many({batch:,}), 10% keys held by waiting calls",
         f"{t['held']:.2f}s ({batch / t['held']:,.0f}/s) = {t['plain'] / t['held']:.2f}x"),
    ]


def _measure(rounds: int, block: int, batch: int, batch_rounds: int) -> list[tuple[str, str]]:
    server = _Server(int(_one("SELECT pg_backend_pid()")))
    rows = []
    for atomic in (True, False):
        _truncate()
        statements = _statements(atomic)
        rows.append((
            f"statements per send ({'in its own transaction' if atomic else 'committing alone'})",
            "; ".join(f"{kind}: {len(sql)} ({', '.join(sql)})" for kind, sql in statements.items()),
        ))
        rows += _single_sends(server, rounds, block, atomic)
    return rows + _send_many(batch_rounds, batch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dedup", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of single sends (each kind twice a round)")
    parser.add_argument("--block", type=int, default=200, help="sends per block")
    parser.add_argument("--batch", type=int, default=20_000, help="calls per send_many")
    parser.add_argument("--batch-rounds", type=int, default=5, help="rounds of send_many")
    args = parser.parse_args(argv)
    if min(args.rounds, args.block, args.batch, args.batch_rounds) < 1 or args.batch < 10:
        parser.error("--rounds, --block and --batch-rounds must be at least 1, --batch at least 10")
    db_url = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_dedup")
    os.environ.update(DATABASE_URL=db_url, DJANGO_SETTINGS_MODULE="bench.settings", DISPATCHER_LOG_LEVEL="WARNING")
    from bench import support

    with support.migrated_database(db_url):
        rows = _measure(args.rounds, args.block, args.batch, args.batch_rounds)
    support.print_rows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
