"""Starts of one worker process's threads combined into one transaction (flat combining).

Under Celery's ``threads`` (or ``gevent``) pool dozens of calls of a key start at once, and each
start locks the key's row until its transaction commits: one at a time, each a few round trips
and a durable commit long, with the GIL to win back between them. Instead, the threads of a
process hand their starts to whichever of them arrived first (the leader), which starts all
that are waiting together with ``CallQueue.objects.start_many``: one transaction, the calls
checked against the limits as one group in the order they came, as a message of several calls
is. While it works, later threads queue; when it is done, the first of them leads the next
group. A thread alone (a prefork process, an idle moment) starts its call on its own, exactly
as before, so nothing waits for a group to fill.

What a thread gets back is what ``start`` would have given it; what the start noted for the
send-delay measurement (``dispatcher.arrivals``) is carried to each thread's own context.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from dispatcher import arrivals

# At most this many starts in one transaction; the rest wait for the next group.
MAX_GROUP = 32


@dataclass
class _Request:
    delivery: tuple[int, int]
    may_wait: timedelta
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False
    result: Any = None
    error: BaseException | None = None
    noted: Any = None


class StartCombiner:
    """Hand a thread's start to the group being led, or lead one (see the module's docstring)."""

    def __init__(self, start_many: Callable[..., list[Any]]) -> None:
        self._start_many = start_many
        self._lock = threading.Lock()
        self._waiting: list[_Request] = []
        self._leading = False

    def start(self, call_id: int, dispatch_no: int, worker: str, *, may_wait: timedelta = timedelta(0)) -> Any:
        request = _Request((call_id, dispatch_no), may_wait)
        with self._lock:
            self._waiting.append(request)
            lead = request.lead = not self._leading
            self._leading = True
        if not lead:
            request.done.wait()
        if request.lead:
            self._lead(worker)
        # Started in another thread: its measurement anchor is the group's.
        arrivals.restore(request.noted)
        if request.error is not None:
            raise request.error
        return request.result

    def _lead(self, worker: str) -> None:
        """Start the waiting group (this thread's own start first), then hand the lead on."""
        with self._lock:
            group = self._waiting[:MAX_GROUP]
            del self._waiting[:MAX_GROUP]
        try:
            for may_wait in dict.fromkeys(r.may_wait for r in group):
                part = [r for r in group if r.may_wait == may_wait]
                results = self._start_many([r.delivery for r in part], worker, may_wait=may_wait)
                noted = arrivals.snapshot()
                for request, result in zip(part, results, strict=True):
                    request.result, request.noted = result, noted
        except BaseException as exc:  # each thread raises it in its own start (and retries it)
            for request in group:
                if request.result is None:
                    request.error = exc
        finally:
            with self._lock:
                if self._waiting:
                    self._waiting[0].lead = True
                    self._waiting[0].done.set()
                else:
                    self._leading = False
            for request in group:
                request.lead = False
                request.done.set()
