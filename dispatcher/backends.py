"""A Django Tasks backend: ``@task`` functions enqueued with ``.enqueue()`` become paced calls.

``TASKS = {"default": {"BACKEND": "dispatcher.backends.DispatcherBackend", "OPTIONS": {...}}}``
works with ``django.tasks`` (Django 6.0 and later) and with the ``django-tasks`` backport on
Django 5.2. A task enqueued here is a call of the built-in ``task`` handler: it is stored in the
caller's transaction, dispensed under the policies of its keys, run by the same Celery workers, and
read back with ``get_result()``. OPTIONS:

- ``keys``: ``{"app.tasks.fn": ["partner", "partner:{account_id}"]}``, a task's dotted path to key
  templates formatted from its arguments (by parameter name, positional ones included);
- ``unique``: ``{"app.tasks.fn": "{order_id}"}`` (or ``{"key": "{order_id}", "for": "10m"}``), a
  task's dotted path to a unique key template: while a call of the task with the same key (the path,
  a colon, the template filled from its arguments) waits or runs, and for ``for`` after it was sent,
  ``.enqueue()`` stores nothing and returns that call's result (see send()'s ``unique_key``);
- ``max_attempts``: attempts a task gets (default 1: a task that raises is FAILED, as in Django;
  a task that raises ``dispatcher.RateLimited`` waits without spending one).

The worker sends ``task_started`` before the task runs and ``task_finished`` once its outcome is
final (not before a retry), passes a ``TaskContext`` to a ``takes_context`` task, and records a task
that raises ``SystemExit`` or ``KeyboardInterrupt`` as FAILED like any other.
"""
from __future__ import annotations

import contextvars
import inspect
import string
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from traceback import format_exception
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core import checks
from django.core.exceptions import ImproperlyConfigured, ObjectDoesNotExist
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from dispatcher import handler
from dispatcher.calls.once import clean_unique
from dispatcher.exceptions import InvalidCall, InvalidParams, PermanentError, RateLimited
from dispatcher.keys import format_key, resolve_keys
from dispatcher.running import current_call
from dispatcher.states import AttemptOutcome as Outcome
from dispatcher.states import CallStatus as Status

try:  # Django >= 6.0 ships the framework (the stubs checked against are Django 5.2's: no django.tasks).
    from django.tasks import DEFAULT_TASK_QUEUE_NAME, Task, TaskResult, TaskResultStatus  # type: ignore[import-untyped]
    from django.tasks.backends.base import BaseTaskBackend  # type: ignore[import-untyped]
    from django.tasks.base import TaskContext, TaskError  # type: ignore[import-untyped]
    from django.tasks.exceptions import InvalidTask, TaskResultDoesNotExist  # type: ignore[import-untyped]
    from django.tasks.signals import task_enqueued, task_finished, task_started  # type: ignore[import-untyped]
    from django.utils.json import normalize_json  # type: ignore[import-untyped]
except ImportError:  # Django 5.2: the django-tasks backport.
    try:
        from django_tasks import DEFAULT_TASK_QUEUE_NAME, TaskResult, TaskResultStatus
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskContext, TaskError
        from django_tasks.exceptions import TaskResultDoesNotExist
        from django_tasks.signals import task_enqueued, task_finished, task_started
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

# The built-in handler that runs a task (registered at the end of this module, which
# dispatcher.handlers imports where Django Tasks is installed).
TASK_METHOD = "task"
TASK_PARAMS = {"task", "backend", "queue_name", "run_after", "args", "kwargs"}

# Set while this backend stores a task's call, so that the ``task`` method cannot be sent any
# other way (the HTTP API or the admin would otherwise run any task with any arguments).
_enqueuing: contextvars.ContextVar[bool] = contextvars.ContextVar("dispatcher_enqueuing_task", default=False)


class InvalidTaskArguments(InvalidParams, TypeError):
    """A task's arguments are not JSON-serialisable or do not fit its signature; nothing was stored."""


class TaskCancelled(Exception):
    """The task's call was cancelled before it ran; its result shows FAILED with this error."""


class TaskLost(Exception):
    """The worker running the task was lost (killed, or silent past DISPATCHER_RUN_TIMEOUT); the rescue sweep recorded it."""


class TaskImportError(PermanentError, ImportError):
    """The task's dotted path cannot be imported in the worker; the task fails without a retry."""


def _calls() -> type[CallQueue]:
    """The call table. Looked up when a task is enqueued or read, not imported: Django loads a task
    backend wherever TASKS names it, in a site that may not install the app (``check`` then says so),
    and dispatcher.models may only be imported where the app is installed."""
    model: type[CallQueue] = apps.get_model("dispatcher", "CallQueue")
    return model


