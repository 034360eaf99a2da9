"""Dispensers and workers report they are alive; every screen says so when they are not."""
from __future__ import annotations

import json
import signal
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from dispatcher import liveness, waits
from dispatcher.clock import db_now
from dispatcher.limits import edit
from dispatcher.models import Heartbeat
from support.processes import wait_until

pytestmark = pytest.mark.django_db


def heartbeat(kind: str, age: timedelta, name: str = "") -> Heartbeat:
    return Heartbeat.objects.create(name=name or f"{kind} host pid 1", kind=kind, seen_at=db_now() - age)


@pytest.fixture
def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    return client


def test_a_waiting_call_says_no_dispenser_has_run_since_its_last_heartbeat(make_call):
    heartbeat("dispenser", timedelta(minutes=4))
    heartbeat("worker", timedelta(seconds=1))
    explanation = waits.explain_call(make_call())
    assert explanation.stalled.startswith("no dispenser has run since ") and "(4 min ago)" in explanation.stalled
    assert explanation.summary() == f"due now, but nothing will send it; {explanation.stalled}"


def test_a_waiting_call_with_a_live_dispenser_is_due_now(make_call):
    heartbeat("dispenser", timedelta(seconds=2))
    explanation = waits.explain_call(make_call())
    assert explanation.stalled == "" and explanation.summary() == "due now: the next dispense pass will send it"


def test_before_any_dispenser_ran_the_call_says_so(make_call):
    assert waits.explain_call(make_call()).stalled == "no dispenser has run yet"


def test_a_call_left_in_the_broker_says_no_worker_has_picked_it_up(make_call):
    heartbeat("dispenser", timedelta(seconds=1))
    heartbeat("worker", timedelta(minutes=10))
    call = make_call(status="dispatched", dispatched_at=db_now() - timedelta(minutes=4))
    stalled = waits.explain_call(call).stalled
    assert stalled.startswith("dispatched 4 min ago, no worker has picked it up; no worker has reported since ")
    # A call dispatched a moment ago is on its way: nothing to say.
    fresh = make_call(status="dispatched", dispatched_at=db_now())
    assert waits.explain_call(fresh).stalled == ""


def test_a_process_that_stopped_cleanly_is_not_running_before_its_timeout():
    beat = heartbeat("dispenser", timedelta(seconds=1))
    liveness.stopped(beat.name)
    assert liveness.read().problem("dispenser").startswith("no dispenser has run since ")


def test_heartbeats_are_written_at_most_once_per_interval(settings):
    settings.DISPATCHER_HEARTBEAT_TIMEOUT = "1m"
    assert liveness.beat("dispenser", "dispenser test pid 7")
    with CaptureQueriesContext(connection) as queries:
        for _ in range(50):
            assert not liveness.beat("dispenser", "dispenser test pid 7")
    assert len(queries) == 0
    assert liveness.read().summary("dispenser").startswith("1 dispenser running")


def test_the_admin_index_and_dashboard_warn_when_no_dispenser_runs(admin_client):
    heartbeat("worker", timedelta(seconds=1))
    index = admin_client.get("/admin/").content.decode()
    assert "no dispenser has run yet" in index and "1 worker running" in index
    assert 'href="/dispatcher/dashboard/"' in index
    assert "no dispenser has run yet" in admin_client.get("/admin/dispatcher/dashboard/").content.decode()


def test_the_call_page_says_why_a_dispatched_call_does_not_move(admin_client, make_call):
    call = make_call(status="dispatched", dispatched_at=db_now() - timedelta(minutes=4))
    page = admin_client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").content.decode()
    assert "dispatched 4 min ago, no worker has picked it up; no worker has reported yet" in page


def test_dispatcher_status_and_metrics_report_liveness(admin_client, make_call):
    heartbeat("dispenser", timedelta(minutes=5))
    heartbeat("worker", timedelta(seconds=1))
    make_call()
    out = StringIO()
    call_command("dispatcher_status", stdout=out)
    text = out.getvalue()
    assert "WARNING: no dispenser has run since" in text and "1 worker running" in text
    out = StringIO()
    call_command("dispatcher_status", "--json", stdout=out)
    data = json.loads(out.getvalue())["liveness"]
    assert data["dispensers"]["alive"] == 0 and data["dispensers"]["problem"].startswith("no dispenser has run since")
    assert data["workers"]["alive"] == 1
    metrics = admin_client.get("/metrics").content.decode()
    assert 'dispatcher_processes_alive{kind="dispenser"} 0.0' in metrics
    assert 'dispatcher_processes_alive{kind="worker"} 1.0' in metrics
    assert 'dispatcher_heartbeat_age_seconds{kind="dispenser"} 3' in metrics  # about 300 s


@pytest.mark.postgres
@pytest.mark.slow
def test_real_dispenser_and_worker_report_and_stop_reporting(procs):
    env = {"DISPATCHER_HEARTBEAT_TIMEOUT": "2s"}
    dispenser = procs.dispenser(extra_env=env)
    worker = procs.worker(procs.queue, concurrency=1, extra_env=env)

    def alive(kind: str) -> int:
        return len(liveness.read().alive(kind))

    with_timeout = {"DISPATCHER_HEARTBEAT_TIMEOUT": "2s"}
    from django.test import override_settings

    with override_settings(**with_timeout):
        assert wait_until(lambda: alive("dispenser") == 1 and alive("worker") == 1, timeout=60), procs.logs()
        procs.stop(dispenser)  # SIGTERM: a clean stop marks the heartbeat stopped at once
        assert alive("dispenser") == 0
        assert liveness.read().problem("dispenser").startswith("no dispenser has run since")
        procs.stop(worker, sig=signal.SIGKILL)  # no goodbye: the timeout tells
        assert wait_until(lambda: alive("worker") == 0, timeout=10)
        assert liveness.read().problem("worker").startswith("no worker has reported since")


def test_the_calls_list_warns_only_when_something_is_missing(admin_client):
    heartbeat("worker", timedelta(seconds=1))
    page = admin_client.get("/admin/dispatcher/callqueue/").content.decode()
    assert "no dispenser has run yet" in page and "1 worker running" not in page
    heartbeat("dispenser", timedelta(seconds=1))
    assert 'id="dispatcher-liveness"' not in admin_client.get("/admin/dispatcher/callqueue/").content.decode()


def test_a_free_slot_says_nothing_will_use_it_while_no_dispenser_runs(admin_client, make_call):

    edit.set_policy("api", 5, timedelta(minutes=1))
    make_call()
    assert "now, but no dispenser runs" in admin_client.get("/admin/dispatcher/dashboard/").content.decode()
    out = StringIO()
    call_command("dispatcher_status", stdout=out)
    assert "now, but no dispenser runs" in out.getvalue()
    heartbeat("dispenser", timedelta(seconds=1))
    assert "no dispenser runs" not in admin_client.get("/admin/dispatcher/dashboard/").content.decode()
