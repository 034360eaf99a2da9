"""What every benchmark needs: the database, broker queues, backlogs, processes and results."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


def tables() -> str:
    """Every table of the dispatcher's models, comma-separated: what one benchmark leaves (calls,
    policies, key states, and what processes learnt from an API's answers) must not reach the next."""
    from django.apps import apps

    return ", ".join(sorted(model._meta.db_table for model in apps.get_app_config("dispatcher").get_models()))


@dataclass
class Figure:
    """One row of the table: a measured figure next to its target and a baseline of the same run."""

    name: str
    measured: str
    target: str
    baseline: str
    passed: bool | None
    data: dict[str, Any] = field(default_factory=dict)


class CheckFailed(AssertionError):
    """A correctness check inside a benchmark failed: calls lost, a window over its limit."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def recreate_database(url: str) -> None:
    """Drop and create the benchmark's own database (its name must start with ``bench``)."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    if not name.startswith("bench"):
        raise SystemExit(f"refusing to recreate database {name!r}: a benchmark database name starts with 'bench'")
    with psycopg.connect(_admin_url(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def drop_database(url: str) -> None:
    import psycopg

    name = urlsplit(url).path.lstrip("/")
    if name.startswith("bench"):
        with psycopg.connect(_admin_url(url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _admin_url(url: str) -> str:
    parts = urlsplit(url)
    scheme = "postgresql" if parts.scheme.startswith("postgres") else parts.scheme
    # The query holds Django's OPTIONS (``?prepare_threshold=5``), which libpq does not take.
    return parts._replace(scheme=scheme, path="/postgres", query="").geturl()


def reset_tables() -> None:
    """Empty the dispatcher's tables between benchmarks."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(f"TRUNCATE {tables()} RESTART IDENTITY")
        cursor.execute(f"ANALYZE {tables()}")


def backlog(n: int, *, method: str = "bench.noop", keys: list[str] | None = None, chunk: int = 5000) -> None:
    """Store ``n`` waiting calls with send_many, spread round-robin over ``keys``."""
    from dispatcher.models import CallQueue

    for start in range(0, n, chunk):
        specs = []
        for i in range(start, min(n, start + chunk)):
            spec: dict[str, Any] = {"method": method}
            if keys:
                spec["keys"] = [keys[i % len(keys)]]
            specs.append(spec)
        CallQueue.objects.send_many(specs)


def count_status(status: str) -> int:
    from dispatcher.models import CallQueue

    return CallQueue.objects.filter(status=status).count()


class Broker:
    """A queue on the benchmark's broker: its length, purge and deletion."""

    def __init__(self, app, queue: str) -> None:
        self.app = app
        self.queue = queue

    def length(self) -> int:
        with self.app.connection_for_write() as conn:
            try:
                return conn.default_channel.queue_declare(queue=self.queue, passive=True).message_count
            except Exception:
                return 0

    def calls(self) -> int:
        """Take every message off the queue; return how many calls they carry (a
        ``dispatcher.run_calls`` message carries several)."""
        carried = 0
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            for _ in range(self.length()):
                message = channel.basic_get(self.queue, no_ack=True)
                if message is None:
                    break
                args = message.decode()[0]
                carried += len(args[0]) if message.headers.get("task") == "dispatcher.run_calls" else 1
        return carried

    def wait_length(self, expected: int, timeout: float = 15) -> int:
        """Wait (bounded) for the broker to show ``expected`` messages; return what it shows."""
        deadline = time.monotonic() + timeout
        seen = self.length()
        while seen < expected and time.monotonic() < deadline:
            time.sleep(0.1)
            seen = self.length()
        return seen

    def purge(self) -> None:
        self._on_queue("queue_purge")

    def delete(self) -> None:
        self._on_queue("queue_delete")

    def _on_queue(self, operation: str) -> None:
        """Purge or delete the queue, if the broker has it."""
        with self.app.connection_for_write() as conn:
            try:
                getattr(conn.default_channel, operation)(self.queue)
            except Exception:
                pass


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """Return a process's resident set size in MB (Linux); ``field="VmHWM"``: its peak so far."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def machine() -> dict[str, Any]:
    """Describe the machine the figures were taken on."""
    import platform

    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(), "system": platform.platform()}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as meminfo:
            info["memory_gb"] = round(int(meminfo.readline().split()[1]) / 1024 / 1024, 1)
        info["load_before"] = os.getloadavg()
    except OSError:
        pass
    return info


def server_versions(redis_url: str) -> dict[str, str]:
    """Return the versions of the PostgreSQL and Redis servers the figures were taken against."""
    import redis
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        versions = {"postgresql": cursor.fetchone()[0]}
    client = redis.Redis.from_url(redis_url)
    try:
        versions["redis"] = client.info("server")["redis_version"]
    finally:
        client.close()
    return versions


def print_rows(rows: list[tuple[str, str]]) -> None:
    """Print a stand-alone benchmark's rows as ``name | figure``, the names aligned."""
    width = max(len(name) for name, _ in rows)
    for name, figure in rows:
        print(f"{name.ljust(width)} | {figure}")


@contextlib.contextmanager
def migrated_database(url: str) -> Iterator[None]:
    """A new database for a stand-alone benchmark (``python -m bench.dedup``...): created, Django
    set up on it and migrated; its connections closed and the database dropped after the block."""
    recreate_database(url)
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        try:
            yield
        finally:
            connections.close_all()
    finally:
        drop_database(url)
