"""``python -m bench [--quick|--full] [--only NAME ...]``: run the benchmarks, print the table, write JSON.

Runs against its own PostgreSQL database (``BENCH_DATABASE_URL``, created and dropped here; the
name must start with ``bench``), Redis (``BENCH_REDIS_URL``) and, if reachable, RabbitMQ
(``BENCH_AMQP_URL``). Exit status 1 when a correctness check fails (a call lost, a window over
its limit); a figure that misses its target is reported in the table, not as a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
import uuid
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _print_table(rows) -> None:
    header = ("figure", "measured", "target", "baseline", "pass")
    cells = [header] + [
        (r.name, r.measured, r.target, r.baseline, {True: "yes", False: "NO", None: "-"}[r.passed]) for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = [" | ".join(c[i].ljust(widths[i]) for i in range(len(header))) for c in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    print("\n".join(lines), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small sizes, for CI (the default)")
    mode.add_argument("--full", action="store_true", help="the sizes of the targets")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    parser.add_argument("--keep-db", action="store_true", help="leave the benchmark database in place")
    args = parser.parse_args(argv)
    from support.processes import install_stop_signals

    # A run stopped by SIGTERM (e.g. `timeout`) unwinds as Ctrl-C does: each benchmark stops the
    # workers and dispensers it started, and the database is dropped. Left running, they would
    # join the next run, whose database has the same name.
    restore = install_stop_signals()
    try:
        return _run(parser, args)
    finally:
        restore()


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    db_url = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_dispatcher")
    redis_url = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
    amqp_url = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//") or None
    os.environ.update(
        DATABASE_URL=db_url,
        DJANGO_SETTINGS_MODULE="bench.settings",
        CELERY_BROKER_URL=redis_url,
        BENCH_REDIS_URL=redis_url,
        CELERY_TASK_DEFAULT_QUEUE=f"bench-{uuid.uuid4().hex[:8]}",
        DISPATCHER_LOG_LEVEL="WARNING",
    )
    from bench import support

    support.recreate_database(db_url)
    import django

    django.setup()
    from django.core.management import call_command

    from bench.figures import ALL, EXPERIMENTS, FULL, QUICK, Context

    call_command("migrate", verbosity=0)
    names = args.only or list(ALL)
    runnable = {**ALL, **EXPERIMENTS}
    unknown = set(names) - set(runnable)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}; choose from {', '.join(runnable)}")
    mode_name = "full" if args.full else "quick"
    import dispatcher

    # A `make bench-installed` run measures the installed package, not this repository's copy.
    machine = {
        **support.machine(), **support.server_versions(redis_url),
        "dispatcher": "installed package" if "site-packages" in dispatcher.__file__ else "source tree",
    }
    print(f"dispatcher from the {machine['dispatcher']}", flush=True)
    rows: list[support.Figure] = []
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as log_dir:
        ctx = Context(FULL if args.full else QUICK, redis_url, amqp_url, Path(log_dir))
        try:
            for name in names:
                started = time.monotonic()
                print(f"running {name} ...", flush=True)
                try:
                    got = runnable[name](ctx)
                except support.CheckFailed as exc:
                    failures.append(f"{name}: {exc}")
                    got = [support.Figure(name, "CHECK FAILED", "", "", False, {"error": str(exc)})]
                except Exception as exc:
                    traceback.print_exc()
                    failures.append(f"{name}: {exc!r}")
                    got = [support.Figure(name, f"ERROR {type(exc).__name__}", "", "", False, {"error": repr(exc)})]
                for row in got:
                    row.data["benchmark_seconds"] = round(time.monotonic() - started, 1)
                rows.extend(got)
        finally:
            ctx.broker.purge()
            ctx.broker.delete()
            from django.db import connections

            connections.close_all()
            if not args.keep_db:
                support.drop_database(db_url)
    print()
    _print_table(rows)
    machine["load_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{mode_name}-{stamp}.json"
    path.write_text(json.dumps(
        {"mode": mode_name, "at": stamp, "machine": machine, "failures": failures,
         "figures": [vars(r) for r in rows]},
        indent=2, default=str,
    ))
    print(f"\nresults: {path}")
    if failures:
        print("CORRECTNESS CHECKS FAILED:\n  " + "\n  ".join(failures))
        return 1
    return 0
