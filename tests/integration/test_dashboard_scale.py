"""The dashboard with 300 tenant keys and 3,000 calls renders in under half a second (a benchmark figure)."""
from __future__ import annotations

import random
import time
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client

from dispatcher.clock import db_now
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue
from tests.starts import log_starts

pytestmark = [pytest.mark.django_db, pytest.mark.postgres, pytest.mark.slow]

KEYS = 300
CALLS = 3000


def populate(keys: int = KEYS, calls: int = CALLS) -> None:
    """Tenants under one pattern policy, a third of them busy; a history of starts and outcomes."""
    rng = random.Random(7)
    edit.set_policy("tenant:*", 100, timedelta(hours=1))
    edit.set_policy("tenant:*", 10, timedelta(minutes=1))
    now = db_now()
    rows = []
    for i in range(calls):
        key = f"tenant:{i % keys:03d}"
        rows.append({"method": "noop", "params": {"n": i}, "keys": [key]})
    created = CallQueue.objects.send_many(rows)
    finished = created[: calls * 2 // 3]
    outcomes = ["done"] * 8 + ["error", "rate_limited"]
    attempts: list = []
    starts: dict[str, list] = {}
    for call in finished:
        started = now - timedelta(seconds=rng.randint(1, 3500))
        outcome = rng.choice(outcomes)
        attempts.append(Attempt(call=call, number=1, started_at=started, finished_at=started, outcome=outcome))
        starts.setdefault(call.keys[0], []).append(started)
    Attempt.objects.bulk_create(attempts)
    for key, times in starts.items():
        log_starts(key, times)
    CallQueue.objects.filter(id__in=[c.id for c in finished]).update(status="done", finished_at=now)
    running = [CallQueue.objects.send("noop", {}, keys=[f"tenant:{i:03d}"]).id for i in range(0, keys, 7)]
    CallQueue.objects.filter(id__in=running).update(status="running")


def test_dashboard_of_300_keys_shows_one_page_of_keys_and_prints_its_render_time():
    populate()
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    client.get("/admin/dispatcher/dashboard/")  # warm caches: templates, policies, connection
    timings = []
    for _ in range(3):
        started = time.perf_counter()
        response = client.get("/admin/dispatcher/dashboard/")
        timings.append(time.perf_counter() - started)
        assert response.status_code == 200
    best = min(timings)
    # A figure, not an assertion (wall-clock limits flake on a loaded machine): target 0.5 s.
    print(
        f"\ndashboard, {KEYS} keys / {CALLS} calls: best {best * 1000:.0f} ms of {len(timings)} (target < 500 ms),"
        f" page {len(response.content) // 1024} KiB"
    )
    # What keeps it fast whatever the number of keys: one page of keys, not all of them.
    page = response.content.decode()
    assert page.count('<section class="key-panel"') == 20
