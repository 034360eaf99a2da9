"""The start-to-send delay, measured by the worker that runs each call (the learnt arrival guard),
and the hold of a request paced at its send moment.

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
no sooner than the moment its bucket was judged at. Its guard covers the network and how late
after that moment the request may go out (``TokenBucket.lateness``). A request released later
than that (a worker descheduled, a slow start) moves its buckets on by its lateness before it
goes, as long as no later start was judged on them (``ledger.move_on``); once one was, it does
not go at all (``SendMissed``: the call waits again, its attempt refunded). So exactness never
depends on a worker being on time. Such a key remembers the delay measured before the hold
(``Sent.natural``), so a hold never feeds itself; every other key the delay after it. The
built-in http handler holds the request just before its headers are written; another handler
is held before it is invoked, unless it is registered with ``marks_sent`` (then where it calls
``mark_sent``).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db import DatabaseError

from dispatcher.clock import Offsets
from dispatcher.limits.guard import GUARD_MAX, DelayMemory, remember_delay
from dispatcher.running import carry, here


class Noted(NamedTuple):
    """What a start noted for each key: its memory span, what its memory held, the start's
    database time, what its guard allows a request after the start, its buckets' periods, for a
    held key its hold and how late after the start its buckets let the request arrive (the hold
    and the whole guard: ``reach``), the keys whose windows count under a learnt guard, with
    their shortest window period (``delaywriter.remember_ahead``), and how far its late requests
    moved its keys' unheld buckets on as they went out (``delaywriter.move_ahead``: the start's
    own, shared by its calls; None: not moved as they go out, only after their answers)."""

    spans: dict[str, timedelta]
    kept: dict[str, DelayMemory]
    now: datetime
    allowed: dict[str, timedelta]
    buckets: dict[str, list[timedelta]]
    holds: dict[str, timedelta]
    reach: dict[str, timedelta] | None = None
    windows: dict[str, timedelta] = {}  # noqa: RUF012 - never changed: a NamedTuple's default
    pushed: dict[str, timedelta] | None = None

    def unheld_buckets(self) -> dict[str, list[timedelta]]:
        """Return the bucket periods of the keys whose requests are not held: a late request moves
        them on by its lateness itself (``overdue``)."""
        return dict(self._unheld())

    def _unheld(self) -> Iterator[tuple[str, list[timedelta]]]:
        return ((key, periods) for key, periods in self.buckets.items() if periods and key not in self.holds)

    def tells_ahead(self) -> bool:
        """Whether a late request tells its keys as it goes out (``delaywriter``): a window that
        counts under a learnt guard, or a bucket not held, moved on by the request's lateness."""
        return bool(self.windows) or (self.pushed is not None and next(self._unheld(), None) is not None)

    def of(self, keys: list[str]) -> Noted:
        """Return what it noted for these keys only."""
        def mine(values: dict[str, Any]) -> dict[str, Any]:
            return {key: value for key, value in values.items() if key in keys}

        return Noted(
            # What its memories hold is shared: a late call that writes one (``delaywriter``) tells
            # the later calls of the same start what the database now keeps.
            mine(self.spans), self.kept, self.now, mine(self.allowed), mine(self.buckets), mine(self.holds),
            mine(self.reach or {}), mine(self.windows), self.pushed,
        )


# Per key, its buckets: (period, the state its start left it in, µs).
Buckets = dict[str, list[tuple[timedelta, int]]]
# Moves a late request's buckets on (``ledger.move_on``: the buckets, the start's token, the
# deadline on the database's clock or None, the pad; how far past their states they stand, or
# None): the worker gives it, as this module loads with the package, before any model may be defined.
MoveOn = Callable[[Buckets, int, "datetime | None", timedelta], "timedelta | None"]
# Tells a late request's keys as it goes out (what its start noted, its clock reading): its
# window keys keep its delay, its unheld buckets move on (``delaywriter.remember_ahead``); returns
# the bucket move handed over, if any, which the request's answer waits for (``sent_after``).
Remember = Callable[[Noted, float], "Future[Any] | None"]


