"""A Django Tasks backend: ``@task`` functions enqueued with ``.enqueue()`` become paced calls.

``TASKS = {"default": {"BACKEND": "dispatcher.backends.DispatcherBackend", "OPTIONS": {...}}}``
works with ``django.tasks`` (Django 6.0 and later) and with the ``django-tasks`` backport on
Django 5.2. A task enqueued here is a call of the built-in ``task`` handler: it is stored in the
caller's transaction, dispensed under the policies of its keys, run by the same Celery workers, and
read back with ``get_result()``. OPTIONS:

- ``keys``: ``{"app.tasks.fn": ["partner", "partner:{account_id}"]}``, a task's dotted path to key
  templates formatted from its arguments (by parameter name, positional ones included);
- ``max_attempts``: attempts a task gets (default 1: a task that raises is FAILED, as in Django;
  a task that raises ``dispatcher.RateLimited`` waits without spending one).
"""
from __future__ import annotations

import contextvars
import inspect
import re
import string
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from dispatcher import tables
from dispatcher.exceptions import InvalidParams, PermanentError
from dispatcher.keys import resolve_keys
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status

try:  # Django >= 6.0 ships the framework (the stubs checked against are Django 5.2's: no django.tasks).
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, Task, TaskResult, TaskResultStatus  # type: ignore[import-untyped]
    from django.tasks.backends.base import BaseTaskBackend  # type: ignore[import-untyped]
    from django.tasks.base import TaskError  # type: ignore[import-untyped]
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist  # type: ignore[import-untyped]
    from django.tasks.signals import task_enqueued  # type: ignore[import-untyped]
    from django.utils.json import normalize_json  # type: ignore[import-untyped]
except ImportError:  # Django 5.2: the django-tasks backport.
    try:
        from django_tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued
        from django_tasks.utils import normalize_json
    except ImportError as exc:
        raise ImproperlyConfigured(
            "dispatcher.backends.DispatcherBackend needs Django Tasks: django.tasks (Django 6.0 or later) "
            "or, on Django 5.2, the django-tasks backport (pip install 'django-call-dispatcher[tasks]')"
        ) from exc
    try:
        from django_tasks.exceptions import InvalidTask  # type: ignore[attr-defined]  # newer backports only
    except ImportError:  # the backport's releases up to 0.12 name it InvalidTaskError
        from django_tasks.exceptions import InvalidTaskError as InvalidTask

if TYPE_CHECKING:
    from dispatcher.models import Attempt, CallQueue

# The built-in handler that runs a task (registered in dispatcher.handlers).
TASK_METHOD = "task"
TASK_PARAMS = {"task", "backend", "queue_name", "args", "kwargs"}

# Set while this backend stores a task's call, so that the ``task`` method cannot be sent any
# other way (the HTTP API or the admin would otherwise run any task with any arguments).
_enqueuing: contextvars.ContextVar[bool] = contextvars.ContextVar("dispatcher_enqueuing_task", default=False)


class InvalidTaskArguments(InvalidParams, TypeError):
    """A task's arguments are not JSON-serialisable or do not fit its signature; nothing was stored."""


class TaskCancelled(Exception):
    """The task's call was cancelled before it ran; its result shows FAILED with this error."""


