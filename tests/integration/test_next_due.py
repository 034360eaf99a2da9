"""A pass that did not fill its batch says when to look again: when the earliest call not yet due becomes due."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher import dispenser as dispenser_module
from dispatcher.clock import db_now
from dispatcher.dispenser import Dispenser
from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def published(monkeypatch):
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.extend(calls))
    return sent


def test_a_pass_reports_the_earliest_moment_a_waiting_call_becomes_due(published):
    now = db_now()
    later = CallQueue.objects.send("noop", keys=["a"], run_at=now + timedelta(minutes=10))
    soon = CallQueue.objects.send("noop", keys=["b"], run_at=now + timedelta(minutes=5))
    due = CallQueue.objects.send("noop", keys=["c"])

    report = Dispenser().run_once()

    assert [call.id for call in published] == [due.id]
    assert report.next_at == CallQueue.objects.get(id=soon.id).run_at
    assert CallQueue.objects.next_due_at(soon.run_at) == CallQueue.objects.get(id=later.id).run_at
    assert CallQueue.objects.next_due_at(later.run_at) is None


def test_with_no_call_due_later_a_pass_reports_no_moment(published):
    CallQueue.objects.send("noop", keys=["a"])
    report = Dispenser().run_once()
    assert report.moved == 1 and report.next_at is None
    assert CallQueue.objects.next_due_at() is None
