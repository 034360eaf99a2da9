"""Handlers the benchmarks send calls to."""
from __future__ import annotations

import time
from typing import Any

from dispatcher import handler


@handler("bench.noop")
def noop(**params: Any) -> None:
    return None


@handler("bench.stamp")
def stamp(**params: Any) -> dict[str, float]:
    """Return when the handler started, on this machine's clock."""
    return {"t": time.time()}


# When this worker process received the message of the task it is running (Celery's
# task_prerun, sent in the pool process just before the task body): a phase of http_latency.
_received: dict[str, float] = {}


def _stamp_received(**kwargs: Any) -> None:
    _received["t"] = time.time()


try:
    from celery.signals import task_prerun

    task_prerun.connect(_stamp_received, weak=False)
except ImportError:  # pragma: no cover - celery is a requirement
    pass


@handler("bench.http_timed", validator=lambda params: _http_validator()(params))
def http_timed(**params: Any) -> dict[str, Any]:
    """The built-in ``http`` handler, called as is, with when the task began and the handler was entered."""
    entered = time.time()
    from dispatcher.handlers import http

    result = http(**params)
    return {**result, "entered": entered, "received": _received.get("t")}


def _http_validator():
    from dispatcher.handlers import validate_http

    return validate_http
