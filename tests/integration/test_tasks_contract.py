"""The Django Tasks contract kept by dispatcher.backends, run in this process through the worker's code:
statuses and their moves, results read back, errors with class and traceback, BaseException,
signals, takes_context, run_after and priorities, queues, lost runs, checks."""
from __future__ import annotations

import logging
import os
import socket
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import transaction

from dispatcher.backends import DispatcherBackend
from dispatcher.models import Attempt, CallQueue
from dispatcher.worker import execute
from tests.claims import claim
from tests.testapp import tasks

try:
    from django.tasks import TaskResultStatus, default_task_backend
    from django.tasks import signals as tasks_signals
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskResultStatus, default_task_backend
    from django_tasks import signals as tasks_signals
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started

    try:
        from django_tasks.exceptions import InvalidTask
    except ImportError:
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

pytestmark = pytest.mark.django_db(transaction=True)

WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
# Where the framework logs each state: django.tasks, or the backport's own logger on Django 5.2.
TASKS_LOGGER = tasks_signals.logger.name


def run_due(limit: int = 100) -> list[int]:
    """Claim the due calls of every waiting key set and run them through the worker's code; return their ids."""
    ran = []
    key_sets = CallQueue.objects.filter(status=CallQueue.Status.PENDING).values_list("key_set", flat=True).distinct()
    for key_set in sorted(set(key_sets)):
        for claimed in claim(key_set, limit).calls:
            execute(claimed.id, claimed.dispatch_no)
            ran.append(claimed.id)
    return ran


@pytest.fixture
def signals():
    """Record every Tasks signal sent: (name, sender, the result's status, the result)."""
    sent = []

    def recorder(name):
        def receive(sender, task_result, **kwargs):
            sent.append((name, sender, task_result.status, task_result))
        return receive

    receivers = {signal: recorder(name) for signal, name in
                 ((task_enqueued, "enqueued"), (task_started, "started"), (task_finished, "finished"))}
    for signal, receiver in receivers.items():
        signal.connect(receiver)
    yield sent
    for signal, receiver in receivers.items():
        signal.disconnect(receiver)


@pytest.fixture
def retrying(settings):
    """The default backend with two attempts per task."""
    settings.TASKS = {"default": {**settings.TASKS["default"], "OPTIONS": {"max_attempts": 2}}}
    return default_task_backend


# --- results and statuses --------------------------------------------------------------------


def test_a_task_moves_from_ready_to_successful_with_its_times_and_worker():
    result = tasks.add.enqueue(2, 3)
    assert (result.status, result.is_finished, result.attempts, result.worker_ids) == (TaskResultStatus.READY, False, 0, [])
    assert result.enqueued_at is not None and result.started_at is None and result.finished_at is None
    with pytest.raises(ValueError, match="not finished|has not"):
        result.return_value  # noqa: B018 - the property raises
    run_due()
    assert result.status == TaskResultStatus.READY  # a result is a snapshot until refreshed
    result.refresh()
    assert (result.status, result.is_finished, result.return_value, result.errors) == (TaskResultStatus.SUCCESSFUL, True, 5, [])
    assert result.worker_ids == [WORKER_ID] and result.attempts == 1
    assert result.enqueued_at <= result.started_at == result.last_attempted_at <= result.finished_at


def test_a_claimed_task_is_still_ready_and_a_started_one_is_running():
    result = tasks.add.enqueue(1, 1)
    call = CallQueue.objects.get(pk=int(result.id))
    (claimed,) = claim(call.key_set, 10).calls
    assert tasks.add.get_result(result.id).status == TaskResultStatus.READY
    assert CallQueue.objects.start(claimed.id, claimed.dispatch_no, "host:1").state == "started"
    running = tasks.add.get_result(result.id)
    assert (running.status, running.worker_ids, running.is_finished) == (TaskResultStatus.RUNNING, ["host:1"], False)
    assert running.started_at is not None and running.finished_at is None


