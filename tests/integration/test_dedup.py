"""Send once: a unique key stores one call while it is held, under concurrency, on both databases."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from django.db import connection, connections, transaction

from dispatcher.exceptions import InvalidCall
from dispatcher.models import CallQueue
from support.processes import database_url

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
Status = CallQueue.Status


def send(key: str, **options) -> CallQueue:
    return CallQueue.objects.send("noop", options.pop("params", {}), keys=["api"], unique_key=key, **options)


def finish(call: CallQueue, status: str = Status.DONE) -> None:
    CallQueue.objects.filter(id=call.id).update(status=status, finished_at=datetime.now(UTC))


# --- one holder per key ----------------------------------------------------------------------


def test_a_second_send_with_the_key_stores_nothing_and_returns_the_waiting_call():
    first = send("order-1", params={"n": 1})
    second = send("order-1", params={"n": 2})
    assert first.created is True and second.created is False
    assert second.id == first.id and second.params == {"n": 1}
    assert CallQueue.objects.count() == 1


def test_the_holder_a_duplicate_returns_reads_as_the_stored_row_in_every_field():
    first = send("order-2", params={"n": 1, "text": "é"}, unique_for="1h", run_at=datetime(2031, 1, 1, tzinfo=UTC))
    finish(first, Status.DONE)
    second = send("order-2", params={"n": 2})
    third = CallQueue.objects.send_many([{"method": "noop", "unique_key": "order-2"}])[0]
    stored = CallQueue.objects.get(id=first.id)
    fields = [f.attname for f in CallQueue._meta.concrete_fields]
    assert second.created is False and third.created is False
    assert [getattr(second, f) for f in fields] == [getattr(stored, f) for f in fields]
    assert [getattr(third, f) for f in fields] == [getattr(stored, f) for f in fields]


def test_sends_without_a_key_are_always_created():
    call = CallQueue.objects.send("noop", {})
    assert call.created is True and call.unique_key is None
    assert CallQueue.objects.send_many([{"method": "noop"}])[0].created is True


def test_the_key_holds_while_the_call_is_in_flight_and_frees_when_it_finishes():
    first = send("order-2")
    for status in (Status.DISPATCHED, Status.RUNNING):
        CallQueue.objects.filter(id=first.id).update(status=status)
        assert send("order-2").id == first.id
    finish(first, Status.FAILED)
    again = send("order-2")
    assert again.created is True and again.id != first.id
    assert CallQueue.objects.filter(unique_key="order-2").count() == 2


def test_unique_for_holds_the_key_after_the_call_finished_until_it_passes():
    first = send("digest", unique_for="1h")
    assert first.unique_until is not None
    # PostgreSQL: the INSERT's own timestamp plus the hold; the portable path: the app's clock at send().
    assert abs(first.unique_until - first.created_at - timedelta(hours=1)) < timedelta(seconds=2)
    finish(first)
    held = send("digest", unique_for="1h")
    assert held.created is False and held.id == first.id and held.status == Status.DONE
    # The hour has passed: the next send takes the key, and the finished call lets it go.
    CallQueue.objects.filter(id=first.id).update(unique_until=datetime.now(UTC) - timedelta(seconds=1))
    fresh = send("digest", unique_for=timedelta(hours=1))
    assert fresh.created is True and fresh.id != first.id
    first.refresh_from_db()
    assert first.unique_released is True


def test_unique_for_does_not_shorten_the_hold_of_a_call_still_waiting():
    first = send("slow", unique_for="1s")
    CallQueue.objects.filter(id=first.id).update(unique_until=datetime.now(UTC) - timedelta(minutes=1))
    assert send("slow").id == first.id


def test_a_rolled_back_sender_leaves_the_key_free():
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        assert send("order-3").created is True
        raise Abort
    call = send("order-3")
    assert call.created is True and CallQueue.objects.count() == 1


def test_a_duplicate_inside_the_callers_transaction_leaves_it_usable():
    with transaction.atomic():
        first = send("order-4")
        again = send("order-4")
        assert again.id == first.id
        assert CallQueue.objects.count() == 1  # the transaction still runs queries


# --- replace -----------------------------------------------------------------------------------


def test_replace_gives_the_waiting_call_the_new_params_and_run_at():
    first = send("debounce", params={"v": 1}, run_at=datetime(2031, 1, 1, tzinfo=UTC))
    later = datetime(2032, 6, 1, tzinfo=UTC)
    replaced = send("debounce", params={"v": 2}, run_at=later, on_duplicate="replace")
    assert replaced.created is False and replaced.id == first.id
    stored = CallQueue.objects.get(id=first.id)
    assert stored.params == {"v": 2} and stored.run_at == later
    assert replaced.params == {"v": 2} and replaced.run_at == later


def test_replace_without_run_at_makes_the_waiting_call_due_now():
    first = send("debounce-now", run_at=datetime(2031, 1, 1, tzinfo=UTC))
    send("debounce-now", params={"v": 3}, on_duplicate="replace")
    assert CallQueue.objects.get(id=first.id).run_at < datetime.now(UTC) + timedelta(seconds=5)


def test_replace_never_touches_a_call_in_flight_and_returns_it_as_keep_does():
    first = send("debounce-2", params={"v": 1})
    CallQueue.objects.filter(id=first.id).update(status=Status.RUNNING)
    kept = send("debounce-2", params={"v": 2}, on_duplicate="replace")
    assert kept.created is False and kept.id == first.id
    assert CallQueue.objects.get(id=first.id).params == {"v": 1}


def test_replace_with_another_method_is_refused():
    send("debounce-3")
    with pytest.raises(InvalidCall, match="same method"):
        CallQueue.objects.send("greet", {"name": "x"}, unique_key="debounce-3", on_duplicate="replace")


# --- send_many ---------------------------------------------------------------------------------


def test_send_many_returns_one_call_per_input_and_the_first_of_a_key_wins():
    held = send("k-held")
    calls = CallQueue.objects.send_many([
        {"method": "noop", "params": {"n": 0}, "unique_key": "k-a"},
        {"method": "noop", "params": {"n": 1}},
        {"method": "noop", "params": {"n": 2}, "unique_key": "k-a"},
        {"method": "noop", "params": {"n": 3}, "unique_key": "k-held"},
        {"method": "noop", "params": {"n": 4}, "unique_key": "k-b", "unique_for": "5m"},
    ])
    assert [c.created for c in calls] == [True, True, False, False, True]
    assert calls[2].id == calls[0].id and calls[2].params == {"n": 0}
    assert calls[3].id == held.id
    assert CallQueue.objects.count() == 4
    assert CallQueue.objects.get(id=calls[4].id).unique_until is not None


def test_send_many_with_many_duplicates_stores_each_key_once():
    specs = [{"method": "noop", "params": {"n": i}, "unique_key": f"bulk-{i % 50}"} for i in range(300)]
    calls = CallQueue.objects.send_many(specs)
    assert len(calls) == 300 and sum(c.created for c in calls) == 50
    assert CallQueue.objects.count() == 50
    assert all(c.id == calls[i % 50].id for i, c in enumerate(calls))


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"unique_key": ""}, "empty"),
        ({"unique_key": "   "}, "empty"),
        ({"unique_key": "x" * 256}, "limit is 255"),
        ({"unique_key": 42}, "must be a string"),
        ({"unique_key": "a\x00b"}, "printable"),
        ({"unique_for": "10m"}, "needs a unique_key"),
        ({"on_duplicate": "replace"}, "needs a unique_key"),
        ({"unique_key": "k", "on_duplicate": "skip"}, "keep' or 'replace"),
        ({"unique_key": "k", "unique_for": "0s"}, "greater than zero"),
        ({"unique_key": "k", "unique_for": timedelta(seconds=-5)}, "negative"),
        ({"unique_key": "k", "unique_for": "99999d"}, "out of range"),
        ({"unique_key": "k", "unique_for": "soon"}, "not a duration"),
        ({"unique_key": "k", "unique_for": [1]}, "timedelta or a duration"),
    ],
)
def test_bad_unique_arguments_are_refused_and_nothing_is_stored(options, message):
    with pytest.raises(InvalidCall, match=message):
        CallQueue.objects.send("noop", {}, **options)
    with pytest.raises(InvalidCall, match=message):
        CallQueue.objects.send_many([{"method": "noop"}, {"method": "noop", **options}])
    assert not CallQueue.objects.exists()


def test_unique_key_is_exactly_255_characters_at_most():
    assert send("x" * 255).created is True


# --- prune ---------------------------------------------------------------------------------------


def test_prune_keeps_a_finished_call_whose_unique_for_still_holds():
    long_ago = datetime.now(UTC) - timedelta(days=30)
    holding = send("keep-me", unique_for="90d")
    done = send("go", unique_for="1s")
    plain = CallQueue.objects.send("noop", {})
    CallQueue.objects.filter(id__in=[holding.id, done.id, plain.id]).update(status=Status.DONE, finished_at=long_ago)
    CallQueue.objects.filter(id=done.id).update(unique_until=long_ago)
    assert CallQueue.objects.prune(timedelta(days=7)) == 2
    assert list(CallQueue.objects.values_list("id", flat=True)) == [holding.id]
    assert send("keep-me").id == holding.id


# --- concurrency ---------------------------------------------------------------------------------


def _race_threads(key: str, senders: int) -> list[tuple[int, bool]]:
    barrier = threading.Barrier(senders)
    results: list[tuple[int, bool]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def sender(n: int) -> None:
        try:
            barrier.wait(timeout=30)
            with transaction.atomic():
                call = send(key, params={"n": n}, unique_for="1h")
                time.sleep(0.01)  # hold the transaction open while the others try
            with lock:
                results.append((call.id, call.created))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    return results


@pytest.mark.postgres
def test_twenty_threads_sending_one_key_store_exactly_one_call():
    results = _race_threads("race-threads", 20)
    assert len(results) == 20
    assert CallQueue.objects.filter(unique_key="race-threads").count() == 1
    (call_id,) = CallQueue.objects.values_list("id", flat=True)
    assert {r[0] for r in results} == {call_id}
    assert sum(created for _, created in results) == 1


# A sender process: THREADS threads, each sending KEY once in its own transaction, from START on.
_CHILD = """
import json, sys, threading, time
import django
django.setup()
from django.db import connections, transaction
from dispatcher.models import CallQueue
start, threads, key = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
out = []
def sender(n):
    time.sleep(max(0.0, start - time.time()))
    try:
        with transaction.atomic():
            call = CallQueue.objects.send("noop", {"n": n}, keys=["api"], unique_key=key, unique_for="1h")
            time.sleep(0.01)
        out.append([call.id, call.created])
    finally:
        connections.close_all()
