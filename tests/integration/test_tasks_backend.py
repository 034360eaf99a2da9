"""Django Tasks on dispatcher.backends: @task functions become paced calls, read back by get_result()."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta

import django
import pytest
from asgiref.sync import async_to_sync
from django.db import transaction

from dispatcher.exceptions import InvalidCall
from dispatcher.limits import edit
from dispatcher.models import CallQueue, StartLog
from dispatcher.worker import execute
from support.fakeapi import max_in_window
from support.processes import ROOT, wait_until
from tests.claims import claim
from tests.testapp.tasks import add, add_later, fail, fetch_account

try:
    from django.tasks import TaskResultStatus, default_task_backend
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus, default_task_backend
    from django_tasks.exceptions import TaskResultDoesNotExist

pytestmark = pytest.mark.django_db(transaction=True)


def run_due(key_set: str) -> None:
    """Claim the due calls of a key set and run them through the worker's code, in this process."""
    for claimed in claim(key_set, 100).calls:
        execute(claimed.id, claimed.dispatch_no)


def test_backend_states_what_it_supports():
    assert default_task_backend.supports_defer
    assert default_task_backend.supports_async_task
    assert default_task_backend.supports_get_result
    assert default_task_backend.supports_priority


def test_enqueue_inside_a_rolled_back_transaction_stores_nothing():
    with pytest.raises(RuntimeError), transaction.atomic():
        result = add.enqueue(1, 2)
        assert CallQueue.objects.filter(pk=int(result.id)).exists()
        raise RuntimeError("the view failed")
    assert not CallQueue.objects.exists()
    with pytest.raises(TaskResultDoesNotExist):
        add.get_result(result.id)


def test_enqueue_stores_a_ready_call_with_priority_run_after_and_queue():
    later = datetime.now(UTC) + timedelta(hours=1)
    result = add.using(priority=7, run_after=later, queue_name="tasks-other").enqueue(2, b=3)
    assert result.status == TaskResultStatus.READY
    call = CallQueue.objects.get(pk=int(result.id))
    assert (call.method, call.status, call.priority, call.queue) == ("task", "pending", 7, "tasks-other")
    assert call.run_at == later
    assert call.params["args"] == [2] and call.params["kwargs"] == {"b": 3}
    read = add.get_result(result.id)
    assert (read.status, read.args, read.kwargs, read.task.priority) == (TaskResultStatus.READY, [2], {"b": 3}, 7)
    assert read.task.queue_name == "tasks-other"
    # The default queue is the dispatcher's default Celery queue.
    assert CallQueue.objects.get(pk=int(add.enqueue(1, 1).id)).queue == ""


def test_arguments_that_are_not_json_serialisable_are_refused_at_enqueue():
    with pytest.raises(TypeError, match="JSON-serialisable"):
        add.enqueue(object(), 1)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        add.enqueue({1, 2}, 1)
    with pytest.raises(InvalidCall, match="missing a required argument"):
        add.enqueue(1)
    assert not CallQueue.objects.exists()


def test_a_task_call_cannot_be_stored_by_send():
    params = {"task": "tests.testapp.tasks.add", "args": [1, 2], "kwargs": {}}
    with pytest.raises(InvalidCall, match="stored by Django Tasks"):
        CallQueue.objects.send("task", params)
    assert not CallQueue.objects.exists()


def test_keys_from_options_bind_the_policy():
    edit.set_policy("partner:acme", 2, timedelta(minutes=1))
    results = [fetch_account.enqueue("http://127.0.0.1:9/", "acme", page=n) for n in range(3)]
    other = fetch_account.enqueue("http://127.0.0.1:9/", account="globex")
    calls = {c.pk: c for c in CallQueue.objects.all()}
    assert calls[int(results[0].id)].keys == ["partner", "partner:acme"]
    assert calls[int(other.id)].keys == ["partner", "partner:globex"]
    claimed = claim(calls[int(results[0].id)].key_set, 100)
    assert len(claimed.calls) == 2 and claimed.verdict.blocked
    assert claim(calls[int(other.id)].key_set, 100).calls


def test_results_read_back_done_and_failed_with_the_error():
    ok = add.enqueue(2, 3)
    later = async_to_sync(add_later.aenqueue)(4, 5)  # as an async view would, on this thread
    bad = fail.enqueue("no such account")
    for result in (ok, later, bad):
        run_due(CallQueue.objects.get(pk=int(result.id)).key_set)
    done = add.get_result(ok.id)
    assert (done.status, done.return_value, done.attempts, done.errors) == (TaskResultStatus.SUCCESSFUL, 5, 1, [])
    assert done.finished_at is not None and done.started_at is not None
    assert add_later.get_result(later.id).return_value == 9
    failed = fail.get_result(bad.id)
    assert failed.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in failed.errors] == [LookupError]
    assert "no such account" in failed.errors[0].traceback
    with pytest.raises(ValueError, match="failed"):
        failed.return_value  # noqa: B018 - the property raises
    bad.refresh()
    assert bad.status == TaskResultStatus.FAILED