def test_get_result_reads_back_what_enqueue_returned():
    later = datetime.now(UTC) + timedelta(hours=2)
    for task in (tasks.add, tasks.add.using(priority=-5, queue_name="tasks-other", run_after=later)):
        result = task.enqueue(1, b=2)
        read = default_task_backend.get_result(result.id)
        assert read == result
        assert (read.task.priority, read.task.queue_name, read.task.run_after) == (task.priority, task.queue_name, task.run_after)
        assert read.task.func is tasks.add.func and read.backend == "default"


def test_aget_result_and_arefresh_read_the_call_from_async_code():
    result = async_to_sync(tasks.add.aenqueue)(20, 22)
    assert async_to_sync(tasks.add.aget_result)(result.id) == result
    assert async_to_sync(default_task_backend.aget_result)(result.id) == result
    run_due()
    async_to_sync(result.arefresh)()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(default_task_backend.aget_result)("123456789")


def test_get_result_of_an_id_that_is_no_task_raises_does_not_exist():
    plain = CallQueue.objects.send("noop", {})
    for result_id in ("123456789", "not-a-number", "", str(plain.pk), "1e3"):
        with pytest.raises(TaskResultDoesNotExist):
            default_task_backend.get_result(result_id)


@pytest.mark.parametrize("path", ["tests.testapp.tasks.not_a_task", "tests.testapp.tasks.gone", "tests.nowhere.gone"])
def test_a_stored_call_whose_path_names_no_task_reads_as_missing_and_fails_when_run(path):
    result = tasks.noop.enqueue()
    call = CallQueue.objects.get(pk=int(result.id))
    CallQueue.objects.filter(pk=call.pk).update(params={**call.params, "task": path})
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result.id)
    run_due()
    call.refresh_from_db()
    assert call.status == CallQueue.Status.FAILED and call.attempts == 1
    if path.endswith("not_a_task"):
        assert "is not a Django Tasks task" in call.last_error
    else:
        assert "ImportError" in call.last_error and "ImportError" in call.last_traceback


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("task", "kind", "ending"), [
    (tasks.fail, LookupError, "LookupError: no such account\n"),
    (tasks.raise_own_error, tasks.QuotaGone, "QuotaGone: no quota left for acme\n"),
    (tasks.raise_system_exit, SystemExit, "SystemExit: the task asked to exit\n"),
    (tasks.raise_keyboard_interrupt, KeyboardInterrupt, "KeyboardInterrupt: the task was interrupted\n"),
    (tasks.call_exit, SystemExit, "SystemExit: 3\n"),
    (tasks.raise_halt, tasks.Halt, "Halt: halted\n"),
])
def test_a_task_that_raises_fails_with_its_exception_class_and_traceback(task, kind, ending):
    result = task.enqueue(*(["no such account"] if task is tasks.fail else ["acme"] if task is tasks.raise_own_error else []))
    assert run_due() == [int(result.id)]  # the run neither raised nor stopped this process
    result.refresh()
    assert (result.status, result.is_finished, result.attempts) == (TaskResultStatus.FAILED, True, 1)
    (error,) = result.errors
    assert error.exception_class is kind
    assert error.exception_class_path == f"{kind.__module__}.{kind.__qualname__}"
    assert error.traceback.startswith("Traceback (most recent call last):") and error.traceback.endswith(ending)
    with pytest.raises(ValueError, match="failed"):
        result.return_value  # noqa: B018 - the property raises
    assert result.enqueued_at <= result.started_at <= result.finished_at


def test_the_exception_class_comes_from_its_type_not_from_the_message():
    result = tasks.fail.enqueue("builtins.KeyboardInterrupt: looks like one\nValueError: and another")
    run_due()
    result.refresh()
    assert result.errors[0].exception_class is LookupError


def test_an_exception_inside_an_exception_and_an_unserialisable_value_fail_as_the_framework_records_them():
    nested, unserialisable = tasks.raise_nested.enqueue(), tasks.return_unserialisable.enqueue()
    run_due()
    nested.refresh()
    unserialisable.refresh()
    assert nested.errors[0].exception_class is ValueError
    assert 'raise ValueError(ValueError("the inner one"))' in nested.errors[0].traceback  # the line that raised
    assert nested.errors[0].traceback.endswith("ValueError: the inner one\n")
    assert unserialisable.status == TaskResultStatus.FAILED
    assert unserialisable.errors[0].exception_class is TypeError
    assert "Unsupported type" in unserialisable.errors[0].traceback


