"""Django Tasks used by the tests of dispatcher.backends."""
from __future__ import annotations

from typing import Any

import httpx

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the backport
    from django_tasks import task


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