def test_a_cancelled_task_reads_back_failed():
    from dispatcher.backends import TaskCancelled

    result = add.enqueue(1, 2)
    CallQueue.objects.cancel([int(result.id)])
    read = add.get_result(result.id)
    assert read.status == TaskResultStatus.FAILED and read.errors[0].exception_class is TaskCancelled


def test_get_result_of_an_unknown_id_raises():
    plain = CallQueue.objects.send("noop", {})
    for result_id in ("999999", "not-a-number", str(plain.pk)):
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(result_id)


def test_exception_path_is_the_class_the_worker_recorded_or_exception():
    from dispatcher.backends import exception_path

    assert exception_path("tests.testapp.tasks.QuotaGone: it broke") == "tests.testapp.tasks.QuotaGone"
    assert exception_path("ValueError: bad") == "builtins.ValueError"
    assert exception_path("SystemExit: ") == "builtins.SystemExit"
    # Nothing importable as an exception class: a row from before paths were recorded, or no class at all.
    for error in ("Boom: it broke", "lost: no result", "unreadable row: x", "", "os.path: not a class", "a b: c"):
        assert exception_path(error) == "builtins.Exception", error


@pytest.mark.postgres
@pytest.mark.slow
def test_tasks_reach_the_api_paced_by_their_keys_through_real_workers(procs, fake_api):
    edit.set_policy("partner:acme", 2, timedelta(seconds=1))
    results = [fetch_account.enqueue(f"{fake_api.url}/ok", "acme", page=n) for n in range(6)]
    failing = fail.enqueue("boom")
    procs.worker(procs.queue, concurrency=2)
    procs.dispenser()
    assert wait_until(lambda: not CallQueue.objects.exclude(status__in=CallQueue.FINISHED).exists(), 60, 0.3), procs.logs()

    read = [fetch_account.get_result(r.id) for r in results]
    assert [r.status for r in read] == [TaskResultStatus.SUCCESSFUL] * 6
    assert sorted(r.return_value["page"] for r in read) == list(range(6))
    assert fail.get_result(failing.id).errors[0].exception_class is LookupError
    starts = [t.timestamp() for t in StartLog.objects.filter(key="partner:acme").values_list("started_at", flat=True)]
    assert len(starts) == 6 and max_in_window(starts, 1.0) <= 2
    assert Counter(a.call for a in fake_api.arrivals) == {f"acme:{n}": 1 for n in range(6)}


def test_system_check_reports_keys_that_would_pace_nothing(settings):
    from dispatcher.backends import DispatcherBackend

    backend = DispatcherBackend("default", {"OPTIONS": {"keys": {
        "tests.testapp.tasks.fetch_account": ["partner:{account}"],
        "tests.testapp.tasks.fetch_acount": ["partner"],
        "tests.testapp.tasks.add": ["adder:{c}", "adder:{a"],
    }}})
    messages = [(m.id, m.msg) for m in backend.check()]
    assert [i for i, _ in messages] == ["dispatcher.E101", "dispatcher.E102", "dispatcher.E102"]
    assert "fetch_acount cannot be imported" in messages[0][1]
    assert "names c, which tests.testapp.tasks.add does not take" in messages[1][1]
    assert list(default_task_backend.check()) == []


@pytest.mark.parametrize("options", [
    {"keys": ["partner"]},
    {"keys": {"fetch_account": ["partner"]}},
    {"keys": {"tests.testapp.tasks.add": "partner"}},
    {"max_attempts": 0},
])
def test_bad_options_are_refused_with_the_setting_named(options):
    from django.core.exceptions import ImproperlyConfigured

    from dispatcher.backends import DispatcherBackend

    with pytest.raises(ImproperlyConfigured, match=r"TASKS\['default'\]\['OPTIONS'\]"):
        DispatcherBackend("default", {"OPTIONS": options})


@pytest.mark.skipif(django.VERSION >= (6,), reason="Django 6 ships django.tasks")
def test_the_app_loads_checks_and_runs_calls_without_the_backport(tmp_path):
    program = (
        "import sys\n"
        "sys.modules['django_tasks'] = None  # as if the tasks extra were not installed\n"
        "import django\n"
        "django.setup()\n"
        "from django.core.management import call_command\n"
        "from dispatcher.registry import get_handler\n"
        "from dispatcher.exceptions import UnknownMethod\n"
        "call_command('check')\n"
        "call_command('makemigrations', 'dispatcher', '--check', '--dry-run', verbosity=0)\n"
        "get_handler('http')\n"
        "try:\n"
        "    get_handler('task')\n"
        "except UnknownMethod:\n"
        "    print('no task method')\n"
    )
    # The embedded default (SQLite in a folder of its own): no database server, no secret key needed.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJANGO_") and k != "DATABASE_URL"}
    env["DJANGO_SETTINGS_MODULE"] = "project.settings"
    env["DISPATCHER_VAR_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no task method")
