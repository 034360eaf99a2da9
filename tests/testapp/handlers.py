"""Handlers used by the tests; autodiscovered like any installed app's ``handlers`` module."""
from __future__ import annotations

from typing import Any

from dispatcher import PermanentError, handler


def _check_greeting(params: dict[str, Any]) -> None:
    if not isinstance(params.get("name"), str) or not params["name"]:
        raise ValueError("'name' must be a non-empty string")


@handler("greet", keys=["greeter", "greeter:{name}"], validator=_check_greeting)
def greet(name: str) -> dict[str, str]:
    return {"greeting": f"hello {name}"}


@handler("noop")
def noop(**params: Any) -> None:
    return None


@handler("explode")
def explode(permanent: bool = False, **params: Any) -> None:
    if permanent:
        raise PermanentError("cannot be done")
    raise RuntimeError("boom")


@handler("deep_result")
def deep_result(depth: int = 5_000) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@handler("leaky")
def leaky(url: str) -> None:
    raise RuntimeError(f"GET {url} failed; sent X-Access-Key: AKIA-LEAK-1 and client_secret=LEAK-2")


@handler("slow_down", keys=["slow"])
def slow_down(retry_after: Any = None, huge: bool = False) -> None:
    from dispatcher import RateLimited

    raise RateLimited(retry_after=10**400 if huge else float(retry_after))
