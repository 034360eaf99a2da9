"""The start-to-send delay, measured by the worker that runs each call (the learnt arrival guard).

A start is recorded on the database clock; the API counts the request when it arrives. The
worker notes its own monotonic clock just before the query that reads the database clock for a
start (``reading_clock``) and again when the handler hands the request to the network
(``mark_sent``: the http handler does it when the request's headers go out; another handler
may call ``dispatcher.mark_sent()``, else the moment it is invoked counts). The difference is
an upper bound of the delay on the database's own time scale, with no clock offset between
hosts in it. ``dispatcher.limits.ledger.remember_send_delay`` keeps the largest delays per key;
every claim and start then absorbs them (``guard.learnt_delay``).

Send-time pacing: a key whose policies are all buckets (a smooth rate, a token bucket) does not
absorb the delay in its guard. Its buckets judge and charge each start at the start plus the
delay measured lately (the hold), and the worker holds the request until then, counted on its
own monotonic clock from just after the start read the database's (``hold``): a request leaves
no sooner than the moment its bucket was judged at, and the guard covers only what a hold leaves
(the lateness after it measured lately, at least ``HOLD_SPREAD``) and the network. Such a key remembers the
delay measured before the hold (``Sent.natural``), so a hold never feeds itself, and its
lateness after the hold; every other key the delay after it. The built-in http handler holds the
request just before its headers are written; another handler is held before it is invoked,
unless it is registered with ``marks_sent`` (then where it calls ``mark_sent``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from dispatcher.limits.guard import HOLD_LATE, SEND_DELAY, DelayMemory, remember_delay
from dispatcher.running import carry, here


class Noted(NamedTuple):
    """What a start noted for each key: its memory span, what its memory held, the start's
    database time, what its guard allows a request after the start, its buckets' periods; for a
    held key its hold and what it remembers of its lateness after a hold."""

    spans: dict[str, timedelta]
    kept: dict[str, DelayMemory]
    now: datetime
    allowed: dict[str, timedelta]
    buckets: dict[str, list[timedelta]]
    holds: dict[str, timedelta]
    late: dict[str, DelayMemory]

    def of(self, keys: list[str]) -> Noted:
        """Return what it noted for these keys only."""
        def mine(values: dict[str, Any]) -> dict[str, Any]:
            return {key: value for key, value in values.items() if key in keys}

        return Noted(
            mine(self.spans), mine(self.kept), self.now, mine(self.allowed), mine(self.buckets), mine(self.holds),
            mine(self.late),
        )

# Handlers that mark their send themselves (``mark_sent``): held there, not when invoked.
_marks_sent: set[Callable[..., Any]] = set()


class Sent(NamedTuple):
    """A call's start-to-send delay: the request's (after any hold), the one before the hold, and
    how much later than the latter the request went out."""

    delay: timedelta
    natural: timedelta
    beyond: timedelta

    @classmethod
    def of(cls, delay: timedelta, natural: timedelta) -> Sent:
        return cls(delay, natural, max(delay - natural, timedelta(0)))

    def late(self, hold: timedelta) -> timedelta:
        """Return how much later than a hold, or than the delay before it, the request went out."""
        return max(min(self.delay - hold, self.beyond), timedelta(0))

    def most(self, other: Sent | None) -> Sent:
        """Return the larger of each (for several calls: never less than any one's ``late``)."""
        if other is None:
            return self
        return Sent(max(self.delay, other.delay), max(self.natural, other.natural), max(self.beyond, other.beyond))


def marks_sent(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Say that a handler calls ``mark_sent`` as its request goes out (its hold is kept there)."""
    _marks_sent.add(fn)
    return fn


@contextmanager
def reading_clock() -> Iterator[None]:
    """Around the query that reads the database clock for a start: this thread's monotonic time
    just before it (the send is measured from it, an upper bound) and just after it (a request is
    held from it, a lower bound)."""
    run = here()
    run.clock_read, run.clock_after = time.monotonic(), None
    yield
    run.clock_after = time.monotonic()


def note_start(noted: Noted) -> None:
    """Remember, for the start being judged, how long each key keeps its measured delays and what
    it kept (so a worker writes only a delay that changes it), and the rest of ``Noted``."""
    here().noted = noted


def overdue(noted: Noted | None, delay: timedelta) -> dict[str, tuple[list[timedelta], timedelta]]:
    """Return, per key with buckets, its bucket periods and how much later than its start's guard
    allowed for the request went out (a bucket's state is charged at the start, with the guard
    known then: a later send must move it on by the difference)."""
    if noted is None:
        return {}
    allowed = noted.allowed
    return {
        key: (periods, delay - allowed.get(key, timedelta(0)))
        for key, periods in noted.buckets.items()
        if periods and delay > allowed.get(key, timedelta(0))
    }


def to_write(
    clock_read: float | None, noted: Noted | None, sent: Sent
) -> dict[tuple[str, timedelta], dict[str, timedelta]]:
    """Return, per memory and delay to keep, the keys (with their memory spans) whose memory it
    would change, judged on what the start read; a worker skips the write for the others (no
    round trip in the steady state). A held key keeps the delay before its hold, and how much
    later than its hold the request went out; any other key the delay after the hold."""
    if noted is None or clock_read is None:
        return {}
    now = noted.now + timedelta(seconds=max(time.monotonic() - clock_read, 0.0))
    writes: dict[tuple[str, timedelta], dict[str, timedelta]] = {}

    def keep(memory: str, kept: DelayMemory, key: str, span: timedelta, delay: timedelta) -> None:
        if remember_delay(kept, now, span, delay) is not None:
            writes.setdefault((memory, delay), {})[key] = span

    for key, span in noted.spans.items():
        hold = noted.holds.get(key)
        keep(SEND_DELAY, noted.kept.get(key, DelayMemory()), key, span, sent.delay if hold is None else sent.natural)
        if hold is not None:
            # Later than its hold, or than the request would have gone out without it (a larger
            # delay before the hold raises the next hold, not the guard).
            keep(HOLD_LATE, noted.late.get(key, DelayMemory()), key, span, sent.late(hold))
    return writes


def hold(run: Any) -> None:
    """Hold the running call's request until the moment its keys' buckets judged it at (the
    longest hold of its keys after its start's clock reading; at once if the start held none),
    noting when it would have gone out without the hold."""
    run.natural = time.monotonic()
    if run.hold_until is not None and run.hold_until > run.natural:
        time.sleep(run.hold_until - run.natural)


def mark_sent() -> None:
    """Tell the dispatcher that the running call's request is being handed to the network now.

    Called from a handler; the first call counts. Without it the handler's invocation counts,
    which leaves out whatever the handler does before it sends. A handler registered with
    ``marks_sent`` is held here (send-time pacing); another was held before it was invoked.
    """
    run = here()
    if run.sent is None:
        if run.natural is None:
            hold(run)
        run.sent = time.monotonic()


def trace(event: str, info: dict[str, Any]) -> None:
    """An httpcore trace hook: the request's headers start going out (the connection is open)."""
    if event.endswith("send_request_headers.started"):
        mark_sent()


def snapshot() -> tuple[float | None, Noted | None, float | None]:
    """Return what this thread's last start noted (to carry to a thread it started a call for)."""
    run = here()
    return run.clock_read, run.noted, run.clock_after


def restore(noted: tuple[float | None, Noted | None, float | None] | None) -> None:
    """Take what another thread's start noted for this thread's call (``dispatcher.combiner``, a message's handler threads)."""
    if noted is not None:
        carry(*noted)


def begin(keys: list[str] | None = None) -> tuple[float | None, Noted | None]:
    """Return, for a call just started, when its start's clock was read and what its start noted
    (for its ``keys`` only, when given); set until when its request is held."""
    run = here()
    run.sent = run.invoked = run.natural = run.hold_until = None
    # A group's start noted all its calls' keys: this call's only.
    noted = run.noted if keys is None or run.noted is None else run.noted.of(keys)
    if noted is not None and noted.holds:
        # From just after the start's clock was read: on the database's time the request then
        # leaves no sooner than the start's clock plus the hold, the moment its buckets judged.
        after = run.clock_after if run.clock_after is not None else time.monotonic()
        run.hold_until = after + max(noted.holds.values()).total_seconds()
    return run.clock_read, noted


def mark_invoked(fn: Callable[..., Any] | None = None) -> None:
    """Note that the handler ``fn`` is being invoked (what counts as the send if it marks none);
    hold it first unless it marks its send itself."""
    run = here()
    if fn not in _marks_sent:
        hold(run)
    run.invoked = time.monotonic()


def sent_after(clock_read: float | None) -> Sent | None:
    """Return the delays from the start's clock reading to the send (None if either is unknown)."""
    run = here()
    sent = run.sent if run.sent is not None else run.invoked
    natural = run.natural if run.natural is not None else sent
    run.sent = run.invoked = run.natural = None
    if clock_read is None or sent is None or natural is None:
        return None
    return Sent.of(timedelta(seconds=max(sent - clock_read, 0.0)), timedelta(seconds=max(natural - clock_read, 0.0)))
