"""The routing rule: every statement of a call's life runs on the alias its manager uses.

``other`` is a second alias on the same database (tests/settings.py); a call handled through
``CallQueue.objects.db_manager("other")`` must leave the default connection untouched.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

from dispatcher.limits import catalog, edit, gate
from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])


def test_a_call_from_send_to_finish_runs_only_on_its_managers_alias():
    calls = CallQueue.objects.db_manager("other")
    with CaptureQueriesContext(connections["default"]) as on_default, CaptureQueriesContext(
        connections["other"]
    ) as on_other:
        edit.set_policy("routed", 10, timedelta(seconds=60), concurrency=5, using="other")
        edit.set_policy("routed-bucket", 10, timedelta(seconds=60), burst=2, using="other")
        first = calls.send("noop", keys=["routed", "routed-bucket"])
        calls.send_many([{"method": "noop", "keys": ["routed"]}, {"method": "noop", "keys": ["routed"], "cost": 2}])
        key_sets = calls.waiting_key_sets()
        claimed = calls.claim_batch(key_sets, 10, catalog.Policies.load("other")).calls
        assert {c.id for c in claimed} >= {first.id}
        by_id = {c.id: c for c in claimed}
        started = calls.start(first.id, by_id[first.id].dispatch_no)
        assert started.state == "started"
        assert calls.finish_done(started.call, started.attempt, {"ok": True})
        second, third = sorted(set(by_id) - {first.id})
        run = calls.start(second, by_id[second].dispatch_no)
        assert calls.finish_error(run.call, run.attempt, "boom", "", permanent=False)
        run = calls.start(third, by_id[third].dispatch_no)
        calls.correct_cost(run.call, 1)
        assert calls.finish_rate_limited(run.call, run.attempt, 1.0, "routed", "429")
        calls.retry_now([second])
        calls.cancel([second])
        calls.rescue()
        calls.prune(timedelta(0))
        edit.pause_key("routed", timedelta(seconds=5), using="other")
        edit.resume_key("routed", using="other")
    assert on_other.captured_queries
    assert [q["sql"] for q in on_default.captured_queries] == []
    assert gate.running_by_key(["routed"]) == {}