class DispatcherBackend(BaseTaskBackend):
    """Stores each enqueued task as a call; the dispenser paces it and a Celery worker runs it."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.keys = _key_templates(alias, self.options.get("keys", {}))
        self.max_attempts = self.options.get("max_attempts", 1)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]['OPTIONS']['max_attempts'] must be a whole number >= 1")

    def validate_task(self, task: Task) -> None:
        """Refuse what the framework refuses, and a task that takes a context (not passed yet)."""
        super().validate_task(task)
        if task.takes_context:
            raise InvalidTask("DispatcherBackend does not pass a TaskContext; define the task without takes_context")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Report OPTIONS["keys"] entries that name no task of this backend, or no argument of it."""
        messages: list[checks.CheckMessage] = []
        for path, templates in self.keys.items():
            where = f"TASKS[{self.alias!r}]['OPTIONS']['keys'][{path!r}]"
            try:
                task = import_string(path)
            except ImportError as exc:
                task, problem = None, f"cannot be imported ({exc})"
            else:
                problem = "" if isinstance(task, Task) else "is not a @task"
            if task is not None and not problem and task.backend != self.alias:
                problem = f"runs on the backend {task.backend!r}, not {self.alias!r}"
            if problem:
                messages.append(checks.Error(f"{where}: {path} {problem}, so nothing is paced by these keys",
                                             id="dispatcher.E101"))
                continue
            parameters = inspect.signature(task.func).parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            for template in templates:
                try:
                    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
                except ValueError as exc:
                    messages.append(checks.Error(f"{where}: bad key template {template!r}: {exc}", id="dispatcher.E102"))
                    continue
                missing = sorted(fields - set(parameters))
                if missing and not takes_any:
                    messages.append(checks.Error(
                        f"{where}: key template {template!r} names {', '.join(missing)}, which {path} does not take",
                        id="dispatcher.E102",
                    ))
        return messages

    def enqueue(self, task: Task, args: Any, kwargs: Any) -> TaskResult:
        """Store the task as a call in the caller's transaction; return its READY result."""
        self.validate_task(task)
        args, kwargs = _json_arguments(task, args, kwargs)
        # Bound even without key templates: arguments that do not fit the task are refused now.
        named = _named_arguments(task, args, kwargs)
        templates = self.keys.get(task.module_path, ())
        keys = resolve_keys(templates, None, named) if templates else None
        params = {
            "task": task.module_path, "backend": self.alias, "queue_name": task.queue_name,
            "args": args, "kwargs": kwargs,
        }
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # USE_TZ = False: the project's time zone
            run_at = timezone.make_aware(run_at)
        token = _enqueuing.set(True)
        try:
            call = tables.CallQueue.objects.send(
                TASK_METHOD, params, keys=keys, priority=task.priority, run_at=run_at,
                max_attempts=self.max_attempts, queue=None if task.queue_name == DEFAULT_TASK_QUEUE_NAME else task.queue_name,
            )
        finally:
            _enqueuing.reset(token)
        result = self._result(call, task, [])
        # The task exists only if the caller's transaction commits.
        transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result), robust=True)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """Return the task's result as its call stands now; raise TaskResultDoesNotExist if none."""
        try:
            call = tables.CallQueue.objects.get(pk=int(result_id), method=TASK_METHOD)
        except (TypeError, ValueError, tables.CallQueue.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        try:
            task = import_string(call.params["task"])
        except (ImportError, KeyError) as exc:
            raise TaskResultDoesNotExist(f"{result_id}: its task cannot be imported ({exc})") from None
        if call.params.get("queue_name") not in (None, task.queue_name) or call.priority != task.priority:
            task = task.using(priority=call.priority, queue_name=call.params.get("queue_name"))
        return self._result(call, task, list(call.attempt_set.all()))

    def _result(self, call: CallQueue, task: Task, attempts: list[Attempt]) -> TaskResult:
        status, errors = _status_and_errors(call, attempts)
        result = TaskResult(
            task=task,
            id=str(call.pk),
            status=status,
            enqueued_at=call.created_at if isinstance(call.created_at, datetime) else None,
            started_at=attempts[0].started_at if attempts else None,
            finished_at=call.finished_at if status in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED) else None,
            last_attempted_at=attempts[-1].started_at if attempts else None,
            args=call.params.get("args", []),
            kwargs=call.params.get("kwargs", {}),
            backend=self.alias,
            errors=errors,
            worker_ids=[attempt.worker for attempt in attempts],
        )
        if status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", call.result)
        return result


def _key_templates(alias: str, option: Any) -> dict[str, tuple[str, ...]]:
    """Return OPTIONS["keys"] checked: a task's dotted path to a list of key templates."""
    where = f"TASKS[{alias!r}]['OPTIONS']['keys']"
    if not isinstance(option, Mapping):
        raise ImproperlyConfigured(f"{where} must be a dict of a task's dotted path to a list of key templates")
    templates = {}
    for path, keys in option.items():
        if not isinstance(path, str) or "." not in path:
            raise ImproperlyConfigured(f"{where}: {path!r} is not a task's dotted path, like 'app.tasks.fn'")
        if isinstance(keys, str) or not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise ImproperlyConfigured(f"{where}[{path!r}] must be a list of key templates, like ['partner:{{account}}']")
        templates[path] = tuple(keys)
    return templates


