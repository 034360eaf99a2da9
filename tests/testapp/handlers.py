"""Handlers used by the tests; autodiscovered like any installed app's ``handlers`` module."""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import httpx

from dispatcher import PermanentError, RateLimited, arrivals, handler, marks_sent, report_cost


def _check_greeting(params: dict[str, Any]) -> None:
    if not isinstance(params.get("name"), str) or not params["name"]:
        raise ValueError("'name' must be a non-empty string")


@handler("greet", keys=["greeter", "greeter:{name}"], validator=_check_greeting)
def greet(name: str) -> dict[str, str]:
    return {"greeting": f"hello {name}"}


@handler("noop")
def noop(**params: Any) -> None:
    return None


@handler("late_send")
def late_send(delay: float = 0.0, answer: float = 0.0, **params: Any) -> None:
    """A handler that sends its request ``delay`` seconds after it is invoked, and whose answer
    comes ``answer`` seconds after that."""
    import time

    time.sleep(delay)
    arrivals.mark_sent()
    time.sleep(answer)


def _clocks() -> dict[str, str]:
    """The database clock now (a request would go out now) and the one its start was judged on."""
    from dispatcher.clock import db_now
    from dispatcher.running import here

    return {"at": db_now().isoformat(), "judged": here().noted[2].isoformat()}


@handler("db_clock")
def db_clock(**params: Any) -> dict[str, str]:
    """Return the database clock when the handler runs, and its start's."""
    return _clocks()


@handler("marked_clock")
@marks_sent
def marked_clock(
    work: float = 0.0, answer: float = 0.0, atomic: bool = False, opens: bool = False, reports: int | None = None,
    **params: Any,
) -> dict[str, str]:
    """Work ``work`` seconds, mark the send and return the database clock then, and its start's,
    once the answer came ``answer`` seconds later (a slow API); ``atomic``: all of it inside a
    transaction of the handler's own; ``opens``: the work is opening the process's first
    connection to the API (as the http handler's client says it); ``reports``: the answer says
    the call cost that many units (``report_cost``)."""
    import time

    from django.db import transaction

    if reports is not None:
        report_cost(reports)

    with transaction.atomic() if atomic else contextlib.nullcontext():
        if opens:
            arrivals.opening()
        time.sleep(work)
        arrivals.mark_sent()
        clocks = _clocks()
    time.sleep(answer)
    return clocks


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


@handler("complete", keys=["llm"], cost=lambda params: params.get("max_tokens", 1))
def complete(max_tokens: int = 1, used: int | None = None, **params: Any) -> dict[str, int]:
    """An LLM-style call: charged its max_tokens up front, then reports the tokens it used."""
    if used is not None:
        report_cost(used)
    return {"used": used if used is not None else max_tokens}


# Built when the module is imported (before the first call's start is recorded, in every worker
# process): building a client loads TLS settings, which takes tens of milliseconds.
_client = httpx.Client(timeout=10, trust_env=False)


@handler("pooled_get")
@marks_sent  # held where the trace hook marks the send, as the http handler is
def pooled_get(url: str, headers: dict[str, str] | None = None, late: float = 0.0) -> dict[str, int]:
    """GET through one connection pool per process: what the http handler does with a pooled
    client (``late``: that many seconds after it is invoked, a worker's slow moment)."""
    if late:
        import time

        time.sleep(late)
    # The trace hook marks the moment the request's headers go out: the measured send.
    response = _client.get(url, headers=headers or {}, extensions={"trace": arrivals.trace})
    if response.status_code == 429:
        raise RateLimited(float(response.headers.get("retry-after", "1")))
    return {"status": response.status_code}


@handler("exits")
def exits(**params: Any) -> None:
    """A handler that ends its process, as ``exit(4)`` would."""
    raise SystemExit(4)


# Opened by a test to let every ``waits_for_gate`` handler return (in-process tests only).
GATE = threading.Event()


@handler("waits_for_gate")
def waits_for_gate(**params: Any) -> None:
    """A handler that returns once a test opens ``GATE`` (at most 30 s)."""
    GATE.wait(30)
