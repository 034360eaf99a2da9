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

# Keeps a delay for keys (their memory spans) at once: False if it could not be kept before the send.
Write = Callable[[dict[str, timedelta], timedelta], bool]

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
    it and counts it anyway. The delay written is the request's when the write is made and a pad
    for its way back (``MOVE_PAD``, then as long as the last write took: several handler threads'
    writes queue at one writer); a request later than that writes
    again, at most ``MOVES`` times, then goes (its answer's write keeps the rest). A write that
    cannot be seen before the send (SQLite, a handler's own transaction) is left to after the
    answer, as before."""
    pad = MOVE_PAD
    for _ in range(MOVES):
        began = time.monotonic()
        elapsed = timedelta(seconds=began - clock_read)
        if not _changes(noted, elapsed, elapsed):
            return
        changed = _changes(noted, elapsed, elapsed + pad)
        if not write({key: noted.spans[key] for key in changed}, elapsed + pad):
            return
        noted.kept.update(changed)  # its answer's write is then skipped (``to_write``)
        pad = timedelta(seconds=time.monotonic() - began) + MOVE_PAD


def _changes(noted: Noted, elapsed: timedelta, delay: timedelta) -> dict[str, DelayMemory]:
    """Return, per window key whose memory a delay measured ``elapsed`` after its start changes,
    its memory after it."""
    now = noted.now + elapsed
    changed = {}
    for key in noted.windows:
        memory = remember_delay(noted.kept.get(key, DelayMemory()), now, noted.spans[key], delay)
        if memory is not None:
            changed[key] = memory
    return changed


def _executor() -> ThreadPoolExecutor:
    """This process's delay writer (a forked child makes its own)."""
    global _writer
    pid = os.getpid()
    if _writer is None or _writer[0] != pid:
        with _writer_lock:
            if _writer is None or _writer[0] != pid:
                _writer = (pid, ThreadPoolExecutor(max_workers=1, thread_name_prefix="dispatcher-delays"))
    return _writer[1]


def _write(spans: dict[str, timedelta], delay: timedelta, db: str) -> None:
    try:
        ledger.remember_send_delay(spans, delay, using=db)
    except DatabaseError:
        connections[db].close()  # the next write opens a new one
        raise


def remember(spans: dict[str, timedelta], delay: timedelta, db: str, *, own: bool) -> bool:
    """Keep ``delay`` for these keys (with their memory spans) now. ``own``: this thread keeps its
    connection (a worker slot's), else it closes it after each handler (a handler thread).
    Return False where it could not be kept before the send."""
    atomic = connections[db].in_atomic_block
    writer = schema.postgresql_path(db) and (atomic or not own)
    if atomic and not writer:
        return False
    try:
        if not writer:
            ledger.remember_send_delay(spans, delay, using=db)
        else:
            _executor().submit(_write, spans, delay, db).result(WAIT)
    except (DatabaseError, FutureTimeout) as exc:
        log.warning("send_delay_not_kept_ahead keys=%s error=%r", ",".join(spans)[:200], exc)
        return False
    log.info("send_delay_ahead keys=%s delay_ms=%.1f", ",".join(spans)[:200], delay.total_seconds() * 1000)
    return True


def close() -> None:
    """Close the writer's connections, if this process has one (before a database is dropped)."""
    if _writer is not None and _writer[0] == os.getpid():
        _writer[1].submit(connections.close_all).result(WAIT)
