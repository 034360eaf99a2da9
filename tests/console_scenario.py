"""The 3 a.m. scenario of the operator's console (issue 27): a failing key, a paused key, a starved
tenant under a shared key and a dead worker, among healthy keys; seeded through the public doors
(send, the claim, a worker's execute, policy edits, heartbeat rows)."""
from __future__ import annotations

from datetime import timedelta

from dispatcher.clock import db_now
from dispatcher.keys import key_in_set
from dispatcher.limits import edit
from dispatcher.models import CallQueue, Heartbeat
from dispatcher.worker import execute
from tests.claims import claim

FAILING, PAUSED, SHARED, STARVED = "crm", "billing", "mail", "mail:t1"
DEAD_WORKER = "worker celery@night-1 pid 4242"


def seed(healthy: int = 45) -> None:
    """Store the scenario; ``healthy`` keys each with a call waiting a few seconds."""
    now = db_now()
    CallQueue.objects.send_many([{"method": "noop", "keys": [f"shop:{i:02d}"]} for i in range(healthy)])
    # A failing key: every attempt raises, each call gives up at its only attempt.
    edit.set_policy(FAILING, 100, timedelta(minutes=1))
    failing = CallQueue.objects.send_many([{"method": "explode", "keys": [FAILING], "max_attempts": 1} for _ in range(6)])
    for claimed in claim(failing[0].key_set, 10).calls:
        execute(claimed.id, claimed.dispatch_no)
    # A paused key with calls waiting behind the pause.
    edit.set_policy(PAUSED, 10, timedelta(minutes=1))
    CallQueue.objects.send_many([{"method": "noop", "keys": [PAUSED]} for _ in range(4)])
    edit.pause_key(PAUSED, timedelta(hours=1), reason="partner maintenance")
    # Tenants under a shared key: one tenant's calls have waited 40 minutes, the others' seconds.
    edit.set_policy(SHARED, 20, timedelta(minutes=1))
    for tenant in ("mail:t0", STARVED, "mail:t2"):
        CallQueue.objects.send_many([{"method": "noop", "keys": [SHARED, tenant]} for _ in range(3)])
    CallQueue.objects.filter(key_set__contains=key_in_set(STARVED)).update(created_at=now - timedelta(minutes=40))
    # A worker that stopped reporting ten minutes ago without a clean stop: dead or hung.
    Heartbeat.objects.create(name=DEAD_WORKER, kind=Heartbeat.Kind.WORKER)
    Heartbeat.objects.filter(name=DEAD_WORKER).update(started_at=now - timedelta(hours=2), seen_at=now - timedelta(minutes=10))
