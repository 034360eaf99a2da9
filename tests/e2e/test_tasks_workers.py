"""The Django Tasks contract with real Celery workers: what a task's run records and signals, under
the prefork and threads pools, read back by this process."""
from __future__ import annotations

import json
import os
import signal
from datetime import UTC, datetime

import pytest

from dispatcher.models import CallQueue
from support.processes import wait_until
from tests.testapp import tasks

try:
    from django.tasks import TaskResultStatus
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


# With 4 calls per message, a message's tasks start together and run in threads (greenlets) of its own.
@pytest.mark.parametrize(("pool", "per_message"), [("prefork", 1), ("threads", 1), ("gevent", 4)])
def test_a_worker_runs_tasks_as_the_framework_does(procs, tmp_path, pool, per_message):
    log = tmp_path / "signals.jsonl"
    ok = tasks.add.enqueue(2, 3)
    # An async task's event loop, run by asgiref, is seen by the other greenlets of a gevent worker,
    # whose database calls Django then refuses (SynchronousOnlyOperation): not run under gevent.
    later = tasks.add_later.enqueue(4, 5) if pool != "gevent" else tasks.add.enqueue(4, 5)
    own = tasks.own_id.enqueue()
    seen = tasks.context_seen.enqueue()
    failures = {
        "LookupError": (tasks.fail.enqueue("no such account"), LookupError, "LookupError: no such account\n"),
        "QuotaGone": (tasks.raise_own_error.enqueue("acme"), tasks.QuotaGone, "QuotaGone: no quota left for acme\n"),
        "SystemExit": (tasks.raise_system_exit.enqueue(), SystemExit, "SystemExit: the task asked to exit\n"),
        "exit()": (tasks.call_exit.enqueue(), SystemExit, "SystemExit: 3\n"),
        "KeyboardInterrupt": (
            tasks.raise_keyboard_interrupt.enqueue(), KeyboardInterrupt, "KeyboardInterrupt: the task was interrupted\n",
        ),
    }
    procs.worker(procs.queue, concurrency=2, pool=pool, extra_env={"TEST_TASK_SIGNALS": str(log)})
    procs.dispenser(extra_env={"DISPATCHER_CALLS_PER_MESSAGE": str(per_message)})
    finished = wait_until(lambda: not CallQueue.objects.exclude(status__in=CallQueue.FINISHED).exists(), 60, 0.3)
    assert finished, procs.logs()
    assert procs.exited() == [], procs.logs()  # no task stopped the worker
    assert "WorkerLostError" not in procs.logs()  # nor, under prefork, its pool process

    for result, value in ((ok, 5), (later, 9)):
        result.refresh()
        assert (result.status, result.return_value, result.attempts) == (TaskResultStatus.SUCCESSFUL, value, 1)
        (worker,) = result.worker_ids
        assert worker.rsplit(":", 1)[1] != str(os.getpid())
        assert result.enqueued_at <= result.started_at <= result.finished_at
    assert tasks.own_id.get_result(own.id).return_value == own.id
    context = tasks.context_seen.get_result(seen.id).return_value
    assert (context["attempt"], context["id"], context["status"], context["started"]) == (1, seen.id, "RUNNING", True)
    for name, (result, kind, ending) in failures.items():
        result.refresh()
        assert result.status == TaskResultStatus.FAILED, name
        (error,) = result.errors
        assert error.exception_class is kind, name
        assert error.traceback.endswith(ending), (name, error.traceback)

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    by_id: dict[str, list[tuple[str, str]]] = {}
    for line in lines:
        assert line["sender"] == "DispatcherBackend"
        by_id.setdefault(line["id"], []).append((line["signal"], line["status"]))
    for result in (ok, later, own, seen):
        assert by_id[result.id] == [("started", "RUNNING"), ("finished", "SUCCESSFUL")]
    for name, (result, kind, _) in failures.items():
        assert by_id[result.id] == [("started", "RUNNING"), ("finished", "FAILED")], name
        (failed,) = [line for line in lines if line["id"] == result.id and line["signal"] == "finished"]
        assert failed["errors"] == [f"{kind.__module__}.{kind.__qualname__}"]


def test_a_task_whose_worker_was_killed_reads_lost_after_the_rescue(procs):
    from dispatcher.backends import TaskLost

    result = tasks.sleep_for.enqueue(120)
    worker = procs.worker(procs.queue, concurrency=1)
    procs.dispenser()
    assert wait_until(lambda: tasks.sleep_for.get_result(result.id).status == TaskResultStatus.RUNNING, 60, 0.2), procs.logs()
    procs.stop(worker, signal.SIGKILL)
    running = tasks.sleep_for.get_result(result.id)
    assert running.status == TaskResultStatus.RUNNING and len(running.worker_ids) == 1
    # Past DISPATCHER_RUN_TIMEOUT: the rescue sweep finds it.
    CallQueue.objects.filter(pk=int(result.id)).update(started_at=datetime(2000, 1, 1, tzinfo=UTC))
    assert CallQueue.objects.rescue().failed == 1
    result.refresh()
    assert (result.status, result.worker_ids) == (TaskResultStatus.FAILED, running.worker_ids)
    (error,) = result.errors
    assert error.exception_class is TaskLost and error.exception_class_path == "dispatcher.backends.TaskLost"


def test_a_task_on_another_queue_waits_for_a_worker_of_that_queue(procs):
    other_queue = f"{procs.queue}-other"
    plain = tasks.add.enqueue(1, 2)
    queued = tasks.add.using(queue_name="tasks-other").enqueue(3, 4)
    CallQueue.objects.filter(pk=int(queued.id)).update(queue=other_queue)  # this run's own name for it
    procs.worker(procs.queue, concurrency=1)
    procs.dispenser()
    assert wait_until(lambda: tasks.add.get_result(plain.id).status == TaskResultStatus.SUCCESSFUL, 60, 0.2), procs.logs()
    assert tasks.add.get_result(queued.id).status == TaskResultStatus.READY
    procs.worker(other_queue, concurrency=1)
    assert wait_until(lambda: tasks.add.get_result(queued.id).status == TaskResultStatus.SUCCESSFUL, 60, 0.2), procs.logs()
    done = [tasks.add.get_result(r.id) for r in (plain, queued)]
    assert [r.return_value for r in done] == [3, 7]
    assert done[0].worker_ids != done[1].worker_ids  # each queue's own worker
    assert done[1].task.queue_name == "tasks-other"
