"""Django Tasks used by the tests of dispatcher.backends."""
from __future__ import annotations

import time
from typing import Any

import httpx

try:
    from django.tasks import TaskContext, task
except ImportError:  # Django 5.2: the backport
    from django_tasks import TaskContext, task


@task
def fetch_account(url: str, account: str, page: int = 1) -> dict[str, Any]:
    """Ask the fake API for one page of an account; return what it answered."""
    response = httpx.get(url, params={"page": page}, headers={"x-call": f"{account}:{page}"}, timeout=10)
    response.raise_for_status()
    return {"status": response.status_code, "account": account, "page": page}


@task
def add(a: int, b: int) -> int:
    return a + b


@task
def fail(message: str) -> None:
    raise LookupError(message)


@task
async def add_later(a: int, b: int) -> int:
    return a + b


@task
def noop(*args: Any, **kwargs: Any) -> None:
    return None


@task
def raise_system_exit() -> None:
    raise SystemExit("the task asked to exit")


@task
def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt("the task was interrupted")


@task
def call_exit() -> None:
    exit(3)


@task
def raise_nested() -> None:
    raise ValueError(ValueError("the inner one"))


@task
def return_unserialisable() -> Any:
    return lambda: True


@task(takes_context=True)
def own_id(context: TaskContext) -> str:
    return context.task_result.id


@task(takes_context=True)
def context_seen(context: TaskContext, fail_until: int = 0) -> dict[str, Any]:
    """Fail the first attempts before ``fail_until``; return what the context held."""
    if context.attempt < fail_until:
        raise RuntimeError(f"attempt {context.attempt} fails")
    result = context.task_result
    return {
        "attempt": context.attempt, "id": result.id, "status": str(result.status), "args": result.args,
        "kwargs": result.kwargs, "worker_ids": result.worker_ids, "started": result.started_at is not None,
    }


def not_a_task() -> None:
    return None


class QuotaGone(Exception):
    """A task's own exception class, recorded by its module path."""


@task
def raise_own_error(account: str) -> None:
    raise QuotaGone(f"no quota left for {account}")


@task
def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


@task
def raise_chained(links: int) -> None:
    """Raise a ValueError at the end of a long chain of causes (a traceback longer than is stored)."""
    try:
        if links > 1:
            raise_chained.call(links - 1)
        raise ValueError("link 1")
    except ValueError as exc:
        raise ValueError(f"link {links}") from exc


class Halt(BaseException):
    """A task's own BaseException (not an Exception), recorded as any other failure."""


@task
def raise_halt() -> None:
    raise Halt("halted")
