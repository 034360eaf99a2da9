"""The start-to-send delay, measured by the worker that runs each call (the learnt arrival guard).

A start is recorded on the database clock; the API counts the request when it arrives. The
worker notes its own monotonic clock just before the query that reads the database clock for a
start (``mark_clock``) and again when the handler hands the request to the network
(``mark_sent``: the http handler does it when the request's headers go out; another handler
may call ``dispatcher.mark_sent()``, else the moment it is invoked counts). The difference is
an upper bound of the delay on the database's own time scale, with no clock offset between
hosts in it. ``dispatcher.limits.ledger.remember_send_delay`` keeps the largest delays per key;
every claim and start then absorbs them (``guard.learnt_delay``).
"""
from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

from dispatcher.limits.guard import DelayMemory, remember_delay
from dispatcher.running import carry, here

# What a start noted: each key's memory span, what its memory held, the start's database time.
Noted = tuple[
    dict[str, timedelta], dict[str, DelayMemory], datetime, dict[str, timedelta], dict[str, list[timedelta]]
]


def mark_clock() -> None:
    """Note that the database clock is about to be read for a start (called before the query)."""
    here().clock_read = time.monotonic()


def note_start(
    spans: dict[str, timedelta], kept: dict[str, DelayMemory], now: datetime, learnt: dict[str, timedelta],
    buckets: dict[str, list[timedelta]],
) -> None:
    """Remember, for the start being judged, how long each key keeps its measured delays, what it
    kept at ``now`` (so a worker writes only a delay that changes it), the delay each key's guard
    was learnt from and the periods of its buckets."""
    here().noted = (spans, kept, now, learnt, buckets)


def overdue(noted: Noted | None, delay: timedelta) -> dict[str, tuple[list[timedelta], timedelta]]:
    """Return, per key with buckets, its bucket periods and how much later than its start's guard
    allowed for the request went out (a bucket's state is charged at the start, with the guard
    known then: a later send must move it on by the difference)."""
    if noted is None:
        return {}
    _, _, _, learnt, buckets = noted
    return {
        key: (periods, delay - learnt.get(key, timedelta(0)))
        for key, periods in buckets.items()
        if periods and delay > learnt.get(key, timedelta(0))
    }


def to_write(clock_read: float | None, noted: Noted | None, delay: timedelta) -> dict[str, timedelta]:
    """Return the keys (with their memory spans) whose memory the delay would change, judged on what
    the start read; a worker skips the write for the others (no round trip in the steady state)."""
    if noted is None or clock_read is None:
        return {}
    spans, kept, at, _, _ = noted
    now = at + timedelta(seconds=max(time.monotonic() - clock_read, 0.0))
    return {
        key: span for key, span in spans.items()
        if remember_delay(kept.get(key, DelayMemory()), now, span, delay) is not None
    }


def mark_sent() -> None:
    """Tell the dispatcher that the running call's request is being handed to the network now.

    Called from a handler; the first call counts. Without it the handler's invocation counts,
    which leaves out whatever the handler does before it sends.
    """
    run = here()
    if run.sent is None:
        run.sent = time.monotonic()


def trace(event: str, info: dict[str, Any]) -> None:
    """An httpcore trace hook: the request's headers start going out (the connection is open)."""
    if event.endswith("send_request_headers.started"):
        mark_sent()


def snapshot() -> tuple[float | None, Noted | None]:
    """Return what this thread's last start noted (to carry to a thread it started a call for)."""
    run = here()
    return run.clock_read, run.noted


def restore(noted: tuple[float | None, Noted | None] | None) -> None:
    """Take what another thread's start noted for this thread's call (``dispatcher.combiner``, a message's handler threads)."""
    if noted is not None:
        carry(*noted)


def for_keys(noted: Noted | None, keys: list[str]) -> Noted | None:
    """Return what a start noted, only for these keys (a group's start noted all its calls' keys)."""
    if noted is None:
        return None
    spans, kept, now, learnt, buckets = noted

    def mine(values: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in values.items() if key in keys}

    return mine(spans), mine(kept), now, mine(learnt), mine(buckets)


def begin(keys: list[str] | None = None) -> tuple[float | None, Noted | None]:
    """Return, for a call just started, when its start's clock was read and what its start noted
    (for its ``keys`` only, when given)."""
    run = here()
    run.sent = run.invoked = None
    return run.clock_read, run.noted if keys is None else for_keys(run.noted, keys)


def mark_invoked() -> None:
    """Note that the handler is being invoked (what counts as the send if it marks none)."""
    here().invoked = time.monotonic()


def sent_after(clock_read: float | None) -> timedelta | None:
    """Return the delay from the start's clock reading to the send (None if either is unknown)."""
    run = here()
    sent = run.sent if run.sent is not None else run.invoked
    run.sent = run.invoked = None
    if clock_read is None or sent is None:
        return None
    return timedelta(seconds=max(sent - clock_read, 0.0))