class Held(NamedTuple):
    """A held request: this thread's monotonic time just after its start read the database clock
    and that clock (both later by any move its start carried), what each held key allows the
    request after it (its hold and lateness) and how late it may arrive (``Noted.reach``), the
    states its start left the keys' buckets in, and how to move them on."""

    after: float
    clock: datetime
    allowed: dict[str, timedelta]
    reach: dict[str, timedelta]
    buckets: Buckets
    start: int
    move_on: MoveOn


class SendMissed(BaseException):  # noqa: N818 - what happened, as StopIteration says
    """A held request came to its send too late to go out: a later start was judged on its
    buckets meanwhile. Not an ``Exception``: a handler's own ``except Exception`` must not keep
    the request going out."""


# The last part of a hold is spent on the CPU, not asleep: on a loaded machine a process woken
# from a sleep came more than 1 ms late one time in three (the pacing benchmark, 20 per second),
# one in eight spinning for the last 2 ms, at up to 2 ms of CPU per held request.
SPIN = 0.002

# How much more than its lateness when the move is made a late request moves its buckets on:
# the move's way back and the write after it. A request that comes later than that moves them on
# again, at most MOVES times in all (then it is not sent), each time padded by as long as the move
# before took as well: on a loaded machine, or SQLite's, a move's own write can take longer than
# 2 ms every time, and three moves padded by 2 ms each left a burst's request unsent.
MOVE_PAD = timedelta(milliseconds=2)
MOVES = 3
# How long a request's answer waits, at most, for the bucket move its request handed over.
PUSH_WAIT = 1.0

# Handlers that mark their send themselves (``mark_sent``): held there, not when invoked.
_marks_sent: set[Callable[..., Any]] = set()


class Sent(NamedTuple):
    """A call's start-to-send delay: the request's (after any hold), the one before the hold, and
    for a held request how much later than its release allowed it went out (a handler that marks
    its send after it was released: ``overdue``); and whether the request opened its
    process's first connection to its host (``opened``).

    An opened request is its process's first to its host (``opening``): its delay holds the
    connection's opening (a TCP handshake, TLS) and the process's first pass through the request
    (40-60 ms on the loaded benchmark machine against at most 18 ms for the same process's later
    calls), which its key's next requests do not pay. The process's later connections to the
    host are not: an API that closes every connection (or keep-alive ending between calls) opens
    one for each request, a delay its key pays every time and must remember.
    Its window keys do not remember it (``to_write``, ``delaywriter.remember_ahead``): a window
    counts every start of the next span or two under the guard its key remembers, and pays that
    guard at every turn. Where the request went out later than its start's guard allowed, its
    start is kept as a late start instead (``delaywriter.keep_late``): its windows count it alone
    until a period after its arrival, exact without the memory. A key of buckets only keeps it as any delay: its hold is an offset that
    costs no rate, and held longer, its next requests come late for it less often (paired on the
    shaped benchmark, not keeping it there lost about 1% of the token bucket's rate)."""

    delay: timedelta
    natural: timedelta
    beyond: timedelta = timedelta(0)
    opened: bool = False

    def most(self, other: Sent | None) -> Sent:
        """Return the larger of each (for several calls measured as one; opened if all were)."""
        if other is None:
            return self
        return Sent(
            max(self.delay, other.delay), max(self.natural, other.natural), max(self.beyond, other.beyond),
            self.opened and other.opened,
        )


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
    run.clock_read, run.clock_after, run.judged_by = time.monotonic(), None, 0.0
    yield
    run.clock_after = time.monotonic()


def judged_earlier(by: timedelta) -> None:
    """Say that the start being judged is judged at a clock ``by`` earlier than the one it read
    (it woke late for its slot): its request's hold counts from then (its delay still from the
    reading: what it measures is how long a request takes to go out after its start)."""
    run = here()
    if run.clock_after is not None:
        run.clock_after -= by.total_seconds()
        run.judged_by += by.total_seconds()