def test_a_handler_that_exits_fails_its_call_and_not_the_worker():
    call = CallQueue.objects.send("exits", {})
    run_due()
    call.refresh_from_db()
    assert call.status == CallQueue.Status.FAILED and call.attempts == 1
    assert call.last_error.startswith("SystemExit:") and call.last_traceback.endswith("SystemExit: 4\n")


def test_a_lost_run_reads_as_failed_with_the_lost_class():
    from dispatcher.backends import TaskLost

    result = tasks.add.enqueue(1, 2)
    call = CallQueue.objects.get(pk=int(result.id))
    (claimed,) = claim(call.key_set, 10).calls
    CallQueue.objects.start(claimed.id, claimed.dispatch_no, "host:9")  # then the worker dies
    CallQueue.objects.filter(pk=call.pk).update(started_at=datetime(2000, 1, 1, tzinfo=UTC))
    assert CallQueue.objects.rescue().failed == 1
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.worker_ids == ["host:9"]
    (error,) = result.errors
    assert error.exception_class is TaskLost and "DISPATCHER_RUN_TIMEOUT" in error.traceback


def test_a_retried_task_lists_each_failed_attempt(retrying):
    result = tasks.context_seen.enqueue(fail_until=2)
    run_due()
    assert tasks.context_seen.get_result(result.id).status == TaskResultStatus.READY  # waiting for its retry
    CallQueue.objects.filter(pk=int(result.id)).update(run_at=datetime(2000, 1, 1, tzinfo=UTC))
    run_due()
    result.refresh()
    assert (result.status, result.attempts, result.worker_ids) == (TaskResultStatus.SUCCESSFUL, 2, [WORKER_ID] * 2)
    assert [e.exception_class for e in result.errors] == [RuntimeError]
    assert result.return_value["attempt"] == 2


# --- signals ---------------------------------------------------------------------------------


def test_enqueued_started_and_finished_are_sent_with_the_result(signals):
    result = tasks.add.enqueue(3, 4)
    assert [(name, sender, status) for name, sender, status, _ in signals] == [
        ("enqueued", DispatcherBackend, TaskResultStatus.READY),
    ]
    run_due()
    assert [(name, sender, status) for name, sender, status, _ in signals][1:] == [
        ("started", DispatcherBackend, TaskResultStatus.RUNNING),
        ("finished", DispatcherBackend, TaskResultStatus.SUCCESSFUL),
    ]
    started, finished = signals[1][3], signals[2][3]
    assert started.id == finished.id == result.id
    assert started.worker_ids == [WORKER_ID] and started.started_at is not None and started.finished_at is None
    assert finished.return_value == 7 and finished.finished_at >= finished.started_at
    assert finished.args == [3, 4] and finished.task.func is tasks.add.func


def test_finished_carries_the_failure_and_is_sent_once_the_outcome_is_final(signals, retrying):
    failing = tasks.context_seen.enqueue(fail_until=5)
    run_due()
    assert [name for name, *_ in signals] == ["enqueued", "started"]  # a retry follows: not finished yet
    CallQueue.objects.filter(pk=int(failing.id)).update(run_at=datetime(2000, 1, 1, tzinfo=UTC))
    run_due()
    assert [name for name, *_ in signals] == ["enqueued", "started", "started", "finished"]
    finished = signals[-1][3]
    assert finished.status == TaskResultStatus.FAILED and finished.attempts == 2
    assert [e.exception_class for e in finished.errors] == [RuntimeError, RuntimeError]
    assert finished.errors[-1].traceback.endswith("RuntimeError: attempt 2 fails\n")


def test_a_task_that_exits_still_finishes_failed(signals):
    tasks.raise_system_exit.enqueue()
    run_due()
    assert [(name, status) for name, _, status, _ in signals] == [
        ("enqueued", TaskResultStatus.READY), ("started", TaskResultStatus.RUNNING), ("finished", TaskResultStatus.FAILED),
    ]
    assert signals[-1][3].errors[0].exception_class is SystemExit