class DispatcherBackend(BaseTaskBackend):  # type: ignore[misc]  # untyped where the backport provides it
    """Stores each enqueued task as a call; the dispenser paces it and a Celery worker runs it."""

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.keys = _key_templates(alias, self.options.get("keys", {}))
        self.unique = _unique_templates(alias, self.options.get("unique", {}))
        self.max_attempts = self.options.get("max_attempts", 1)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ImproperlyConfigured(f"TASKS[{alias!r}]['OPTIONS']['max_attempts'] must be a whole number >= 1")

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """Report the app missing from INSTALLED_APPS, and OPTIONS["keys"] entries that name no task of
        this backend, or no argument of it."""
        if not apps.is_installed("dispatcher"):
            return [checks.Error(
                f"TASKS[{self.alias!r}] uses dispatcher.backends.DispatcherBackend, but the dispatcher app is not installed",
                hint="Add 'dispatcher' to INSTALLED_APPS (its tables store the tasks).",
                id="dispatcher.E100",
            )]
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
        once: dict[str, Any] = {}
        if task.module_path in self.unique:
            template, hold_for = self.unique[task.module_path]
            once = {"unique_key": f"{task.module_path}:{format_key(template, named)}", "unique_for": hold_for}
        params = {
            "task": task.module_path, "backend": self.alias, "queue_name": task.queue_name,
            "args": args, "kwargs": kwargs,
        }
        if task.run_after is not None:  # read back as the task's own run_after (the call's run_at moves on a retry)
            params["run_after"] = task.run_after.isoformat()
        run_at = task.run_after
        if run_at is not None and timezone.is_naive(run_at):  # USE_TZ = False: the project's time zone
            run_at = timezone.make_aware(run_at)
        token = _enqueuing.set(True)
        try:
            call = _calls().objects.send(
                TASK_METHOD, params, keys=keys, priority=task.priority, run_at=run_at,
                max_attempts=self.max_attempts, queue=None if task.queue_name == DEFAULT_TASK_QUEUE_NAME else task.queue_name,
                **once,
            )
        finally:
            _enqueuing.reset(token)
        result = self._result(call, task, [])
        # The task exists only if the caller's transaction commits (and only once: a duplicate is the holder's).
        if call.created:
            transaction.on_commit(lambda: task_enqueued.send(type(self), task_result=result), robust=True)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """Return the task's result as its call stands now; raise TaskResultDoesNotExist if none."""
        try:
            call = _calls().objects.get(pk=int(result_id), method=TASK_METHOD)
        except (TypeError, ValueError, ObjectDoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        try:
            task = stored_task(call.params, call.priority)
        except (ImportError, PermanentError) as exc:
            raise TaskResultDoesNotExist(f"{result_id}: {exc}") from None
        # A call never started has no attempt to read: one query for a READY task.
        attempts = list(call.attempt_set.all()) if call.attempts or call.deferrals else []
        return self._result(call, task, attempts)

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


def _unique_templates(alias: str, option: Any) -> dict[str, tuple[str, Any]]:
    """Return OPTIONS["unique"] checked: a task's dotted path to its unique key template and hold."""
    where = f"TASKS[{alias!r}]['OPTIONS']['unique']"
    if not isinstance(option, Mapping):
        raise ImproperlyConfigured(f"{where} must be a dict of a task's dotted path to a key template")
    templates = {}
    for path, entry in option.items():
        spec = entry if isinstance(entry, Mapping) else {"key": entry}
        if not isinstance(path, str) or "." not in path or set(spec) - {"key", "for"} or not isinstance(spec.get("key"), str):
            raise ImproperlyConfigured(
                f"{where}[{path!r}] must be a key template like '{{order_id}}', or {{'key': '{{order_id}}', 'for': '10m'}}"
            )
        try:
            clean_unique(spec["key"] or "?", spec.get("for"), "keep")
        except InvalidCall as exc:
            raise ImproperlyConfigured(f"{where}[{path!r}]: {exc}") from None
        templates[path] = (spec["key"], spec.get("for"))
    return templates


def _json_arguments(task: Task, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    """Return the arguments as the task will receive them (JSON), or raise InvalidTaskArguments."""
    try:
        return normalize_json(list(args)), normalize_json(dict(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidTaskArguments(f"{task.module_path}: arguments must be JSON-serialisable ({exc})") from None
    except RecursionError:  # a cycle, or nesting deeper than Python's recursion limit
        raise InvalidTaskArguments(f"{task.module_path}: arguments must be JSON-serialisable (cyclic or too deep)") from None


def _named_arguments(task: Task, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return the task's arguments by parameter name (defaults included), for its key templates."""
    context = [None] if task.takes_context else []  # the TaskContext the worker passes first
    try:
        bound = inspect.signature(task.func).bind(*context, *args, **kwargs)
    except TypeError as exc:
        raise InvalidTaskArguments(f"{task.module_path}: {exc}") from None
    bound.apply_defaults()
    named = dict(bound.arguments)
    if task.takes_context:
        named.pop(next(iter(bound.signature.parameters)))
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
        path = _LOST if attempt.outcome == Outcome.LOST else exception_path(attempt.error)
        errors.append(TaskError(exception_class_path=path, traceback=trace))
    status = call.status
    if status == Status.DONE:
        return TaskResultStatus.SUCCESSFUL, errors
    if status == Status.RUNNING:
        return TaskResultStatus.RUNNING, errors
    if status == Status.CANCELLED:
        return TaskResultStatus.FAILED, [*errors, TaskError(exception_class_path=class_path(TaskCancelled), traceback="cancelled")]
    if status == Status.FAILED:
        if not errors:  # failed without a failed attempt of its own, e.g. too many 429 deferrals
            errors.append(TaskError(
                exception_class_path=exception_path(call.last_error), traceback=call.last_traceback or call.last_error,
            ))
        return TaskResultStatus.FAILED, errors
    return TaskResultStatus.READY, errors  # pending (also waiting for a retry) or dispatched


def class_path(kind: type[BaseException]) -> str:
    """Return an exception class's dotted path, as the framework records it."""
    return f"{kind.__module__}.{kind.__qualname__}"


_LOST = class_path(TaskLost)


def exception_path(error: str) -> str:
    """Return the class path an attempt's error names (the worker writes ``"app.errors.Boom: message"``
    from the exception's type, a builtin bare: ``"ValueError: ..."``); ``builtins.Exception`` when
    it names no exception class (a row written before paths were recorded, an unreadable row)."""
    name = error.partition(":")[0].strip()
    if not name or not all(part.isidentifier() for part in name.split(".")):
        return "builtins.Exception"
    path = name if "." in name else f"builtins.{name}"
    try:
        kind = import_string(path)
    except ImportError:
        return "builtins.Exception"
    return path if inspect.isclass(kind) and issubclass(kind, BaseException) else "builtins.Exception"


def check_task_params(params: dict[str, Any]) -> None:
    """Validate a ``task`` call's params: only this backend's enqueue may store one."""
    if not _enqueuing.get():
        raise InvalidParams("method 'task' is stored by Django Tasks (a @task's .enqueue()), not by send()")
    unknown = set(params) - TASK_PARAMS
    if unknown or not isinstance(params.get("task"), str):
        raise InvalidParams(f"task: params must be {', '.join(sorted(TASK_PARAMS))}")


def stored_task(params: Mapping[str, Any], priority: int) -> Task:
    """Return the task a stored call names, with the priority, queue and run_after it was enqueued with.

    Raise ImportError if its path cannot be imported, PermanentError if it names no task or its
    backend or queue is no longer configured.
    """
    path = params.get("task")
    try:
        task = import_string(path) if isinstance(path, str) else None
    except ImportError as exc:
        raise TaskImportError(f"task {path!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise PermanentError(f"{path!r} is not a Django Tasks task (decorate it with @task)")
    run_after = params.get("run_after")
    try:
        return task.using(
            priority=priority, queue_name=params.get("queue_name"), backend=params.get("backend"),
            run_after=datetime.fromisoformat(run_after) if isinstance(run_after, str) else None,
        )
    except (ImproperlyConfigured, InvalidTask) as exc:  # its backend or queue is no longer configured
        raise PermanentError(f"task {path!r} cannot run as it was enqueued: {exc}") from exc


def run_task(task: str, args: list[Any], kwargs: dict[str, Any], **params: Any) -> Any:
    """Run a stored task in a worker, as the framework runs one; return its JSON-normalised value.

    ``task_started`` goes out before it runs and ``task_finished`` once its outcome is final; a task
    that takes a context gets a ``TaskContext`` (its result, the attempt).
    """
    call = current_call()
    if call is None:  # run outside a worker's start (no result to report): the task alone
        return normalize_json(stored_task({"task": task, **params}, 0).call(*args, **kwargs))
    obj = stored_task({"task": task, **params}, call.priority)
    backend = obj.get_backend()
    result = backend._result(call, obj, list(call.attempt_set.all()))
    task_started.send(type(backend), task_result=result)
    try:
        if obj.takes_context:
            value = normalize_json(obj.call(TaskContext(task_result=result), *args, **kwargs))
        else:
            value = normalize_json(obj.call(*args, **kwargs))
    except BaseException as exc:
        retried = isinstance(exc, Exception) and not isinstance(exc, PermanentError) and call.attempts < call.max_attempts
        if not retried and not isinstance(exc, RateLimited):
            error = TaskError(exception_class_path=class_path(type(exc)), traceback="".join(format_exception(exc)))
            failed = replace(result, status=TaskResultStatus.FAILED, finished_at=timezone.now(), errors=[*result.errors, error])
            task_finished.send(type(backend), task_result=failed)  # in the except block, as Django's log reads it
        raise
    finished = replace(result, status=TaskResultStatus.SUCCESSFUL, finished_at=timezone.now())
    object.__setattr__(finished, "_return_value", value)
    task_finished.send(type(backend), task_result=finished)
    return value


@handler(TASK_METHOD, validator=check_task_params)
def run_stored_task(**params: Any) -> Any:
    """Run a Django Tasks task stored by DispatcherBackend (the built-in ``task`` method)."""
    return run_task(**params)
