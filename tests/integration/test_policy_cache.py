"""A worker keeps the policies it read (PostgreSQL); every way of changing them binds its next start."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection

from dispatcher import dispenser as dispenser_module
from dispatcher.clock import db_now
from dispatcher.dispenser import Dispenser
from dispatcher.limits import catalog, edit
from dispatcher.models import CallQueue, KeyState, LearntLimit, RateLimit
from tests.integration.test_lifecycle import claim_all

pytestmark = pytest.mark.django_db


def _two_claimed(limit: int = 2) -> list:
    """Two calls of key "api" claimed under a window of ``limit`` per minute."""
    edit.set_policy("api", limit, timedelta(minutes=1))
    calls = [CallQueue.objects.send("greet", {"name": "x"}, keys=["api"]) for _ in range(2)]
    claimed = claim_all(calls[0].key_set, 2).calls
    assert len(claimed) == 2
    return claimed


def _start(claimed) -> str:
    return CallQueue.objects.start(claimed.id, claimed.dispatch_no).state


EDITS = ["queryset update", "policy deleted, a tighter one added", "learnt limit", "pattern pause"]


def _edit(name: str) -> None:
    now = db_now()
    {
        # An edit that sends no signal and runs no manager code: only the database knows.
        "queryset update": lambda: RateLimit.objects.filter(key="api").update(limit=1),
        "policy deleted, a tighter one added": lambda: (
            RateLimit.objects.filter(key="api").delete(), edit.set_policy("ap*", 1, timedelta(minutes=1))
        ),
        "learnt limit": lambda: LearntLimit.objects.create(
            key="api", limit=1, period=timedelta(minutes=1), expires_at=now + timedelta(hours=1),
            source="handler", observed_at=now,
        ),
        "pattern pause": lambda: KeyState.objects.create(key="ap*", paused_until=now + timedelta(hours=1)),
    }[name]()


@pytest.mark.parametrize("edit", EDITS)
def test_an_edit_made_after_a_worker_kept_the_policies_binds_its_next_start(edit):
    first, second = _two_claimed()
    assert _start(first) == "started"
    if connection.vendor == "postgresql":
        kept = catalog.kept_policies()
        assert kept is not None and kept[1].for_key("api")[0].limit == 2
    _edit(edit)
    assert _start(second) == "deferred"


def test_kept_policies_serve_the_next_start_without_reading_them():
    first, second = _two_claimed()
    assert _start(first) == "started"
    kept = catalog.kept_policies()
    assert _start(second) == "started"
    # Nothing changed: the second start used the very policies the first one kept.
    assert catalog.kept_policies() is kept
    if connection.vendor == "postgresql":
        assert kept is not None


def test_a_changed_dispatcher_setting_drops_the_kept_policies(settings):
    first, _ = _two_claimed()
    assert _start(first) == "started"
    settings.DISPATCHER_ARRIVAL_GUARD = "50ms"
    assert catalog.kept_policies() is None


@pytest.fixture
def published(monkeypatch):
    """What the dispenser publishes, recorded instead of sent to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.extend(calls))
    return sent


def _pass_moves() -> int:
    CallQueue.objects.send("greet", {"name": "x"}, keys=["api"])
    return Dispenser().run_once().moved


@pytest.mark.parametrize("change", EDITS)
def test_an_edit_made_after_a_dispenser_kept_the_policies_binds_its_next_pass(change, published):
    edit.set_policy("api", 2, timedelta(minutes=1))
    assert _pass_moves() == 1
    if connection.vendor == "postgresql":
        kept = catalog.kept_policies()
        assert kept is not None and kept[1].for_key("api")[0].limit == 2
    _edit(change)
    # Under the kept policies (2 a minute) the second call would be claimed.
    assert _pass_moves() == 0


def test_a_dispenser_reads_the_policies_again_once_a_kept_learnt_limit_expires(published):
    edit.set_policy("api", 5, timedelta(minutes=1))
    now = db_now()
    LearntLimit.objects.create(
        key="api", limit=1, period=timedelta(minutes=1), expires_at=now + timedelta(milliseconds=300),
        source="handler", observed_at=now,
    )
    assert _pass_moves() == 1
    assert _pass_moves() == 0  # the learnt limit holds while it lasts
    time.sleep(0.4)
    # Expired: the pass judges by the policy alone (5 a minute), not by the limit it kept.
    assert _pass_moves() == 2
