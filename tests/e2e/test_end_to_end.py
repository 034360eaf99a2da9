"""The whole path on real parts: send -> dispensers -> Redis -> Celery workers -> fake API."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from dispatcher.limits import edit
from dispatcher.models import Attempt, CallQueue, KeyState
from support.fakeapi import max_in_window
from support.processes import ROOT, Processes, wait_until
from tests.calls import all_finished, latency_spread, partner_call, start_times
from tests.claims import claim


@pytest.mark.postgres
@pytest.mark.slow
def test_many_dispensers_and_workers_never_exceed_any_policy(procs, fake_api):
    edit.set_policy("partner", 8, timedelta(seconds=1), concurrency=4)
    edit.set_policy("partner", 30, timedelta(seconds=5))
    edit.set_policy("tenant:*", 3, timedelta(seconds=1))
    calls = [partner_call(fake_api, "/slow?delay=0.3", "ab"[i % 2], i) for i in range(60)]
    for _ in range(3):
        procs.worker(procs.queue, concurrency=2)
    for _ in range(3):
        procs.dispenser()
    finished = wait_until(all_finished, timeout=90, interval=0.5)
    assert finished, procs.logs()

    statuses = Counter(CallQueue.objects.values_list("status", flat=True))
    assert statuses == {"done": len(calls)}
    # Never dispatched twice: one attempt per call, one request per call at the API.
    assert Counter(Attempt.objects.values_list("call_id", flat=True)) == {c.id: 1 for c in calls}
    assert Counter(a.call for a in fake_api.arrivals) == {str(i): 1 for i in range(60)}

    # Starts as the limiter recorded them, on the database clock: exact.
    partner = start_times("partner")
    assert max_in_window(partner, 1.0) <= 8
    assert max_in_window(partner, 5.0) <= 30
    for tenant in "ab":
        assert max_in_window(start_times(f"tenant:{tenant}"), 1.0) <= 3
    # Arrivals as the API saw them, allowing for the measured spread of request latency.
    index = {c.id: str(i) for i, c in enumerate(calls)}
    spread = latency_spread(fake_api, {index[a.call_id]: a.started_at.timestamp() for a in Attempt.objects.all()})
    arrivals = fake_api.times()
    assert max_in_window(arrivals, 1.0 - spread) <= 8
    assert max_in_window(arrivals, 5.0 - spread) <= 30
    for tenant in "ab":
        assert max_in_window(fake_api.times(lambda a, t=tenant: a.tenant == t), 1.0 - spread) <= 3
    assert fake_api.max_in_flight <= 4
    assert list(KeyState.objects.filter(reserved__gt=0).values_list("key", flat=True)) == []
    assert not CallQueue.objects.filter(status="running").exists()
    print(
        f"\npeak starts: {max_in_window(partner, 1.0)}/1s (limit 8), {max_in_window(partner, 5.0)}/5s (limit 30);"
        f" peak arrivals: {max_in_window(arrivals, 1.0)}/1s; latency spread {spread * 1000:.0f} ms"
    )


@pytest.mark.postgres
@pytest.mark.slow
def test_retries_and_429_through_real_workers(procs, fake_api):
    flaky = partner_call(fake_api, "/fail/x?times=2", "a", 1)
    broken = partner_call(fake_api, "/always500", "a", 2)
    refused = partner_call(fake_api, "/bad", "a", 3)
    limited = partner_call(fake_api, "/limited/y?times=1&after=1", "b", 4)
    procs.worker(procs.queue, concurrency=2)
    procs.dispenser()
    assert wait_until(all_finished, timeout=60, interval=0.3), procs.logs()

    flaky.refresh_from_db()
    assert (flaky.status, flaky.attempts) == ("done", 3)
    assert list(flaky.attempt_set.values_list("outcome", flat=True)) == ["error", "error", "done"]
    assert flaky.result["status"] == 200

    broken.refresh_from_db()
    assert (broken.status, broken.attempts) == ("failed", 3)
    assert "HTTP 500" in broken.last_error

    refused.refresh_from_db()
    assert (refused.status, refused.attempts) == ("failed", 1)

    limited.refresh_from_db()
    assert (limited.status, limited.attempts, limited.deferrals) == ("done", 1, 1)
    outcomes = list(limited.attempt_set.order_by("id").values_list("outcome", "started_at"))
    assert [o for o, _ in outcomes] == ["rate_limited", "done"]
    # The retry waited for the pause the 429's Retry-After asked for.
    assert outcomes[1][1] - outcomes[0][1] >= timedelta(seconds=1)
    assert KeyState.objects.get(key="tenant:b").pause_reason.startswith("429")


@pytest.mark.postgres
@pytest.mark.slow
def test_a_duplicate_celery_message_runs_the_handler_once(procs, fake_api):
    from kombu import Connection

    from dispatcher.tasks import run_call

    call = partner_call(fake_api, "/ok/dup", "a", 1)
    claimed = claim(call.key_set, 1).calls[0]
    # This process's own broker is the embedded one; publish to the workers' Redis directly.
    with Connection(procs.env["CELERY_BROKER_URL"]) as conn:
        for _ in range(2):
            run_call.apply_async((claimed.id, claimed.dispatch_no), queue=procs.queue, connection=conn)
    procs.worker(procs.queue, concurrency=2)
    assert wait_until(all_finished, timeout=30), procs.logs()
    assert wait_until(lambda: "run_skipped" in procs.logs(), timeout=10), procs.logs()
    assert fake_api.counters["/ok/dup"] == 1
    assert Attempt.objects.filter(call=call).count() == 1


@pytest.mark.postgres
@pytest.mark.slow
def test_publish_failure_leaves_the_call_waiting_until_the_broker_is_back(procs, fake_api):
    call = partner_call(fake_api, "/ok/late", "a", 1)
    procs.env["CELERY_BROKER_URL"], real_broker = "redis://127.0.0.1:1/0", procs.env["CELERY_BROKER_URL"]
    result = procs.manage("dispense")
    assert "put_back=1" in result.stdout, result.stdout + result.stderr
    assert "publish_failed" in result.stderr
    call.refresh_from_db()
    assert (call.status, call.attempts) == ("pending", 0)
    procs.env["CELERY_BROKER_URL"] = real_broker
    procs.worker(procs.queue)
    procs.dispenser()
    assert wait_until(all_finished, timeout=30), procs.logs()
    call.refresh_from_db()
    assert call.status == "done" and fake_api.counters["/ok/late"] == 1


@pytest.mark.embedded
@pytest.mark.slow
def test_embedded_default_runs_the_whole_path_on_sqlite_and_the_filesystem_broker(tmp_path, fake_api):
    env = {
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DISPATCHER_VAR_DIR": str(tmp_path),
        "EMBEDDED_BROKER_DIR": str(tmp_path / "broker"),
        "PYTHONUNBUFFERED": "1",
    }
    procs = Processes({**os.environ, **env}, tmp_path)
    for name in ("DATABASE_URL", "CELERY_BROKER_URL", "CELERY_TASK_DEFAULT_QUEUE"):
        procs.env.pop(name, None)
    try:
        for args in (("migrate", "-v0"), ("ratelimit", "set", "partner", "--limit", "5", "--per", "1s"),
                     ("ratelimit", "set", "tenant:*", "--limit", "2", "--per", "1s", "--concurrency", "2")):
            done = procs.manage(*args)
            assert done.returncode == 0, done.stderr
        script = (
            "import django; django.setup()\n"
            "from dispatcher.models import CallQueue\n"
            f"CallQueue.objects.send_many([{{'method': 'http', 'params': {{'method': 'GET', 'url': '{fake_api.url}/ok',"
            " 'headers': {'x-tenant': t, 'x-call': str(i)}}, 'keys': ['partner', 'tenant:' + t]}"
            " for i, t in enumerate('ab' * 10)])\n"
        )
        sent = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=procs.env, capture_output=True, text=True, timeout=60)
        assert sent.returncode == 0, sent.stderr
        procs.worker("celery", concurrency=2)
        procs.dispenser()
        procs.dispenser()
        assert wait_until(lambda: len(fake_api.arrivals) >= 20, timeout=60, interval=0.3), procs.logs()
        def statuses() -> Counter:
            with sqlite3.connect(tmp_path / "db.sqlite3") as db:
                return Counter(row[0] for row in db.execute("SELECT status FROM dispatcher_call"))

        assert wait_until(lambda: statuses() == {"done": 20}, timeout=30, interval=0.5), statuses()
        assert Counter(a.call for a in fake_api.arrivals) == {str(i): 1 for i in range(20)}
        with sqlite3.connect(tmp_path / "db.sqlite3") as db:
            starts = {
                key: [datetime.fromisoformat(t).replace(tzinfo=UTC).timestamp() for (t,) in db.execute(
                    "SELECT started_at FROM dispatcher_keystart WHERE key = ?", [key])]
                for key in ("partner", "tenant:a", "tenant:b")
            }
            by_call = {str(call_id - 1): datetime.fromisoformat(t).replace(tzinfo=UTC).timestamp()
                       for call_id, t in db.execute("SELECT call_id, started_at FROM dispatcher_attempt")}
        assert max_in_window(starts["partner"], 1.0) <= 5
        assert max_in_window(starts["tenant:a"], 1.0) <= 2 and max_in_window(starts["tenant:b"], 1.0) <= 2
        spread = latency_spread(fake_api, by_call)
        assert max_in_window(fake_api.times(), 1.0 - spread) <= 5
        for tenant in "ab":
            assert max_in_window(fake_api.times(lambda a, t=tenant: a.tenant == t), 1.0 - spread) <= 2
    finally:
        procs.stop_all()
