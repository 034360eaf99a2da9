"""The running call: one object per thread says what the worker knows of the call it starts and runs.

A worker's thread starts a call (the start reads the database clock and notes what each key's
arrival guard kept), then runs its handler. While the handler runs, the handler (or the http
handler for it) reports to the dispatcher: that the request goes out now (``mark_sent``), what
the call really cost (``report_cost``), what the API's rate-limit headers said (``learning``),
how long the network may take (``httpclient.deadline``). All of it lands in this thread's
:class:`Run`, held by the one ContextVar of this module; nothing else in the app keeps state
per running call.

Threads do not share a ``Run``: a thread that runs a call started by another (a message's
handler threads, a combined start's followers) takes a new one with what that start noted
(:func:`carry`).
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(slots=True)
class Run:
    """What this thread knows of the call it starts and runs."""

    # The started call (a ``CallQueue`` row) whose handler runs, its keys and its recorded start.
    call: Any = None
    keys: tuple[str, ...] = ()
    started_at: datetime | None = None
    # The start's clock: this thread's monotonic time just before the start read the database's,
    # and what the start noted of each key's arrival guard (``dispatcher.arrivals``).
    clock_read: float | None = None
    noted: Any = None
    # Its monotonic time just after that reading, until when the call's request is held, and
    # what its release checks (send-time pacing: ``arrivals.hold``, ``arrivals.Held``).
    clock_after: float | None = None
    # How much earlier than that reading the start was judged (``arrivals.judged_earlier``), in
    # seconds: ``clock_after`` already carries it back (``clock_read`` does not: a send's delay
    # counts from the reading itself).
    judged_by: float = 0.0
    hold_until: float | None = None
    held: Any = None
    # Once released: the latest its send may be marked and be what its buckets were charged for,
    # and how far its buckets were moved on, per key (``arrivals.release``, ``arrivals.answered``).
    held_latest: float | None = None
    held_moved: dict[str, Any] | None = None
    # For a call with window keys or unheld buckets: what its start noted and how to tell them
    # a late request as it goes out (``delaywriter.remember_ahead``), and the bucket move it
    # handed over, which its answer waits for.
    ahead: Any = None
    pushing: Any = None
    # Whether its start was logged again in its windows as its request went out, later than any
    # guard (``delaywriter.count_again``).
    counted_again: bool = False
    # Whether it was kept as a late start on its window keys (``delaywriter.keep_late``).
    kept_late: bool = False
    # Whether its request opened its process's first connection to its host
    # (``arrivals.opening``): a delay that is its connection's, not its key's (``arrivals.Sent``).
    opened: bool = False
    # When the request went out (the handler says so), else when the handler was invoked, after
    # any hold; ``natural``: when it would have gone out without the hold.
    sent: float | None = None
    invoked: float | None = None
    natural: float | None = None
    # The cost the handler reported (``dispatcher.report_cost``), None if it reported none.
    reported: Any = None
    # The monotonic time by which every network operation must be over (``httpclient.deadline``).
    deadline: float | None = None


_run: contextvars.ContextVar[Run | None] = contextvars.ContextVar("dispatcher_run", default=None)


def here() -> Run:
    """Return this thread's ``Run`` (a new, empty one on first use)."""
    run = _run.get()
    if run is None:
        run = Run()
        _run.set(run)
    return run


def carry(clock_read: float | None, noted: Any, clock_after: float | None = None) -> Run:
    """Give this thread a new ``Run`` with what another thread's start noted; return it."""
    run = Run(clock_read=clock_read, noted=noted, clock_after=clock_after)
    _run.set(run)
    return run


@contextmanager
def running(
    call: Any = None, *, keys: Sequence[str] | None = None, started_at: datetime | None = None
) -> Iterator[Run]:
    """Name the started call whose handler runs inside the block (its keys and start, unless
    given: a handler tested outside a worker names only ``keys``)."""
    run = here()
    before = run.call, run.keys, run.started_at
    run.call = call
    run.keys = tuple(keys if keys is not None else getattr(call, "keys", ()))
    run.started_at = started_at if started_at is not None else getattr(call, "started_at", None)
    try:
        yield run
    finally:
        run.call, run.keys, run.started_at = before


def current_call() -> Any:
    """Return the started call whose handler runs on this thread, or None outside a worker's run."""
    run = _run.get()
    return None if run is None else run.call
