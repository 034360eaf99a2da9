"""A database filled under the last release's schema keeps its rows through this release's migrations."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from dispatcher.models import Attempt, CallQueue, KeyState, RateLimit, StartLog

# The last migration of the release before the engine's redesign.
LAST_RELEASE = [("dispatcher", "0009_send_delay")]

pytestmark = pytest.mark.django_db(transaction=True)


def _migrate(targets: list[tuple[str, str]]) -> MigrationExecutor:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor


def test_a_populated_database_of_the_last_release_migrates_with_its_rows():
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes("dispatcher")
    old = _migrate(LAST_RELEASE).loader.project_state(LAST_RELEASE).apps
    at = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    call = old.get_model("dispatcher", "CallQueue").objects.create(
        method="noop", params={"n": 1}, keys=["api"], key_set='["api"]', status="pending", run_at=at, created_at=at,
    )
    old.get_model("dispatcher", "Attempt").objects.create(call_id=call.id, number=1, started_at=at, outcome="error")
    old.get_model("dispatcher", "RateLimit").objects.create(key="api", limit=5, period=timedelta(seconds=1))
    old.get_model("dispatcher", "KeyState").objects.create(key="api", total=7)
    old.get_model("dispatcher", "KeyStart").objects.create(key="api", started_at=at, units=2, cum=7, call_id=call.id)

    _migrate(latest)

    stored = CallQueue.objects.get(id=call.id)
    assert (stored.method, stored.params, stored.status) == ("noop", {"n": 1}, CallQueue.Status.PENDING)
    assert stored.get_status_display() == "Waiting"
    assert Attempt.objects.get(call_id=call.id).outcome == "error"
    assert RateLimit.objects.get(key="api").limit == 5
    assert KeyState.objects.get(key="api").total == 7
    assert list(StartLog.objects.values_list("key", "units", "cum", "call_id")) == [("api", 2, 7, call.id)]
