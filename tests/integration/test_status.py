"""Live key status and "why is this call waiting, until when", as the admin and the command show them."""
from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from dispatcher import status as live
from dispatcher import waits
from dispatcher.clock import db_now
from dispatcher.durations import humanize
from dispatcher.limits import edit
from dispatcher.models import Attempt, KeyState
from tests.starts import log_starts

pytestmark = pytest.mark.django_db


def starts(key: str, *ages_seconds: float) -> None:
    now = db_now()
    log_starts(key, [now - timedelta(seconds=a) for a in ages_seconds])


@pytest.fixture
def busy_key(make_call):
    """Key 'api': 3 per minute, concurrency 2; 2 starts in the window, 1 before; 1 reserved; 4 waiting."""
    edit.set_policy("api", 3, timedelta(minutes=1), concurrency=2)
    starts("api", 40, 10, 500)
    KeyState.objects.update_or_create(key="api", defaults={"reserved": 1, "reserved_units": 1})
    now = db_now()
    calls = [make_call(keys=["api"], created_at=now - timedelta(seconds=age)) for age in (300, 120, 60)]
    calls.append(make_call(keys=["api"], run_at=now + timedelta(hours=1)))
    return calls


def test_key_status_counts_window_flight_and_backlog(busy_key):
    (status,) = live.key_statuses(["api"])
    assert [(p.policy.limit, p.policy.period, p.used) for p in status.policies] == [(3, timedelta(minutes=1), 2)]
    assert (status.reserved, status.running, status.in_flight, status.concurrency) == (1, 0, 1, 2)
    assert (status.waiting, status.due) == (4, 3)
    assert 295 <= status.oldest_wait.total_seconds() <= 330
    # 2 started + 1 reserved fill the 3 per minute: blocked until the start 40 s ago leaves the window.
    assert status.blocked and "3 per 1m used" in status.blocked_reason
    assert 15 <= (status.next_free_at - status.now).total_seconds() <= 21
    # No room now; 4 waiting need ceil(4 / 3) = 2 more windows of a minute (each counted with
    # the 20 ms DISPATCHER_ARRIVAL_GUARD).
    assert status.drain_time == timedelta(minutes=2, milliseconds=40)


def test_key_statuses_lists_keys_worth_showing_only(busy_key, make_call):
    edit.set_policy("tenant:*", 5, timedelta(seconds=1))
    make_call(keys=["tenant:7"])
    starts("quiet", 7200)
    KeyState.objects.create(key="idle")
    keys = [s.key for s in live.key_statuses()]
    assert keys == ["api", "tenant:7"]
    (tenant,) = [s for s in live.key_statuses() if s.key == "tenant:7"]
    assert tenant.governed_by == "tenant:*" and tenant.room == 5 and tenant.next_free_at == tenant.now


def test_pattern_pause_shows_on_matching_key(make_call):
    edit.set_policy("tenant:*", 5, timedelta(seconds=1))
    until = edit.pause_key("tenant:*", timedelta(minutes=5))
    make_call(keys=["tenant:1"])
    (status,) = live.key_statuses(["tenant:1"])
    assert status.paused_until == until and status.blocked
    assert status.drain_time >= timedelta(minutes=4)


def test_explains_a_future_run_at(make_call):
    call = make_call(keys=["free"], run_at=db_now() + timedelta(minutes=10))
    explanation = waits.explain_call(call)
    assert [r.kind for r in explanation.reasons] == ["run_at"]
    assert "scheduled" in explanation.summary() and "in 10 min" in explanation.summary()
    assert explanation.until == call.run_at


def test_explains_a_retry_backoff(make_call):
    call = make_call(keys=["free"], attempts=1, run_at=db_now() + timedelta(seconds=30), last_error="RuntimeError: boom")
    Attempt.objects.create(call=call, number=1, started_at=db_now(), outcome="error", error="boom")
    explanation = waits.explain_call(call)
    assert [r.kind for r in explanation.reasons] == ["backoff"]
    assert "attempt 1 of 3" in explanation.summary() and "in 30 s" in explanation.summary()


