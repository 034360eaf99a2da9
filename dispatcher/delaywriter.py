"""A late request's start-to-send delay, kept for its window keys before the request goes out
(``remember_ahead``), from whichever thread runs its handler.

A call alone runs its handler on the worker slot's thread, whose connection writes the delay. A
message's handlers run on the process's handler threads, which close their connections after
each handler (a handler that used the database did so on a connection of its own): a write there
would open a database session for one statement. On PostgreSQL those threads hand the write to
this process's delay writer, one thread keeping one connection of its own, and wait for it
(``WAIT`` at most); so does a handler inside its own transaction, whose connection's write would
be seen only once the handler commits. On SQLite a connection is a file opened, and a second one
would wait for a handler's own write lock: a handler thread writes on its own connection, and a
handler inside its own transaction leaves the write to after the answer, as before.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

from django.db import DatabaseError, connections

from dispatcher.arrivals import MOVE_PAD, MOVES, Noted
from dispatcher.limits import ledger
from dispatcher.limits.guard import DelayMemory, remember_delay
from dispatcher.store import schema

log = logging.getLogger("dispatcher")

# Keeps a delay for keys (their memory spans) at once; returns their memories as they then stand
# (None: it could not be kept before the send).
Write = Callable[[dict[str, timedelta], timedelta], "dict[str, DelayMemory] | None"]

# How long a handler waits for the writer (a round trip, or a new session after a lost one).
WAIT = 1.0

_writer: tuple[int, ThreadPoolExecutor] | None = None
_writer_lock = threading.Lock()


def remember_ahead(noted: Noted, clock_read: float, *, write: Write) -> None:
    """Have a running request's window keys remember its delay (from its start's ``clock_read``)
    before it goes out, if what their start ``noted`` does not cover it already (the steady
    state: no round trip); ``write`` keeps it (``remember``).

    A window counts each start under the guard its key's remembered delays call for then, so a
    request that goes out later than its key remembers is counted by the starts after it only
    once its delay is remembered. Kept after its answer, that came too late behind a slow API:
    the starts a period later went out on the guard as it was, within a period of the late
    request (six in a second under 5 per second, ``tests/integration/test_window_late_send.py``).
    A start judged before the write and after the request's own start is within a period of
    it and counts it anyway.

    A process writes one such delay at a time (``_one_write``), and a write another thread made
    meanwhile may cover this one: it is judged again once its turn comes. The delay written is
    the request's then, a pad for the write's way back (``MOVE_PAD``, then as long as the last
    write took) and ``headroom``: the calls of a deep backlog that wait for a handler thread go
    out later and later, each a new largest delay, and without it each wrote before it went (a
    `-c 32` worker wrote before one call in seven). A request later than what was written writes
    again, at most ``MOVES`` times, then goes (its answer's write keeps the rest). A write that
    cannot be seen before the send (SQLite, a handler's own transaction) is left to after the
    answer, as before."""
    pad = MOVE_PAD
    for _ in range(MOVES):
        began = time.monotonic()
        if not _changes(noted, timedelta(seconds=began - clock_read)):
            return
        with _one_write:
            elapsed = timedelta(seconds=time.monotonic() - clock_read)
            if not _changes(noted, elapsed):
                return  # a write made while this one waited covers it
            delay = elapsed + pad + headroom(elapsed)
            kept = write({key: noted.spans[key] for key in _changes(noted, elapsed, delay)}, delay)
            if kept is None:
                return
            # The memories as the database now keeps them: this call's answer, the later calls of
            # its start (they share what it read: ``Noted.of``) and the process's other calls
            # (``_known``) write only what they do not cover.
            noted.kept.update(kept)
            _learn(kept)
        pad = timedelta(seconds=time.monotonic() - began) + MOVE_PAD


# One write before a send at a time, per process (``remember_ahead``).
_one_write = threading.Lock()
# How much more than a late request's delay its write keeps: a share of it, at most a few ms (a
# window counting a start under a guard that much larger keeps period / (period + that) of its
# rate for a span: 10 ms of a second, 1%).
HEADROOM_SHARE = 0.25
HEADROOM_MAX = timedelta(milliseconds=10)


def headroom(delay: timedelta) -> timedelta:
    """Return the headroom a write before a send keeps beyond ``delay``."""
    return min(delay * HEADROOM_SHARE, HEADROOM_MAX)


def _changes(noted: Noted, elapsed: timedelta, delay: timedelta | None = None) -> dict[str, DelayMemory]:
    """Return, per window key whose memory ``delay`` (the request's, ``elapsed``, if None) measured
    ``elapsed`` after its start changes, its memory after it (judged on the latest of what its
    start read and what this process's writes last found)."""
    now = noted.now + elapsed
    delay = elapsed if delay is None else delay
    changed = {}
    with _known_lock:
        known = {key: _known.get(key) for key in noted.windows}
    for key in noted.windows:
        memory = remember_delay(_later(noted.kept.get(key, DelayMemory()), known[key]), now, noted.spans[key], delay)
        if memory is not None:
            changed[key] = memory
    return changed


# Per key, the latest memory this process's writes found the database keeping. The calls of
# other starts read theirs earlier: judged on theirs alone, each wrote its delay again (a -c 32
# worker wrote before about one call in seven, most of them changing nothing). A memory read
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


def _learn(kept: dict[str, DelayMemory]) -> None:
    with _known_lock:
        if len(_known) > MAX_KNOWN:
            _known.clear()
        for key, memory in kept.items():
            _known[key] = _later(memory, _known.get(key))


def _executor() -> ThreadPoolExecutor:
    """This process's delay writer (a forked child makes its own)."""
    global _writer
    pid = os.getpid()
    if _writer is None or _writer[0] != pid:
        with _writer_lock:
            if _writer is None or _writer[0] != pid:
                _writer = (pid, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatcher-delays"))
    return _writer[1]


def _write(spans: dict[str, timedelta], delay: timedelta, db: str) -> dict[str, DelayMemory]:
    try:
        return ledger.remember_send_delay_kept(spans, delay, using=db)
    except DatabaseError:
        connections[db].close()  # the next write opens a new one
        raise


def remember(spans: dict[str, timedelta], delay: timedelta, db: str, *, own: bool) -> dict[str, DelayMemory] | None:
    """Keep ``delay`` for these keys (with their memory spans) now. ``own``: this thread keeps its
    connection (a worker slot's), else it closes it after each handler (a handler thread).
    Return the keys' memories as they then stand; None where it could not be kept before the send."""
    atomic = connections[db].in_atomic_block
    writer = schema.postgresql_path(db) and (atomic or not own)
    if atomic and not writer:
        return None
    try:
        if not writer:
            kept = ledger.remember_send_delay_kept(spans, delay, using=db)
        else:
            kept = _executor().submit(_write, spans, delay, db).result(WAIT)
    except (DatabaseError, FutureTimeout) as exc:
        log.warning("send_delay_not_kept_ahead keys=%s error=%r", ",".join(spans)[:200], exc)
        return None
    log.info("send_delay_ahead keys=%s delay_ms=%.1f", ",".join(spans)[:200], delay.total_seconds() * 1000)
    return kept


def close() -> None:
    """Close the writer's connections, if this process has one (before a database is dropped)."""
    if _writer is not None and _writer[0] == os.getpid():
        _writer[1].submit(connections.close_all).result(WAIT)