def _json_arguments(task: Task, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Return the arguments as the task will receive them (JSON), or raise InvalidTaskArguments."""
    try:
        return normalize_json(list(args)), normalize_json(dict(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidTaskArguments(f"{task.module_path}: arguments must be JSON-serialisable ({exc})") from None


def _named_arguments(task: Task, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return the task's arguments by parameter name (defaults included), for its key templates."""
    try:
        bound = inspect.signature(task.func).bind(*args, **kwargs)
    except TypeError as exc:
        raise InvalidTaskArguments(f"{task.module_path}: {exc}") from None
    bound.apply_defaults()
    named = dict(bound.arguments)
    for parameter in bound.signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(parameter.name, {}))
    return named


def _status_and_errors(call: CallQueue, attempts: list[Attempt]) -> tuple[TaskResultStatus, list[TaskError]]:
    """Map the call's status and attempt history to the task's status and errors."""
    errors = []
    failed = [a for a in attempts if a.outcome in (Outcome.ERROR, Outcome.FAILED, Outcome.LOST)]
    for attempt in failed:
        last = attempt is failed[-1]
        trace = call.last_traceback if last and call.last_traceback else attempt.error
        errors.append(TaskError(exception_class_path=exception_path(attempt.error, trace), traceback=trace))
    status = call.status
    if status == Status.DONE:
        return TaskResultStatus.SUCCESSFUL, errors
    if status == Status.RUNNING:
        return TaskResultStatus.RUNNING, errors
    if status == Status.CANCELLED:
        path = f"{TaskCancelled.__module__}.{TaskCancelled.__qualname__}"
        return TaskResultStatus.FAILED, [*errors, TaskError(exception_class_path=path, traceback="cancelled")]
    if status == Status.FAILED:
        if not errors:  # failed without a failed attempt of its own, e.g. too many 429 deferrals
            errors.append(TaskError(
                exception_class_path=exception_path(call.last_error, call.last_traceback),
                traceback=call.last_traceback or call.last_error,
            ))
        return TaskResultStatus.FAILED, errors
    return TaskResultStatus.READY, errors  # pending (also waiting for a retry) or dispatched


_EXCEPTION_LINE = re.compile(r"^(?P<path>[A-Za-z_][\w.]*)(?::|$)")


def exception_path(error: str, trace: str) -> str:
    """Return the dotted path of the exception an attempt recorded as ``"Name: message"``.

    The worker records the class's name; the traceback's closing line names its module too
    (``app.errors.Boom: ...``; builtins are bare: ``ValueError: ...``).
    """
    name = error.partition(":")[0].strip()
    for line in reversed((trace or "").splitlines()):
        match = _EXCEPTION_LINE.match(line)
        if match and name and (match["path"] == name or match["path"].endswith(f".{name}")):
            path = match["path"]
            return path if "." in path else f"builtins.{path}"
    return f"builtins.{name}" if name.isidentifier() else "builtins.Exception"


def check_task_params(params: dict[str, Any]) -> None:
    """Validate a ``task`` call's params: only this backend's enqueue may store one."""
    if not _enqueuing.get():
        raise InvalidParams("method 'task' is stored by Django Tasks (a @task's .enqueue()), not by send()")
    unknown = set(params) - TASK_PARAMS
    if unknown or not isinstance(params.get("task"), str):
        raise InvalidParams(f"task: params must be {', '.join(sorted(TASK_PARAMS))}")


def run_task(task: str, args: list[Any], kwargs: dict[str, Any], **params: Any) -> Any:
    """Run the task named by its dotted path (in a worker); return its JSON-normalised value."""
    try:
        obj = import_string(task)
    except ImportError as exc:
        raise PermanentError(f"task {task!r} cannot be imported: {exc}") from None
    if not isinstance(obj, Task):
        raise PermanentError(f"{task!r} is not a Django Tasks task (decorate it with @task)")
    return normalize_json(obj.call(*args, **kwargs))
