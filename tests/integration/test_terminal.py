"""The operator's terminal: prune's cutoff, ratelimit list/pause, dispatcher_status totals and failures, calls."""
from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from dispatcher.clock import db_now
from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, KeyState

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


# --- prune_calls -----------------------------------------------------------------------------------


def test_prune_dry_run_says_when_the_cutoff_was_raised_to_the_longest_policy_period(make_call):
    edit.set_policy("api", 100, timedelta(hours=1))
    make_call(status="done", finished_at=db_now() - timedelta(minutes=10))
    text = run("prune_calls", "--dry-run", "--older-than", "1m")
    assert text.strip() == (
        "would delete 0 finished calls older than 1h: the cutoff was raised from 1m to the longest policy "
        "period (1h), whose window still counts the calls that finished within it"
    )
    assert CallQueue.objects.count() == 1


def test_prune_without_a_longer_policy_reports_the_cutoff_it_used(make_call):
    edit.set_policy("api", 100, timedelta(seconds=30))
    make_call(status="done", finished_at=db_now() - timedelta(minutes=10))
    assert run("prune_calls", "--dry-run", "--older-than", "1m").strip() == "would delete 1 finished calls older than 1m"


# --- ratelimit ---------------------------------------------------------------------------------------


def test_ratelimit_list_hides_expired_pauses():
    edit.set_policy("api", 5, timedelta(minutes=1))
    KeyState.objects.create(key="old", paused_until=db_now() - timedelta(minutes=5), pause_reason="paused by operator")
    edit.pause_key("api", timedelta(minutes=10))
    text = run("ratelimit", "list")
    assert "paused api until 20" in text and "UTC (in 10 min) (paused by operator)" in text
    assert "old" not in text
    assert [p["key"] for p in json.loads(run("ratelimit", "list", "--json"))["pauses"]] == ["api"]


def test_ratelimit_set_says_what_it_set_once():
    text = run("ratelimit", "set", "slow", "--limit", "10", "--per", "1s", "--concurrency", "1")
    assert text.strip() == "set slow: 10 per 1s (sliding window: at most 10 in any 1s); at most 1 in flight"
    assert run("ratelimit", "set", "shop", "--limit", "2", "--per", "1s", "--burst", "40").count("2 per 1s") == 1


def test_ratelimit_list_has_column_headers():
    edit.set_policy("api", 5, timedelta(minutes=1), 3)
    edit.set_policy("shop", 2, timedelta(seconds=1), burst=40)
    header, api, shop = run("ratelimit", "list").splitlines()
    assert header.split() == ["KEY", "LIMIT", "PER", "SHAPE", "BURST", "CONCURRENCY"]
    assert api.split() == ["api", "5", "1m", "window", "-", "3"]
    assert shop.split() == ["shop", "2", "1s", "bucket", "40", "-"]


def test_ratelimit_pause_of_an_unknown_key_is_refused_unless_created():
    edit.set_policy("mailgun", 5, timedelta(minutes=1))
    with pytest.raises(CommandError, match="no policy, pattern, limiter state or waiting call knows the key 'mailgnu'"):
        call_command("ratelimit", "pause", "mailgnu", "--for", "5m")
    assert not KeyState.objects.filter(key="mailgnu").exists()
    assert "paused mailgnu until" in run("ratelimit", "pause", "mailgnu", "--for", "5m", "--create")
    assert KeyState.objects.get(key="mailgnu").paused_until > db_now()


def test_ratelimit_pause_accepts_keys_known_by_policy_pattern_or_waiting_call(make_call):
    edit.set_policy("mailgun", 5, timedelta(minutes=1))
    edit.set_policy("tenant:*", 5, timedelta(minutes=1))
    make_call(keys=["stripe"])
    for key in ("mailgun", "tenant:42", "stripe"):
        assert f"paused {key} until" in run("ratelimit", "pause", key, "--for", "1m")


# --- dispatcher_status ---------------------------------------------------------------------------------