def test_enqueued_waits_for_the_transaction_to_commit(signals):
    with transaction.atomic():
        tasks.add.enqueue(1, 1)
        assert signals == []
    assert [name for name, *_ in signals] == ["enqueued"]
    with pytest.raises(RuntimeError), transaction.atomic():
        tasks.add.enqueue(1, 1)
        raise RuntimeError("rolled back")
    assert [name for name, *_ in signals] == ["enqueued"]


def test_djangos_task_log_reads_each_state(caplog):
    caplog.set_level(logging.DEBUG, logger=TASKS_LOGGER)
    ok, bad = tasks.add.enqueue(1, 2), tasks.fail.enqueue("nope")
    run_due()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == TASKS_LOGGER]
    assert any(f"id={ok.id}" in text and "state=RUNNING" in text for _, text in lines)
    assert any(f"id={ok.id}" in text and "state=SUCCESSFUL" in text for _, text in lines)
    failed = [r for r in caplog.records if r.name == TASKS_LOGGER and f"id={bad.id}" in r.getMessage() and "state=FAILED" in r.getMessage()]
    assert failed and failed[0].levelno == logging.ERROR and failed[0].exc_info and failed[0].exc_info[0] is LookupError


# --- takes_context ---------------------------------------------------------------------------


def test_a_task_that_takes_a_context_gets_its_result_and_attempt():
    own, seen = tasks.own_id.enqueue(), tasks.context_seen.enqueue()
    run_due()
    own.refresh()
    seen.refresh()
    assert own.return_value == own.id
    assert seen.return_value == {
        "attempt": 1, "id": seen.id, "status": "RUNNING", "args": [], "kwargs": {}, "worker_ids": [WORKER_ID], "started": True,
    }


def test_a_context_task_is_enqueued_with_its_own_arguments_only():
    result = tasks.context_seen.enqueue(fail_until=0)
    assert result.kwargs == {"fail_until": 0}
    with pytest.raises(TypeError):
        tasks.context_seen.enqueue(1, 2)


def test_a_task_that_takes_a_context_without_naming_it_first_is_refused():
    from dispatcher.backends import Task

    def needs_context(ctx, x):  # pragma: no cover - never runs
        return x

    needs_context.__qualname__ = "needs_context"  # a module-level function, as the framework requires
    with pytest.raises(InvalidTask, match="context"):
        Task(func=needs_context, takes_context=True, backend="default")


# --- run_after, priorities, queues -----------------------------------------------------------


def test_a_task_runs_only_once_its_run_after_has_passed():
    later = tasks.add.using(run_after=datetime.now(UTC) + timedelta(hours=1)).enqueue(1, 1)
    assert run_due() == []
    CallQueue.objects.filter(pk=int(later.id)).update(run_at=datetime.now(UTC) - timedelta(seconds=1))
    assert run_due() == [int(later.id)]


def test_due_tasks_run_by_priority_then_earliest_run_after_then_enqueue_order():
    now = datetime.now(UTC)
    order = [
        tasks.noop.using(priority=20, run_after=now - timedelta(hours=2)).enqueue("old"),
        tasks.noop.using(priority=20, run_after=now - timedelta(hours=10)).enqueue("very old"),
        tasks.noop.using(run_after=now + timedelta(hours=10)).enqueue("far future"),
        tasks.noop.using(priority=10, run_after=now + timedelta(hours=10)).enqueue("high, far future"),
        tasks.noop.using(priority=10).enqueue("high"),
        tasks.noop.using(priority=2).enqueue("low"),
        tasks.noop.using(priority=-2).enqueue("lower"),
        tasks.noop.using(priority=2, run_after=now - timedelta(minutes=1)).enqueue("low, a minute ago"),
        tasks.noop.using(priority=2).enqueue("low, later"),
    ]
    taken = []
    for _ in range(len(order)):  # one call per claim: the order the dispenser takes them in
        taken += [CallQueue.objects.get(pk=i).params["args"][0] for i in run_due(limit=1)]
    assert taken == ["very old", "old", "high", "low, a minute ago", "low", "low, later", "lower"]


