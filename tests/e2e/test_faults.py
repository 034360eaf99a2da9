"""Nothing lost, nothing over the limit, when real processes crash, the broker or the database fails."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from celery import Celery

from dispatcher.clock import db_now
from dispatcher.limits import catalog, edit
from dispatcher.models import Attempt, CallQueue
from support.fakeapi import max_in_window
from support.processes import wait_until
from tests.calls import all_finished, http_call, statuses
from tests.claims import claim

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


# --- helpers ------------------------------------------------------------------------------


def send_http(fake_api, path: str, n: int, key: str = "api", tag: str = "c") -> list[int]:
    """Send ``n`` calls of ``path`` under one key, tagged ``<tag><i>``, with five attempts each."""
    return [http_call(fake_api, path, call=f"{tag}{i}", keys=[key], max_attempts=5).id for i in range(n)]


def rescue_until_finished(procs, ids: list[int] | None, timeout: float) -> bool:
    """Run the rescue sweep (as beat would) until every call is finished, bounded in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        CallQueue.objects.rescue()
        if all_finished(ids):
            return True
        time.sleep(0.3)
    return all_finished(ids)


def starts_of(key: str) -> list[float]:
    """Every start of a call of this key, as the database recorded it (retries included)."""
    return [
        a.timestamp()
        for a in Attempt.objects.filter(call__key_set=f'["{key}"]').values_list("started_at", flat=True)
    ]


def assert_within(key: str, limit: int, period: float) -> int:
    worst = max_in_window(starts_of(key), period)
    assert worst <= limit, f"{worst} starts of {key!r} in one {period}s window; the limit is {limit}"
    return worst


def assert_each_call_ran_once(fake_api, ids: list[int], tag: str = "c") -> None:
    """Every call reached the API exactly once and has exactly one attempt."""
    arrivals: dict[str, int] = {}
    for arrival in fake_api.arrivals:
        arrivals[arrival.call] = arrivals.get(arrival.call, 0) + 1
    twice = {k: v for k, v in arrivals.items() if v > 1}
    assert not twice, f"calls that reached the API more than once: {twice}"
    assert sorted(arrivals) == sorted(f"{tag}{i}" for i in range(len(ids)))
    attempts = {c.id: c.attempts for c in CallQueue.objects.filter(id__in=ids)}
    assert set(attempts.values()) == {1}, attempts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnRedis:
    """A redis-server the test starts on its own port and may stop and restart."""

    def __init__(self, directory) -> None:
        self.port = free_port()
        self.dir = directory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        assert wait_until(self.ping, 10), "redis-server did not start"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def publisher(broker_url: str) -> Celery:
    """A Celery app of the test's own, publishing to the broker the workers read."""
    return Celery("faults-test", broker=broker_url, set_as_current=False)


# --- 1. worker killed mid-call --------------------------------------------------------------


def test_worker_killed_mid_call_is_rescued_done_and_the_limit_holds(procs, fake_api, settings):
    settings.DISPATCHER_RUN_TIMEOUT = "4s"
    settings.DISPATCHER_DISPATCH_TIMEOUT = "3s"
    edit.set_policy("api", 3, timedelta(seconds=2))
    ids = send_http(fake_api, "/slow?delay=1.5", 6)
    worker = procs.worker(procs.queue, concurrency=2)
    procs.dispenser()
    assert wait_until(lambda: fake_api.in_flight >= 1 and CallQueue.objects.filter(status="running").exists(), 60), procs.logs()
    victims = list(CallQueue.objects.filter(status="running").values_list("id", flat=True))
    procs.stop(worker, signal.SIGKILL)
    procs.worker(procs.queue, concurrency=2)

    assert rescue_until_finished(procs, ids, 120), (statuses(ids), procs.logs())
    assert statuses(ids) == {"done": 6}
    lost = Attempt.objects.filter(call_id__in=victims, outcome="lost")
    assert lost.count() >= 1, "the killed attempt was not recorded as lost"
    for call in CallQueue.objects.filter(id__in=lost.values("call_id")):
        # The lost attempt counts against max_attempts: the call needed a second one.
        assert call.attempts >= 2
        assert call.attempt_set.filter(outcome="done").count() == 1
    assert_within("api", 3, 2.0)


