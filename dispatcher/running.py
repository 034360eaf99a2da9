"""The call a handler is running, for a handler that needs its row (the Tasks backend's ``task``)."""
from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_call: contextvars.ContextVar[Any] = contextvars.ContextVar("dispatcher_running_call", default=None)


@contextmanager
def running(call: Any) -> Iterator[None]:
    """Name the started call (a ``CallQueue`` row) whose handler runs inside the block."""
    token = _call.set(call)
    try:
        yield
    finally:
        _call.reset(token)


def current_call() -> Any:
    """Return the started call whose handler runs on this thread, or None outside a worker's run."""
    return _call.get()
