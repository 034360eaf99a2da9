"""A late request's start-to-send delay, kept for its window keys as it goes out
(``remember_ahead``), and its lateness, moving its unheld buckets on (``move_ahead``), by one
writer thread per worker process; and a held request's move made inside its handler's own
transaction (``move_on``).

A window counts each start under the guard its key's remembered delays call for then, so a
request that goes out later than its key remembers is counted by the starts after it only once
its delay is remembered. Kept after its answer, that came too late behind a slow API: the starts
a period later went out on the guard as it was, within a period of the late request (six in a
second under 5 per second, ``tests/integration/test_window_late_send.py``). The starts that need
it come a period after the request's own start at the earliest (one judged sooner is within a
period of it and counts it anyway), so its delay is handed to this process's writer as the
request goes out, and the request does not wait for the write unless the key's shortest window
period leaves less than ``WAIT_WITHIN`` for it. Waiting for every such write made each request
that late later still by the write (and a process's first by opening the writer's connection):
paired with the tree before, the shaped windows at the API fell from 96.0-97.5% to 91.4-94.4%.

The writer is one thread with one connection of its own, kept for the process's life: a
message's handler threads close their connections after each handler, and a handler's own
transaction would hold the write until it commits. It writes one delay at a time, and judges
each again against what the database kept at the process's last write (``_known``) when its
turn comes: a backlog's calls that wait for a handler thread go out later and later, each a new
largest delay, and a write made meanwhile covers most of them.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections

from dispatcher.arrivals import MOVE_PAD, MOVES, Buckets, Noted
from dispatcher.conf import dispatcher_settings
from dispatcher.limits import ledger
from dispatcher.limits.guard import GUARD_MAX, DelayMemory, remember_delay
from dispatcher.running import here

log = logging.getLogger("dispatcher")

# A request waits for its delay's write when its keys' shortest window period, counted from its
# start, leaves less than this for it (a write takes milliseconds; a window of a second leaves
# three quarters of it after the latest send the guard's cap allows).
WAIT_WITHIN = timedelta(milliseconds=500)
# How long a request waits for its write at most (a round trip, or a new session after a lost one).
WAIT = 1.0
# How much more than a late request's delay its write keeps: a share of it, at most a few ms, so
# that a backlog's later and later calls do not each write (a window counting its starts under a
# guard 5 ms larger keeps period / (period + 5 ms) of its rate for a span: 99.75% of 2 s).
HEADROOM_SHARE = 0.1
HEADROOM_MAX = timedelta(milliseconds=5)


def remember_ahead(noted: Noted, clock_read: float, *, db: str) -> Future[None] | None:
    """Hand the running request's delay (from its start's ``clock_read``) to the writer for its
    window keys, where what their start ``noted`` (or this process's last write) does not cover
    it; wait for the write only if their shortest window leaves less than ``WAIT_WITHIN``.
    Hand it its lateness for its unheld buckets too (``move_ahead``); return that move, if any."""
    moved = move_ahead(noted, clock_read, db=db)
    count_again(noted, clock_read, db=db)
    if here().opened:
        # Its connection's delay, not its keys' (``arrivals.Sent``): kept as a late start if late.
        keep_late(noted, clock_read, db=db)
        return moved
    for _ in range(MOVES):
        elapsed = timedelta(seconds=time.monotonic() - clock_read)
        if not _changes(noted, elapsed):
            return moved
        delay = elapsed + MOVE_PAD + min(elapsed * HEADROOM_SHARE, HEADROOM_MAX)
        spans = {key: noted.spans[key] for key in _changes(noted, elapsed, delay)}
        written = _executor().submit(_write, spans, elapsed, delay, noted.now + elapsed, time.monotonic(), db, noted.kept)
        if min(noted.windows[key] for key in spans) - elapsed >= WAIT_WITHIN:
            return moved
        if not _wait(written):
            return moved  # else a request later than what was written writes again
    return moved


def count_again(noted: Noted, clock_read: float, *, db: str) -> None:
    """Have the writer log the running call's start again in its window keys' logs, now, if its
    request goes out later than any guard a window counts under (``GUARD_MAX`` less the
    configured guard): the windows then count it from its send too (``ledger.count_again``).

    Its delay is kept as for any late request, but the guard a window counts under stops at the
    cap, so the starts a period after its start were judged without it: in the shaped benchmark
    a request 318 ms after its start (a loaded machine's worker) met a 429 two seconds later
    behind a window of 10 per 2 s. Counted twice for a period, it costs its windows one call's
    units, once per call that late. The request waits for it only where the key's shortest
    window leaves less than ``WAIT_WITHIN`` after its start, as for its delay."""
    run = here()
    if not noted.windows or run.call is None or run.counted_again:
        return
    elapsed = timedelta(seconds=time.monotonic() - clock_read) + MOVE_PAD
    cap = dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX)
    if elapsed <= cap - dispatcher_settings.ARRIVAL_GUARD:
        return
    run.counted_again = True
    counted = _executor().submit(_count_again, list(noted.windows), run.call.id, db)
    if min(noted.windows.values()) - elapsed < WAIT_WITHIN:
        _wait(counted)


def keep_late(noted: Noted, clock_read: float, *, db: str) -> None:
    """Have the writer keep the running call's start as a late start on its window keys
    (``ledger.keep_late``) where its request, its process's first to its host
    (``arrivals.Sent.opened``), goes out later than the delay its start counted it under.

    Such a request's delay is not remembered: a window counts every start of the next span or
    two under the delay its key remembers, and pays it at every turn. Kept as a late start, its
    windows count that start alone until a period after its arrival, exactly as long as the
    API's window holds it, and no other start is taxed by it. A key that keeps ``LATE_MAX`` late
    starts already remembers the delay instead. The request waits for the write only where the
    key's shortest window leaves less than ``WAIT_WITHIN`` after its start, as for its delay."""
    run = here()
    if not noted.windows or run.call is None or run.counted_again:
        return  # a request past the cap is logged again from its send (``count_again``)
    elapsed = timedelta(seconds=time.monotonic() - clock_read) + MOVE_PAD
    floor = dispatcher_settings.ARRIVAL_GUARD
    beyond = dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX) - floor
    keys = [key for key in noted.windows if elapsed > min(noted.allowed.get(key, beyond), beyond)]
    if not keys:
        return
    spans = {key: noted.spans[key] for key in keys}
    run.kept_late = True
    kept = _executor().submit(_keep_late, spans, run.call.id, elapsed, elapsed + floor, noted, db)
    if min(noted.windows[key] for key in keys) - elapsed < WAIT_WITHIN:
        _wait(kept)


def _keep_late(
    spans: dict[str, timedelta], call_id: int, elapsed: timedelta, reach: timedelta, noted: Noted, db: str
) -> None:
    """On the writer: keep the late start; the keys that keep too many remember its delay, as do
    all its keys if it could not be kept (the request's answer leaves them alone: ``to_write``)."""
    try:
        full = ledger.keep_late(spans, call_id, reach, using=db)
    except DatabaseError as exc:
        log.warning("late_start_not_kept call=%s error=%r; remembering its delay", call_id, exc)
        connections[db].close()  # the write below opens a new one
        full = list(spans)
    else:
        log.info("late_start_kept call=%s keys=%s reach_ms=%.1f", call_id, ",".join(spans)[:200], reach.total_seconds() * 1000)
    if full:
        _write({key: spans[key] for key in full}, elapsed, elapsed, noted.now + elapsed, time.monotonic(), db, noted.kept)


def _count_again(keys: list[str], call_id: int, db: str) -> None:
    try:
        counted = ledger.count_again(keys, call_id, using=db)
    except DatabaseError as exc:
        log.warning("start_not_counted_again call=%s error=%r", call_id, exc)
        connections[db].close()  # the next write opens a new one
        raise
    log.info("start_counted_again call=%s keys=%s", call_id, counted)


def move_ahead(noted: Noted, clock_read: float, *, db: str) -> Future[None] | None:
    """Hand the writer the running request's lateness for its keys' unheld buckets: how much
    later than their start allowed it goes out, a pad for the rest of its way, less what the
    start's late requests moved them on already (``Noted.pushed``, which takes it at once).

    Such a bucket's state is charged at the start, under the guard its key's delays called for
    then; a request sent later arrives later, and the API's bucket has that much less left for
    the starts after it (a bucket full meanwhile refills no further). Its tokens held back cover
    a lateness up to its guard; the buckets moved on only after the answer, a start judged
    before a slow answer went out on them as they were (``tests/integration/
    test_bucket_late_send.py``: the third of a burst refused at the API). Moved on as it goes out,
    the starts judged after the move leave it that much room; the request does not wait for the
    move (one judged between its start and the move was judged on the bucket as it was, whether
    the move is waited for or not). The calls of one start move their buckets on by the latest
    of them, not each by its own (the tokens of one start are charged at one moment)."""
    if noted.pushed is None:
        return None
    late = timedelta(seconds=time.monotonic() - clock_read) + MOVE_PAD
    with _known_lock:
        moves = {}
        for key, periods in noted.unheld_buckets().items():
            by = late - noted.allowed.get(key, timedelta(0)) - noted.pushed.get(key, timedelta(0))
            if by > timedelta(0):
                moves[key] = (periods, by)
                noted.pushed[key] = noted.pushed.get(key, timedelta(0)) + by
    if not moves:
        return None
    return _executor().submit(_move, moves, noted.pushed, db)


def _move(moves: dict[str, tuple[list[timedelta], timedelta]], pushed: dict[str, timedelta], db: str) -> None:
    """On the writer: move the buckets on; if that fails, give the moves back to the start's
    ``pushed`` (the request's answer then moves them on: ``arrivals.overdue``)."""
    try:
        ledger.push_buckets(moves, using=db)
    except DatabaseError as exc:
        log.warning("send_late_not_moved_ahead keys=%s error=%r", ",".join(moves)[:200], exc)
        connections[db].close()  # the next write opens a new one
        with _known_lock:
            for key, (_, by) in moves.items():
                pushed[key] -= by
        raise
    log.info("send_late_ahead buckets=%s", {key: str(by) for key, (_, by) in moves.items()})


def _wait(written: Future[Any]) -> bool:
    """Wait for a write; return whether it was made."""
    try:
        written.result(WAIT)
    except (DatabaseError, FutureTimeout) as exc:
        log.warning("send_delay_not_kept_ahead error=%r", exc)
        return False
    return True


def _changes(noted: Noted, elapsed: timedelta, delay: timedelta | None = None) -> dict[str, DelayMemory]:
    """Return, per window key whose memory ``delay`` (the request's, ``elapsed``, if None) measured
    ``elapsed`` after its start changes, its memory after it (judged on the later of what its
    start read and what this process's last write found)."""
    now = noted.now + elapsed
    delay = elapsed if delay is None else delay
    with _known_lock:
        known = {key: _known.get(key) for key in noted.windows}
    changed = {}
    for key in noted.windows:
        memory = remember_delay(_later(noted.kept.get(key, DelayMemory()), known[key]), now, noted.spans[key], delay)
        if memory is not None:
            changed[key] = memory
    return changed


# Per key, the latest memory this process's writes found the database keeping. A memory read
# earlier only ever asks for more writes than a later one (its span rolls over no later, it holds
# no more), so the later of the two is judged on.
_known: dict[str, DelayMemory] = {}
_known_lock = threading.Lock()
# Keys whose memory one process keeps, at most (cleared when full).
MAX_KNOWN = 10_000


def _later(read: DelayMemory, known: DelayMemory | None) -> DelayMemory:
    """Return the later of two readings of a key's memory (the later span, then the larger)."""
    if known is None or known.since is None:
        return read
    if read.since is None or known.since > read.since:
        return known
    if known.since == read.since and known.current > read.current:
        return known
    return read


_writer: tuple[int, ThreadPoolExecutor] | None = None
_writer_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """This process's delay writer (a forked child makes its own)."""
    global _writer
    pid = os.getpid()
    if _writer is None or _writer[0] != pid:
        with _writer_lock:
            if _writer is None or _writer[0] != pid:
                _writer = (pid, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatcher-delays"))
    return _writer[1]


def _write(
    spans: dict[str, timedelta], measured: timedelta, delay: timedelta, now: datetime, handed: float, db: str,
    read: dict[str, DelayMemory],
) -> dict[str, DelayMemory]:
    """On the writer: keep ``delay`` (``measured`` and its pad) for the keys whose memory, as this
    process last found it, does not cover what was measured by now; return their memories as the
    database then keeps them, and put them in what the request's start ``read`` (the later calls
    of that start, and the request's answer, then write only what they do not cover)."""
    now += timedelta(seconds=time.monotonic() - handed)
    with _known_lock:
        spans = {
            key: span for key, span in spans.items()
            if remember_delay(_known.get(key, DelayMemory()), now, span, measured) is not None
        }
    if not spans:
        return {}
    try:
        kept = ledger.remember_send_delay_kept(spans, delay, using=db)
    except DatabaseError as exc:
        log.warning("send_delay_not_kept_ahead keys=%s error=%r", ",".join(spans)[:200], exc)
        connections[db].close()  # the next write opens a new one
        raise
    with _known_lock:
        if len(_known) > MAX_KNOWN:
            _known.clear()
        for key, memory in kept.items():
            _known[key] = _later(memory, _known.get(key))
    read.update(kept)
    log.info("send_delay_ahead keys=%s delay_ms=%.1f", ",".join(spans)[:200], delay.total_seconds() * 1000)
    return kept


def move_on(moved: Buckets, start: int, deadline: datetime | None, pad: timedelta, *, db: str) -> timedelta | None:
    """Move a held request's buckets on (``ledger.move_on``) on the writer's connection, for a
    handler that sends inside a transaction of its own (its connection's move would be seen
    only once it commits, and the request would not go); wait for it, at most ``WAIT``."""
    moving = _executor().submit(_move_on, moved, start, deadline, pad, db)
    try:
        return moving.result(WAIT)
    except FutureTimeout:
        raise DatabaseError(f"the delay writer did not move the buckets on within {WAIT} s") from None


def _move_on(moved: Buckets, start: int, deadline: datetime | None, pad: timedelta, db: str) -> timedelta | None:
    try:
        return ledger.move_on(moved, start, deadline, pad, using=db)
    except DatabaseError:
        connections[db].close()  # the next write opens a new one
        raise


def open_connection(db: str, **_: object) -> None:
    """Have this process's writer open its connection now, not at the first late request (which
    it would make later still: a new database session's setup in the process as the request
    goes out, and the process's next requests behind it). Does not wait for it."""
    _executor().submit(_connect, db)


def _connect(db: str) -> None:
    try:
        connections[db].ensure_connection()
    except DatabaseError as exc:
        log.warning("delay_writer_not_connected error=%r", exc)  # the first write connects again


def close() -> None:
    """Close the writer's connections, if this process has one (before a database is dropped)."""
    if _writer is not None and _writer[0] == os.getpid():
        _writer[1].submit(connections.close_all).result(WAIT)