# --- 2. dispenser killed between claim and publish --------------------------------------------


def test_dispenser_killed_after_claim_commit_is_rescued_and_done(procs, fake_api, settings):
    settings.DISPATCHER_DISPATCH_TIMEOUT = "1s"
    ids = send_http(fake_api, "/ok", 5)
    crashing = procs.start("dispenser", sys.executable, "-m", "tests.faulty_dispenser")
    crashing.wait(60)
    assert crashing.returncode == 70, procs.logs()
    stranded = statuses(ids)
    assert stranded.get("dispatched", 0) >= 1, stranded
    assert fake_api.arrivals == [], "nothing was published, so nothing may have run"

    procs.worker(procs.queue)
    procs.dispenser()
    assert rescue_until_finished(procs, ids, 90), (statuses(ids), procs.logs())
    assert statuses(ids) == {"done": 5}
    assert_each_call_ran_once(fake_api, ids)


# --- 3. broker down ---------------------------------------------------------------------------


def test_broker_down_send_keeps_working_nothing_lost_and_all_complete_after(procs, fake_api, settings, tmp_path):
    settings.DISPATCHER_DISPATCH_TIMEOUT = "3s"
    broker = OwnRedis(tmp_path)
    broker.start()
    try:
        procs.env["CELERY_BROKER_URL"] = broker.url
        edit.set_policy("api", 5, timedelta(seconds=1))
        first = send_http(fake_api, "/ok", 10, tag="a")
        procs.worker(procs.queue)
        dispenser = procs.dispenser()
        assert wait_until(lambda: statuses(first).get("done", 0) >= 3, 60), procs.logs()

        broker.stop()
        # send() writes only to the database: it works while the broker is away.
        second = send_http(fake_api, "/ok", 20, tag="b")
        dispenser_log = procs.procs[-1][1]
        assert wait_until(lambda: "publish_failed" in dispenser_log.read_text(errors="replace"), 30), procs.logs()
        time.sleep(2)
        during = statuses(first + second)
        assert "failed" not in during, during
        assert sum(during.values()) == 30
        assert dispenser.poll() is None, "the dispenser must survive a broker outage"

        broker.start()
        assert rescue_until_finished(procs, first + second, 120), (statuses(first + second), procs.logs())
        assert statuses(first + second) == {"done": 30}
        assert_within("api", 5, 1.0)
    finally:
        broker.stop()


# --- 4. database connections killed ------------------------------------------------------------