def note_start(noted: Noted) -> None:
    """Remember, for the start being judged, how long each key keeps its measured delays and what
    it kept (so a worker writes only a delay that changes it), and the rest of ``Noted``; and
    the start's clock reading, for this process's reading of the database clock (``clock.Offsets``):
    the reading as it was made, not the earlier clock a start woken late for its slot is judged
    at (that reading's lower bound would lie above the true one, its spread hide a lateness, and
    the next reading find it contradicted and drop what the process had read)."""
    run = here()
    run.noted = noted
    after = run.clock_after + run.judged_by if run.clock_after is not None else None
    _offsets.note(run.clock_read, after, noted.now + timedelta(seconds=run.judged_by))


_offsets = Offsets()
# How much of a reading's spread a held request's guard takes in without counting it as lateness:
# more than the 0.3-0.5 ms of a loaded machine's clock reading, well within the network's part
# of a guard (TokenBucket.HELD_NET_FLOOR).
SPREAD_FREE = timedelta(milliseconds=1)


def overdue(noted: Noted | None, sent: Sent) -> dict[str, tuple[list[timedelta], timedelta]]:
    """Return, per key with buckets, its bucket periods and how much later than its start's guard
    allowed for the request went out (a bucket's state is charged at the start, with the guard
    known then: a later send must move it on by the difference). A held key's buckets were
    settled when its request was released (``release``): only a send marked later than that
    allowed counts (``Sent.beyond``). Any other, less how far the start's late requests moved
    them on already as they went out (``Noted.pushed``)."""
    if noted is None:
        return {}
    allowed, pushed = noted.allowed, noted.pushed or {}
    late = {
        key: sent.beyond if key in noted.holds else sent.delay - allowed.get(key, timedelta(0)) - pushed.get(key, timedelta(0))
        for key, periods in noted.buckets.items() if periods
    }
    return {key: (noted.buckets[key], by) for key, by in late.items() if by > timedelta(0)}


def to_write(clock_read: float | None, noted: Noted | None, sent: Sent) -> dict[timedelta, dict[str, timedelta]]:
    """Return, per delay to keep, the keys (with their memory spans) whose memory it would change,
    judged on what the start read; a worker skips the write for the others (no round trip in the
    steady state). A held key keeps the delay before its hold; any other key the delay after it."""
    if noted is None or clock_read is None:
        return {}
    now = noted.now + timedelta(seconds=max(time.monotonic() - clock_read, 0.0))
    writes: dict[timedelta, dict[str, timedelta]] = {}
    for key, span in noted.spans.items():
        if sent.opened and key in noted.windows:
            continue  # its connection's delay: a late start if late (``Sent``)
        delay = sent.natural if key in noted.holds else sent.delay
        if remember_delay(noted.kept.get(key, DelayMemory()), now, span, delay) is not None:
            writes.setdefault(delay, {})[key] = span
    return writes


def hold(run: Any) -> None:
    """Hold the running call's request until the moment its keys' buckets judged it at (the
    longest hold of its keys after its start's clock reading; at once if the start held none),
    noting when it would have gone out without the hold; then ``release`` it."""
    run.natural = time.monotonic()
    if run.hold_until is not None:
        _hold_to_moment(run)
    _remember_ahead(run)


def _hold_to_moment(run: Any) -> None:
    """Hold a held request until its moment, then ``release`` it."""
    if run.hold_until - SPIN > run.natural:
        time.sleep(run.hold_until - SPIN - run.natural)
    while time.monotonic() < run.hold_until:
        pass  # on the CPU for the hold's last SPIN: a thread woken from a sleep comes late
    run.held_moved = release(run.held)
    # The latest a send may be marked and still be what its buckets were charged for.
    run.held_latest = run.held.after + min(
        (allowed + run.held_moved.get(key, timedelta(0)) for key, allowed in run.held.allowed.items())
    ).total_seconds()


def _remember_ahead(run: Any) -> None:
    """Have the running request's window keys remember its delay as it goes out, where their
    start's reading does not cover it, and its unheld buckets move on by its lateness
    (``delaywriter.remember_ahead``)."""
    if run.ahead is not None:
        noted, remember = run.ahead
        run.pushing = remember(noted, run.clock_read) or run.pushing


