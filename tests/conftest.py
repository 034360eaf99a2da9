"""Fixtures shared by the tests: a fake API, a Redis broker db, real processes."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from support.fakeapi import FakeAPI
from support.processes import Processes, database_url

# Read lazily by dispatcher.conf, by this process and by every process the tests start.
# The fake APIs listen on 127.0.0.1 at ports the OS picks: any port of that address (listed literally).
os.environ.setdefault("DISPATCHER_HTTP_ALLOWED_HOSTS", "127.0.0.1:*")
os.environ.setdefault("DISPATCHER_RETRY_BASE", "100ms")
os.environ.setdefault("DISPATCHER_RETRY_MAX", "1s")
os.environ.setdefault("DISPATCHER_POLL_INTERVAL", "200ms")
# Celery's Django fixup runs Django's checks when it loads the tasks; on Django 6.1 the model
# checks read every database's features, the test settings' mirror alias "other" too, which a
# test's own database access refuses. The checks run in the tests of their own.
os.environ.setdefault("CELERY_SKIP_CHECKS", "1")

REDIS_DB = int(os.environ.get("TEST_REDIS_DB", "9"))


def pytest_collection_modifyitems(config, items) -> None:
    from django.db import connection

    if connection.vendor != "postgresql":
        skip = pytest.mark.skip(reason="needs PostgreSQL (run with DATABASE_URL=postgres://...)")
        for item in items:
            if "postgres" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _forget_learnt_limits():
    """Each test starts without this process's memory of limits already stored."""
    from dispatcher import learning
    from dispatcher.limits import ledger

    ledger._answered.clear()
    learning._stored.clear()
    learning._new_lessons.clear()
    learning._throttled.clear()


@pytest.fixture(autouse=True)
def _forget_handler_times():
    """Each test starts as a new worker process would: no handler of it has returned yet, it knows
    no key's memory of delays, and its delay writer has no connection open (one kept would also
    keep the test database from being dropped)."""
    from dispatcher import delaywriter, handlerpool

    handlerpool._took = None
    handlerpool._running.clear()
    delaywriter._known.clear()
    yield
    delaywriter.close()


@pytest.fixture
def fake_api():
    api = FakeAPI().start()
    yield api
    api.stop()


@pytest.fixture
def redis_url():
    """A Redis database of the tests' own, flushed before and after."""
    import redis

    url = f"redis://127.0.0.1:6379/{REDIS_DB}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def artifacts_dir() -> Path:
    path = Path(__file__).resolve().parent.parent / "artifacts"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture
def procs(transactional_db, redis_url, tmp_path):
    """Real worker and dispenser processes on the test database and a Redis broker."""
    from django.db import connection

    queue = f"test-{uuid.uuid4().hex[:8]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(connection.settings_dict),
        "CELERY_BROKER_URL": redis_url,
        "CELERY_TASK_DEFAULT_QUEUE": queue,
        "PYTHONUNBUFFERED": "1",
    }
    processes = Processes({**os.environ, **env}, tmp_path)
    processes.queue = queue
    yield processes
    processes.stop_all()


@pytest.fixture
def make_call(db):
    """Return a factory of calls: sent as a user would, then given stored fields (``status=...``) as if they got there."""
    from dispatcher.models import CallQueue

    def make(method: str = "noop", params: dict | None = None, keys: list[str] | None = None, **fields) -> CallQueue:
        call = CallQueue.objects.send(method, params or {}, keys=["api"] if keys is None else keys)
        if fields:
            CallQueue.objects.filter(id=call.id).update(**fields)
            call.refresh_from_db()
        return call

    return make