def terminate_other_backends() -> int:
    """Kill every connection to the test database but this test's own (only our processes use it)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return cursor.fetchone()[0]


def test_killed_database_connections_reconnect_without_loss_or_double_runs(procs, fake_api, settings):
    settings.DISPATCHER_DISPATCH_TIMEOUT = "3s"
    settings.DISPATCHER_RUN_TIMEOUT = "10s"
    edit.set_policy("api", 10, timedelta(seconds=1))
    ids = send_http(fake_api, "/ok", 60)
    procs.worker(procs.queue, concurrency=2)
    procs.worker(procs.queue, concurrency=1)
    procs.dispenser()
    procs.dispenser()
    # Kill every connection repeatedly while the calls flow (bounded in rounds).
    assert wait_until(lambda: statuses(ids).get("done", 0) >= 1, 60), procs.logs()
    killed = rounds = 0
    while rounds < 40 and not all_finished(ids):
        rounds += 1
        killed += terminate_other_backends()
        time.sleep(0.5)
    assert killed > 0, "no connection was killed: the test would prove nothing"
    assert rescue_until_finished(procs, ids, 120), (statuses(ids), procs.logs())
    assert statuses(ids) == {"done": 60}
    assert_each_call_ran_once(fake_api, ids)
    assert_within("api", 10, 1.0)
    print(f"connections killed: {killed} in {rounds} rounds")


# --- 5. duplicate and stale messages -------------------------------------------------------------


def skipped_runs(procs) -> int:
    return procs.logs().count("run_skipped")


def test_duplicate_and_stale_messages_run_the_handler_at_most_once_per_attempt(procs, fake_api, redis_url):

    app = publisher(redis_url)
    procs.worker(procs.queue, concurrency=2)
    [call_id] = send_http(fake_api, "/slow?delay=0.3", 1)
    claimed = claim('["api"]', 1, catalog.Policies.load()).calls
    assert [c.id for c in claimed] == [call_id]
    dispatch_no = claimed[0].dispatch_no
    # The same message twice, as a redelivery would bring it.
    for _ in range(2):
        app.send_task("dispatcher.run_call", args=(call_id, dispatch_no), queue=procs.queue)
    assert wait_until(lambda: all_finished([call_id]) and skipped_runs(procs) >= 1, 60), procs.logs()

    # Stale: a message for a done call, for an older dispatch, for a cancelled call, for no call.
    cancelled = CallQueue.objects.send("http", {"method": "GET", "url": f"{fake_api.url}/ok"}, keys=["api"])
    assert CallQueue.objects.cancel([cancelled.id]) == 1
    stale = [(call_id, dispatch_no), (call_id, dispatch_no - 1), (cancelled.id, 0), (cancelled.id, 1), (10**9, 1)]
    for args in stale:
        app.send_task("dispatcher.run_call", args=args, queue=procs.queue)
    assert wait_until(lambda: skipped_runs(procs) >= 1 + len(stale), 60), procs.logs()

    assert len(fake_api.arrivals) == 1
    call = CallQueue.objects.get(id=call_id)
    assert (call.status, call.attempts, call.attempt_set.count()) == ("done", 1, 1)
    assert CallQueue.objects.get(id=cancelled.id).status == "cancelled"
    assert not Attempt.objects.filter(call_id=cancelled.id).exists()


# --- 6. limits under change ------------------------------------------------------------------------


def test_lowering_a_limit_in_flight_binds_every_later_start(procs, fake_api):
    edit.set_policy("api", 20, timedelta(seconds=1))
    ids = send_http(fake_api, "/ok", 50)
    procs.worker(procs.queue, concurrency=2)
    procs.worker(procs.queue, concurrency=2)
    procs.dispenser()
    assert wait_until(lambda: statuses(ids).get("done", 0) >= 8, 60), procs.logs()
    edit.set_policy("api", 2, timedelta(seconds=1))
    changed_at = db_now().timestamp()
    assert wait_until(lambda: all_finished(ids), 120), (statuses(ids), procs.logs())
    assert statuses(ids) == {"done": 50}
    starts = sorted(starts_of("api"))
    later = [s for s in starts if s > changed_at]
    assert later, "every call started before the change: the test proved nothing"
    for s in later:
        # Starts before the change count too: the new policy judges the whole window.
        in_window = sum(1 for t in starts if s - 1.0 <= t <= s)
        assert in_window <= 2, f"{in_window} starts in the second ending at a start after the change"


def test_a_pause_added_in_flight_stops_every_start_until_it_ends(procs, fake_api):
    edit.set_policy("api", 10, timedelta(seconds=1))
    ids = send_http(fake_api, "/ok", 40)
    procs.worker(procs.queue, concurrency=2)
    procs.dispenser()
    assert wait_until(lambda: statuses(ids).get("done", 0) >= 5, 60), procs.logs()
    until = edit.pause_key("api", timedelta(seconds=2)).timestamp()
    paused_at = db_now().timestamp()  # the pause is committed: every start from here on sees it
    assert wait_until(lambda: all_finished(ids), 120), (statuses(ids), procs.logs())
    assert statuses(ids) == {"done": 40}
    starts = starts_of("api")
    during = [s for s in starts if paused_at < s < until]
    assert during == [], f"{len(during)} calls started during the pause"
    assert any(s >= until for s in starts), "nothing was left for after the pause: the test proved nothing"
    assert_within("api", 10, 1.0)