def test_explains_a_429_deferral_and_the_pause_it_set(make_call):
    edit.pause_key("downstream", timedelta(seconds=90), reason="429 from call #1")
    call = make_call(keys=["downstream"], deferrals=1, run_at=db_now() + timedelta(seconds=90))
    Attempt.objects.create(call=call, number=1, started_at=db_now(), outcome="rate_limited")
    explanation = waits.explain_call(call)
    assert [r.kind for r in explanation.reasons] == ["deferred", "paused"]
    assert "key downstream is paused (429 from call #1)" in explanation.summary()


def test_explains_a_full_window_with_the_time_its_slot_frees(make_call):
    edit.set_policy("api", 2, timedelta(minutes=1))
    starts("api", 50, 5)
    call = make_call(keys=["api"])
    explanation = waits.explain_call(call)
    (reason,) = explanation.reasons
    assert reason.kind == "rate" and reason.key == "api"
    assert "2 per 1m used" in reason.text
    assert "will start at 20" in explanation.summary() and "UTC (in 10 s)" in explanation.summary()
    assert 8 <= (explanation.until - explanation.now).total_seconds() <= 12


def test_explains_a_concurrency_cap_without_an_end_time(make_call):
    edit.set_policy("slow", 100, timedelta(seconds=1), concurrency=1)
    make_call(keys=["slow"], status="running")  # running calls are counted from the calls themselves
    explanation = waits.explain_call(make_call(keys=["slow"]))
    assert [r.kind for r in explanation.reasons] == ["concurrency"]
    assert explanation.until is None and "concurrency 1/1" in explanation.summary()


def test_a_due_call_with_room_is_explained_as_due_now(make_call):
    edit.set_policy("api", 2, timedelta(minutes=1))
    explanation = waits.explain_call(make_call(keys=["api"]))
    assert explanation.reasons == [] and explanation.summary().startswith("due now")


def test_a_finished_call_is_not_waiting(make_call):
    call = make_call(keys=["api"], status="done")
    assert waits.explain_call(call).summary() == "not waiting"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "now"), (12, "in 12 s"), (-12, "12 s ago"), (180, "in 3 min"), (3900, "in 1 h 5 min"), (90000, "in 1 d 1 h")],
)
def test_humanize_writes_times_for_people(seconds, text):
    now = db_now()
    assert humanize(now + timedelta(seconds=seconds), now) == text


def test_dispatcher_status_json_matches_the_known_state(busy_key):
    out = StringIO()
    call_command("dispatcher_status", "--json", stdout=out)
    data = json.loads(out.getvalue())
    (api,) = data["keys"]
    assert api["key"] == "api" and api["governed_by"] == "api"
    assert api["policies"] == [{
        "policy_key": "api", "shape": "window", "limit": 3, "period_seconds": 60.0, "burst": None,
        "explain": "3 per 1m (sliding window: at most 3 in any 1m)", "used": 2, "capacity": 3, "utilisation": 0.6667,
    }]
    assert (api["concurrency"], api["in_flight"], api["reserved"], api["running"]) == (2, 1, 1, 0)
    assert (api["waiting"], api["due"], api["room"], api["drain_seconds"]) == (4, 3, 0, 120.04)
    assert api["paused_until"] is None and api["blocked_reason"] == "3 per 1m used"
    assert 295 <= api["oldest_wait_seconds"] <= 330
    assert api["next_free_at"] > data["now"]


def test_dispatcher_status_table_is_human_friendly(busy_key):
    edit.pause_key("api", timedelta(minutes=3))
    out = StringIO()
    call_command("dispatcher_status", stdout=out)
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("KEY"))
    row = lines[lines.index(header) + 1]
    assert header.split()[:2] == ["KEY", "POLICY"]
    assert row.startswith("api") and "3 per 1m" in row and "2/3" in row and "1/2" in row
    assert "in 3 min" in row and "5 min" in row


def test_dispatcher_status_rejects_a_bad_watch_interval():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--watch"):
        call_command("dispatcher_status", "--watch", "soon")
