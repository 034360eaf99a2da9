"""A limit learnt from an API shows in the status, the waiting call's explanation, /metrics and the admin."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import User

from dispatcher import report_rate_limit
from dispatcher.limits import edit
from dispatcher.models import CallQueue
from dispatcher.status import key_statuses
from dispatcher.waits import explain_call
from tests.integration.test_metrics import samples
from tests.starts import log_starts

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def learnt_and_full():
    from dispatcher.clock import db_now

    edit.set_policy("partner", 1000, timedelta(seconds=2))
    report_rate_limit(limit=2, window=60, remaining=5, reset=30, key="partner")
    now = db_now()
    log_starts("partner", [now - timedelta(seconds=1)] * 2)
    return CallQueue.objects.send("greet", {"name": "a"}, keys=["partner"])


def test_status_and_explanation_name_the_learnt_limit(learnt_and_full, capsys):
    from django.core.management import call_command

    status = next(s for s in key_statuses(["partner"]))
    learnt = [p for p in status.as_dict()["policies"] if p.get("learnt")]
    assert [(p["limit"], p["used"]) for p in learnt] == [(2, 2)] and status.blocked
    assert "a limit the API announced" in explain_call(learnt_and_full).summary()
    call_command("dispatcher_status", "--json")
    shown = json.loads(capsys.readouterr().out)
    assert any(p.get("learnt") for row in shown["keys"] if row["key"] == "partner" for p in row["policies"])


def test_metrics_and_admin_show_the_learnt_limit(learnt_and_full, client, settings):
    settings.DISPATCHER_METRICS_PUBLIC = True
    found = samples(client.get("/metrics").content.decode())
    assert [v for (name, labels), v in found.items() if name == "dispatcher_learnt_limit" and ("key", "partner") in labels] == [2]
    client.force_login(User.objects.create_superuser("root", "r@x.invalid", "pw"))
    page = client.get("/admin/dispatcher/learntlimit/").content.decode()
    assert "partner" in page and "limit 2 per 60s" in page