workers = [threading.Thread(target=sender, args=(n,)) for n in range(threads)]
for w in workers: w.start()
for w in workers: w.join(120)
print(json.dumps(out))
"""


def _race_processes(env: dict[str, str], key: str, processes: int, threads: int) -> tuple[float, list]:
    start = time.time() + 3.0  # every child has imported Django by then
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(start), str(threads), key],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    return start, children


def _results(children: list) -> list:
    results = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        results += json.loads(out)
    return results


@pytest.mark.postgres
def test_four_processes_and_twenty_threads_sending_one_key_store_exactly_one_call():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": database_url(connection.settings_dict)}
    start, children = _race_processes(env, "race-processes", 4, 5)
    time.sleep(max(0.0, start - time.time()))
    results = _race_threads("race-processes", 20) + _results(children)
    assert len(results) == 40
    assert CallQueue.objects.filter(unique_key="race-processes").count() == 1
    (call_id,) = CallQueue.objects.values_list("id", flat=True)
    assert {r[0] for r in results} == {call_id}
    assert sum(created for _, created in results) == 1


@pytest.mark.embedded
def test_on_a_sqlite_file_four_processes_of_five_threads_sending_one_key_store_exactly_one_call(tmp_path):
    # The suite's SQLite database lives in memory (one process); the race needs a file that processes share.
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DISPATCHER_VAR_DIR": str(tmp_path)}
    env.pop("DATABASE_URL", None)
    migrated = subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
    assert migrated.returncode == 0, migrated.stderr
    results = _results(_race_processes(env, "race-sqlite", 4, 5)[1])
    assert len(results) == 20
    with sqlite3.connect(tmp_path / "db.sqlite3") as db:
        stored = db.execute("SELECT id FROM dispatcher_call WHERE unique_key = 'race-sqlite'").fetchall()
    assert len(stored) == 1
    assert {r[0] for r in results} == {stored[0][0]}
    assert sum(created for _, created in results) == 1


# --- API -------------------------------------------------------------------------------------------


def _post(client, body):
    return client.post("/api/calls/", data=json.dumps(body), content_type="application/json",
                       HTTP_AUTHORIZATION="Bearer dedup-token")


def test_the_api_answers_201_for_a_stored_call_and_200_with_the_holder(client, settings):
    settings.DISPATCHER_API_TOKENS = "dedup-token"
    body = {"method": "noop", "params": {}, "unique_key": "api-1", "unique_for": "10m"}
    first = _post(client, body)
    second = _post(client, {**body, "on_duplicate": "replace", "params": {"v": 2}})
    assert first.status_code == 201 and first.json()["created"] is True
    assert second.status_code == 200 and second.json() == {**first.json(), "created": False}
    assert CallQueue.objects.get().params == {"v": 2}
    bad = _post(client, {**body, "unique_key": ""})
    assert bad.status_code == 400 and "unique_key" in bad.json()["error"]
    assert CallQueue.objects.count() == 1


# --- Django Tasks --------------------------------------------------------------------------------


def test_a_task_with_a_unique_template_is_enqueued_once_per_key():
    from django.core.exceptions import ImproperlyConfigured

    from dispatcher.backends import DispatcherBackend
    from tests.testapp.tasks import add

    backend = DispatcherBackend("default", {"OPTIONS": {"unique": {"tests.testapp.tasks.add": {"key": "{a}", "for": "1h"}}}})
    first = backend.enqueue(add, (1, 2), {})
    again = backend.enqueue(add, (), {"a": 1, "b": 5})
    other = backend.enqueue(add, (2, 2), {})
    assert again.id == first.id and other.id != first.id
    assert CallQueue.objects.get(id=int(first.id)).unique_key == "tests.testapp.tasks.add:1"
    with pytest.raises(ImproperlyConfigured, match="unique"):
        DispatcherBackend("default", {"OPTIONS": {"unique": {"tests.testapp.tasks.add": {"key": "{a}", "for": "-1s"}}}})


# --- admin ---------------------------------------------------------------------------------------


def test_the_admin_shows_the_unique_key_on_the_call_page_and_finds_the_call_by_it(admin_client):
    call = send("invoice-2030-17", unique_for="1h")
    CallQueue.objects.send("noop", {})
    page = admin_client.get(f"/admin/dispatcher/callqueue/{call.id}/change/")
    assert page.status_code == 200 and "invoice-2030-17" in page.content.decode()
    found = admin_client.get("/admin/dispatcher/callqueue/", {"q": "invoice-2030"})
    assert found.status_code == 200 and list(found.context["cl"].result_list) == [call]


def test_send_many_refused_on_a_duplicate_stores_none_of_the_batch():
    send("held-by-noop")
    with pytest.raises(InvalidCall, match="same method"):
        CallQueue.objects.send_many([
            {"method": "noop", "params": {"n": 1}, "unique_key": "fresh"},
            {"method": "greet", "params": {"name": "x"}, "unique_key": "held-by-noop", "on_duplicate": "replace"},
        ])
    assert list(CallQueue.objects.values_list("unique_key", flat=True)) == ["held-by-noop"]