@pytest.fixture
def history(make_call):
    edit.set_policy("api", 5, timedelta(minutes=1))
    now = db_now()
    make_call()
    make_call(status="running")
    make_call(status="done", finished_at=now)
    failed = make_call(status="failed", finished_at=now, attempts=3, last_error="HTTPError: 503")
    for number in (1, 2, 3):
        Attempt.objects.create(call=failed, number=number, started_at=now, finished_at=now, outcome="error",
                               error=f"HTTPError: 503 (try {number})")
    make_call(keys=["other"], status="cancelled", finished_at=now)


def test_dispatcher_status_shows_totals_failures_and_recent_errors_per_key(history):
    text = run("dispatcher_status")
    assert text.startswith("dispatcher status at 20") and " UTC" in text.splitlines()[0]
    assert "calls: 1 waiting, 1 in flight (0 dispatched, 1 running), 1 done, 1 failed, 1 cancelled" in text
    assert "failures in the last hour, by key:\n  api: 3 errors, 1 gave up; latest: HTTPError: 503 (try 3)" in text
    data = json.loads(run("dispatcher_status", "--json"))
    assert data["totals"] == {"pending": 1, "dispatched": 0, "running": 1, "done": 1, "failed": 1, "cancelled": 1}
    assert data["recent_failures"] == [{"key": "api", "errors": 3, "failed": 1, "latest_error": "HTTPError: 503 (try 3)"}]


def test_dispatcher_status_watch_stamps_every_refresh(history, monkeypatch):
    from dispatcher.management.commands import dispatcher_status

    monkeypatch.setattr(dispatcher_status, "MAX_WATCH_ROUNDS", 2)
    monkeypatch.setattr(dispatcher_status.time, "sleep", lambda seconds: None)
    text = run("dispatcher_status", "--watch", "1s")
    stamps = [line for line in text.splitlines() if line.startswith("dispatcher status at 20")]
    assert len(stamps) == 2 and all(line.endswith("UTC, every 1s (Ctrl-C stops)") for line in stamps)


# --- calls ----------------------------------------------------------------------------------------


def test_calls_list_shows_failed_calls_with_their_error(history):
    text = run("calls", "list", "--status", "failed")
    (line,) = text.splitlines()
    assert line.startswith("#") and "failed" in line and "attempts 3/3" in line and "error: HTTPError: 503" in line
    assert [c["status"] for c in json.loads(run("calls", "list", "--key", "other", "--json"))] == ["cancelled"]


def test_calls_list_names_states_as_the_admin_does(make_call):
    waiting = make_call()
    (line,) = run("calls", "list").splitlines()
    assert line.startswith(f"#{waiting.id}  waiting ") and "pending" not in line
    assert run("calls", "list", "--status", "waiting") == run("calls", "list", "--status", "pending")


def test_calls_retry_and_cancel_go_through_the_manager(make_call):
    failed = make_call(status="failed", finished_at=db_now(), attempts=3)
    waiting = make_call(run_at=db_now() + timedelta(hours=1))
    done = make_call(status="done", finished_at=db_now())
    assert run("calls", "retry", str(failed.id), f"#{waiting.id}", str(done.id)).strip() == (
        "2 of 3 calls are due now (the others were in flight, done or cancelled and were left alone)"
    )
    failed.refresh_from_db(), waiting.refresh_from_db()
    assert failed.status == "pending" and failed.max_attempts == 4 and waiting.run_at <= db_now()
    assert run("calls", "cancel", str(waiting.id)).strip() == "cancelled 1 of 1 calls"
    waiting.refresh_from_db()
    assert waiting.status == "cancelled"


@pytest.mark.parametrize(("args", "message"), [
    (("calls", "retry", "abc"), "a call id is a whole number, not 'abc'"),
    (("calls", "cancel", "0"), "a call id is at least 1"),
    (("calls", "list", "--limit", "0"), "--limit must be between 1"),
    (("calls", "list", "--limit", "many"), "--limit must be a whole number"),
])
def test_calls_refuses_bad_arguments(args, message):
    with pytest.raises(CommandError, match=message):
        call_command(*args)


def test_calls_with_an_unknown_id_changes_nothing(make_call):
    waiting = make_call()
    with pytest.raises(CommandError, match=f"no call with id #{waiting.id + 100}; nothing was changed"):
        call_command("calls", "cancel", str(waiting.id), str(waiting.id + 100))
    waiting.refresh_from_db()
    assert waiting.status == "pending"