def test_priority_outside_the_framework_range_is_refused():
    with pytest.raises(InvalidTask, match="priority"):
        tasks.add.using(priority=101).enqueue(1, 1)
    assert not CallQueue.objects.exists()


def test_a_queue_name_is_the_calls_celery_queue_and_unknown_queues_are_refused():
    other = tasks.add.using(queue_name="tasks-other").enqueue(1, 1)
    assert CallQueue.objects.get(pk=int(other.id)).queue == "tasks-other"
    with pytest.raises(InvalidTask, match="Queue 'nowhere'"):
        tasks.add.using(queue_name="nowhere").enqueue(1, 1)
    assert CallQueue.objects.count() == 1


def test_a_naive_run_after_is_refused_with_time_zones_on():
    with pytest.raises(InvalidTask, match="aware"):
        tasks.add.using(run_after=datetime(2030, 1, 1)).enqueue(1, 1)


# --- arguments and checks --------------------------------------------------------------------


def test_cyclic_or_very_deep_arguments_are_refused_as_bad_values():
    cyclic: list = []
    cyclic.append(cyclic)
    deep: list = []
    inner = deep
    for _ in range(5000):
        inner.append([])
        inner = inner[0]
    for argument in (cyclic, deep, {"a": cyclic}):
        with pytest.raises(ValueError, match="JSON"):
            tasks.noop.enqueue(argument)
        with pytest.raises(TypeError, match="JSON"):
            tasks.noop.enqueue(argument)
    assert not CallQueue.objects.exists()


def test_check_reports_the_app_missing_from_installed_apps(settings):
    from dispatcher.backends import DispatcherBackend

    backend = DispatcherBackend("default", {"OPTIONS": {}})
    assert backend.check() == []
    settings.INSTALLED_APPS = [app for app in settings.INSTALLED_APPS if app != "dispatcher"]
    (error,) = backend.check()
    assert error.id == "dispatcher.E100" and "dispatcher" in error.hint


def test_attempts_record_the_exception_class_path():
    tasks.raise_own_error.enqueue("acme")
    run_due()
    (attempt,) = Attempt.objects.all()
    assert attempt.error == "tests.testapp.tasks.QuotaGone: no quota left for acme"


def test_enqueue_and_reading_a_ready_task_take_one_query_each(django_assert_num_queries):
    with django_assert_num_queries(1):
        result = tasks.noop.enqueue(1)
    with django_assert_num_queries(1):
        assert tasks.noop.get_result(result.id) == result
    run_due()
    with django_assert_num_queries(2):  # the call, then its attempts
        result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL


def test_reading_a_result_through_another_task_is_refused():
    result = tasks.add_later.enqueue(1, 2)
    with pytest.raises(Exception, match="Task does not match") as refused:
        tasks.add.get_result(result.id)
    assert type(refused.value).__name__ == "TaskResultMismatch"


def test_a_positional_tuple_of_arguments_reads_back_as_a_list():
    result = default_task_backend.enqueue(tasks.add, (1, 2), {})
    assert result.args == [1, 2] and tasks.add.get_result(result.id) == result
    with pytest.raises(TypeError, match="Unsupported type: <class 'datetime.datetime'>"):
        tasks.noop.enqueue(datetime.now(UTC))


def test_a_long_traceback_keeps_its_end_naming_the_exception():
    result = tasks.raise_chained.enqueue(80)
    run_due()
    result.refresh()
    (error,) = result.errors
    assert error.exception_class is ValueError and error.traceback.endswith("ValueError: link 80\n")
    assert "ValueError: link 1\n" not in error.traceback  # the oldest causes are cut


@pytest.mark.parametrize("change", [{"backend": "gone"}, {"queue_name": "nowhere"}])
def test_a_stored_task_whose_backend_or_queue_is_gone_reads_as_missing_and_fails_when_run(change):
    result = tasks.noop.enqueue()
    call = CallQueue.objects.get(pk=int(result.id))
    CallQueue.objects.filter(pk=call.pk).update(params={**call.params, **change})
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result.id)
    run_due()
    call.refresh_from_db()
    assert call.status == CallQueue.Status.FAILED and "cannot run as it was enqueued" in call.last_error