def release(held: Held) -> dict[str, timedelta]:
    """Let a held request go out, moving its buckets on first if it is later than they allow
    (return how far past their start's states they stand, per key moved); raise ``SendMissed``
    if it may not go: a later start was
    charged on them meanwhile, the move failed, the request would go out later than the move
    allows for, or past GUARD_MAX after its start (a bucket's refund replays no start later)."""
    elapsed = timedelta(seconds=time.monotonic() - held.after)
    keys = [key for key, allowed in held.allowed.items() if elapsed > allowed]
    if not keys:
        return {}
    if elapsed + MOVE_PAD > GUARD_MAX:
        raise SendMissed(f"{elapsed.total_seconds() * 1000:.0f} ms after its start")
    allowed = min(held.allowed[key] for key in keys)
    states = {key: held.buckets.get(key, []) for key in keys}
    by, pad = timedelta(0), MOVE_PAD
    for _ in range(MOVES):
        # Each move as far as the request is late when it is made (never back), and its pad.
        began = time.monotonic()
        try:
            stands = held.move_on(states, held.start, held.clock + allowed, pad)
        except DatabaseError as exc:
            raise SendMissed(f"its buckets could not be moved on: {exc!r}") from None
        if stands is None:
            raise SendMissed(f"{(elapsed - allowed).total_seconds() * 1000:.1f} ms late, after a later start")
        by = stands
        if timedelta(seconds=time.monotonic() - held.after) <= allowed + by:
            return dict.fromkeys(keys, by)
        pad = min(max(pad, timedelta(seconds=time.monotonic() - began) + MOVE_PAD), GUARD_MAX)
    raise SendMissed(f"later than its buckets were moved on for, {MOVES} times ({by.total_seconds() * 1000:.1f} ms)")


# How many of a key's recent round trips (the send to the answer's headers) this process keeps:
# their least is what the answer to a request the API saw on time takes.
ROUND_TRIPS = 32
_round_trips: dict[str, deque[float]] = {}
_round_trips_lock = threading.Lock()


def _least_round_trip(keys: Collection[str], took: float) -> float | None:
    """Keep a round trip on each key; return the least of the keys' recent ones before it (None: none yet)."""
    with _round_trips_lock:
        kept = [_round_trips.setdefault(key, deque(maxlen=ROUND_TRIPS)) for key in keys]
        least = min((min(trips) for trips in kept if trips), default=None)
        for trips in kept:
            trips.append(took)
        if len(_round_trips) > MAX_ROUND_TRIP_KEYS:
            _round_trips.clear()
    return least


# Keys whose round trips one process keeps, at most (cleared when full).
MAX_ROUND_TRIP_KEYS = 10_000
# How much more than an answer's lateness says the buckets move on: a round trip's least is a
# noisy reading of when the API sees a request on time (the rest of the trip varies too).
ANSWER_PAD = timedelta(milliseconds=1)


def answered() -> None:
    """Note that the answer to the running call's request has come (its headers): if it took
    longer than the key's least recent round trip by more than its buckets let the request
    arrive late, the API may have seen the request that much later (an nginx stamps a request
    when its process gets to it): move the buckets on by the difference, as long as no later
    start was charged on them (else there is nothing left to protect). A best effort after the
    send: never fails the call."""
    run = here()
    held, sent = run.held, run.sent
    if held is None or sent is None or run.held_latest is None:
        return
    took = time.monotonic() - sent
    least = _least_round_trip(held.reach, took)
    if least is None:
        return
    moved = run.held_moved or {}
    # The latest the API may have seen it, after the start's clock: when it went out, and how
    # much longer than the least its answer took.
    seen = timedelta(seconds=sent - held.after + took - least)
    over = {
        key: seen - reach for key, reach in held.reach.items() if seen - reach > moved.get(key, timedelta(0))
    }
    if not over:
        return
    by = max(over.values()) + ANSWER_PAD
    with contextlib.suppress(DatabaseError):
        stands = held.move_on({key: held.buckets.get(key, []) for key in over}, held.start, None, by)
        if stands is not None:
            run.held_moved = {**moved, **dict.fromkeys(over, stands)}


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
        else:
            _remember_ahead(run)  # held when invoked: its window keys remember the send's delay
        run.sent = time.monotonic()


