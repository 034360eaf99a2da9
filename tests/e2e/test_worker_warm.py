"""A worker's first start runs warm: each prefork child has run a start's statements before its first task."""
from __future__ import annotations

import psycopg
import pytest

from dispatcher.models import CallQueue
from dispatcher.store import functions
from support.processes import wait_until
from tests.calls import all_finished


def _mark_running() -> str:
    """The function that marks calls running (``store.functions.mark``, installed by the test
    database's migrate), whose call is the last statement ``calls.start.warm`` runs."""
    return functions.mark(True, "default").name


def _sessions(dsn: str) -> list[tuple[str, str]]:
    """Each client session on the test database but this one: its state and its last statement."""
    with psycopg.connect(dsn, autocommit=True) as db:
        return db.execute(
            "SELECT state, query FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchall()


@pytest.mark.postgres
@pytest.mark.slow
def test_each_prefork_child_has_run_a_start_before_its_first_task(procs):
    dsn = procs.env["DATABASE_URL"]
    procs.worker(procs.queue, concurrency=2)

    def warmed() -> list[tuple[str, str]]:
        return [row for row in _sessions(dsn) if _mark_running() in (row[1] or "")]

    assert wait_until(lambda: len(warmed()) >= 2, timeout=60), procs.logs()
    # Each child's session stays open and idle for its tasks (Celery's Django fixup closes a new
    # child's connections first: the warm-up runs after it).
    assert [state for state, _ in warmed()] == ["idle", "idle"]

    # And the warmed workers run calls as any do.
    procs.dispenser()
    sent = [CallQueue.objects.send("noop", {}, keys=["warm"]) for _ in range(4)]
    assert wait_until(lambda: all_finished([c.id for c in sent]), timeout=60), procs.logs()
    assert set(CallQueue.objects.filter(id__in=[c.id for c in sent]).values_list("status", flat=True)) == {"done"}


@pytest.mark.postgres
@pytest.mark.slow
def test_each_prefork_child_opens_its_delay_writers_connection_as_it_starts(procs):
    """A child's first late request would otherwise open it (a new database session's setup in
    the child as the request goes out, and its next requests behind it: docs/pools.md)."""
    dsn = procs.env["DATABASE_URL"]
    before = len(_sessions(dsn))
    procs.worker(procs.queue, concurrency=2)
    # Each child: its slot's session (warmed) and its writer's.
    assert wait_until(lambda: len(_sessions(dsn)) >= before + 4, timeout=30), (before, _sessions(dsn))
