"""Handlers used by the tests; autodiscovered like any installed app's ``handlers`` module."""
from __future__ import annotations

from typing import Any

from dispatcher import PermanentError, handler, report_cost


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


@handler("complete", keys=["llm"], cost=lambda params: params.get("max_tokens", 1))
def complete(max_tokens: int = 1, used: int | None = None, **params: Any) -> dict[str, int]:
    """An LLM-style call: charged its max_tokens up front, then reports the tokens it used."""
    if used is not None:
        report_cost(used)
    return {"used": used if used is not None else max_tokens}