def trace(event: str, info: dict[str, Any]) -> None:
    """An httpcore trace hook: the request's headers start going out (the connection is open),
    and the answer's headers have come."""
    if event.endswith("send_request_headers.started"):
        mark_sent()
    elif event.endswith("receive_response_headers.complete"):
        answered()


def opening() -> None:
    """Say that the running call's request opens its process's first connection to its host, a
    delay that request alone pays (``Sent.opened``; the http handler's client says it)."""
    here().opened = True


def snapshot() -> tuple[float | None, Noted | None, float | None]:
    """Return what this thread's last start noted (to carry to a thread it started a call for)."""
    run = here()
    return run.clock_read, run.noted, run.clock_after


def restore(noted: tuple[float | None, Noted | None, float | None] | None) -> None:
    """Take what another thread's start noted for this thread's call (``dispatcher.combiner``, a message's handler threads)."""
    if noted is not None:
        carry(*noted)


def begin(
    keys: list[str] | None = None, buckets: Buckets | None = None, moved: timedelta = timedelta(0),
    move_on: MoveOn | None = None, start: int = 0, remember: Remember | None = None,
) -> tuple[float | None, Noted | None]:
    """Return, for a call just started, when its start's clock was read and what its start noted
    (for its ``keys`` only, when given); set until when its request is held, and what its
    ``release`` needs: the states its start left its ``buckets`` in, how far a late request had
    moved them on since its start read them (``moved``: its request goes out that much later),
    ``move_on`` and the start's token; and how to ``remember`` a delay as the request goes
    out, for its window keys (``delaywriter.remember_ahead``)."""
    run = here()
    _forget_send(run)
    # A group's start noted all its calls' keys: this call's only.
    noted = run.noted if keys is None or run.noted is None else run.noted.of(keys)
    run.ahead = (
        (noted, remember) if noted is not None and noted.tells_ahead() and remember and run.clock_read is not None
        else None
    )
    if noted is not None and noted.holds and move_on is not None:
        # The start's clock on this process's clock (at the latest just after the start read it):
        # the request then leaves no sooner than the start's clock plus the hold, on the
        # database's time, the moment its buckets judged.
        after, spread = _offsets.at(noted.now, run.clock_after if run.clock_after is not None else time.monotonic())
        after += moved.total_seconds()
        run.hold_until = after + max(noted.holds.values()).total_seconds()
        # A request may leave as much as the spread of that reading later than it counts: its
        # buckets allow it that much less, past what the network's part of the guard takes in
        # (SPREAD_FREE: the spread of a process that has read the clock a few times).
        late = max(timedelta(seconds=spread) - SPREAD_FREE, timedelta(0))
        run.held = Held(
            after, noted.now + moved, {key: noted.allowed[key] - late for key in noted.holds},
            {key: (noted.reach or {}).get(key, noted.allowed[key]) - late for key in noted.holds},
            {key: (buckets or {}).get(key, []) for key in noted.holds}, start, move_on,
        )
    return run.clock_read, noted


def _forget_send(run: Any) -> None:
    """Clear what this thread knew of its last call's send: a handler this thread runs outside a
    worker's run next (a plain task calling ``http``) then holds, moves and tells nothing."""
    run.sent = run.invoked = run.natural = run.hold_until = run.held = run.held_latest = run.held_moved = None
    run.ahead = run.pushing = None
    run.counted_again = run.kept_late = run.opened = False


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
    latest, opened = run.held_latest, run.opened
    if run.pushing is not None:
        # The bucket move its request handed over as it went out: made (what ``overdue`` then
        # leaves out) or given back, before the answer's own move is judged.
        futures.wait([run.pushing], PUSH_WAIT)
    _forget_send(run)
    if clock_read is None or sent is None or natural is None:
        return None
    beyond = timedelta(seconds=max(sent - latest, 0.0)) if latest is not None else timedelta(0)
    return Sent(
        timedelta(seconds=max(sent - clock_read, 0.0)), timedelta(seconds=max(natural - clock_read, 0.0)), beyond,
        opened,
    )
