"""A worker process's threads for the handlers of messages of several calls, and when such a
message may start its calls (``worker.execute_many``).

A ``-P threads -c N`` worker takes N messages at once, and a deep backlog puts up to
``DISPATCHER_CALLS_PER_MESSAGE`` calls in each: far more calls than the N threads that run them.
A message that started all its calls as it arrived counted them started (their keys' windows,
their attempts) long before a thread could send their requests: their start-to-send delays,
which a key's arrival guard learns, held the wait behind every other message's calls (measured:
600 calls of 100 ms, `-c 32`, 16 per message: the largest 1.2-1.6 s, where the guard stops at
GUARD_MAX, 250 ms). So a message reserves room for its calls first: it starts them while fewer
calls wait for a thread than the process has threads (one round of handlers), and waits
otherwise (the same rows: 0.1-0.35 s on a loaded machine).

A round of slow handlers (an API that answers in seconds) is longer than any guard: a call
started behind it would go out seconds after its start. So a message also starts only the calls
the process's threads are expected to take within AHEAD, by how long its handlers lately took
and how long those at work have run; while none of this process's calls waits for a thread, it
starts the part that fits and the rest as threads come free (``worker.execute_many``). Until a
handler of the process has returned, nothing is known of their time: only idle threads count.
"""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from dispatcher import liveness

T = TypeVar("T")
R = TypeVar("R")

# Most handlers a process whose pool is not threads (a prefork child: one message at a time) runs
# at once; a message's further calls start as one returns.
MESSAGE_THREADS = 8

# The longest a message waits for room before it starts its calls anyway (seconds): a bound on a
# wait that handlers stuck on a slow API could make long, not a pace.
ROOM_WAIT = 60.0

# The threads that run messages' handlers, kept by each process and reused (started as needed):
# starting a message's threads anew was ~8% of a grouped -c 32 worker's GIL time. Their number
# is the process's whole budget of handlers at once (``handler_threads``); what a message hands
# over beyond it waits in the pool's queue for a thread.
_pool: tuple[tuple[int, int], ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()

# Calls of this process's messages that have room reserved and no thread yet (``reserve``).
_waiting = 0
# Guards the room's counts and the messages asking for room, each of which waits on a condition
# of its own: it is woken when it is given room, not each time a thread takes a call. (One
# condition for all, notified as each call was taken, woke every waiting message each time: a
# -c 32 worker's 30 or so, each to win the GIL back, look and wait again, about 8,000 wake-ups a
# second, a sixth of the process's GIL time for these messages.)
_lock = threading.Lock()
_asks: list[_Ask] = []


@dataclass(eq=False)
class _Ask:
    """A message's calls waiting for room (``reserve``), in the order they asked."""

    calls: int
    ready: threading.Condition
    granted: int | None = None


# How soon a call must be expected to take a thread for its message to start it (seconds): well
# within what a key's learnt guard covers (GUARD_MAX, 250 ms, less the configured 20 ms).
AHEAD = 0.2
# How often a message waiting for room looks again (seconds): a thread at work nears its end
# with no one to say so.
RECHECK = 0.05
# The handlers at work in this process (when each began, by thread), and how long its handlers
# lately took (seconds; an average weighted TOOK_WEIGHT to the latest; None: none returned yet).
_running: dict[int, float] = {}
_took: float | None = None
TOOK_WEIGHT = 0.2


def handler_threads() -> int:
    """How many handlers of messages one process runs at once: its worker's pool size where that
    is one process's (threads, gevent: the ``-c`` its slots take), else MESSAGE_THREADS (a
    prefork child, which takes one message at a time).

    Not the slots times MESSAGE_THREADS: every thread at work in one process shares its GIL,
    and past about 40 of them at once a -c 32 worker's CPU per call doubled (2.3 ms at 32 to 4.4-
    5.7 ms at 256, the rate falling with it; httpx alone, one client: 0.8-1.0 ms per request at up
    to 64 threads at once, 4.7-7.8 ms at 96 and more). A worker of ``-P threads -c N`` so has at
    most max(N, 8) calls in flight, as a plain Celery worker of the same pool has N.
    """
    return max(MESSAGE_THREADS, liveness.process_slots() or 0)


def handler_pool() -> ThreadPoolExecutor:
    """This process's pool of handler threads (a forked child makes its own; one made before the
    worker said its size is replaced once it has)."""
    global _pool
    key = (os.getpid(), handler_threads())
    if _pool is None or _pool[0] != key:
        with _pool_lock:
            if _pool is None or _pool[0] != key:
                old = _pool[1] if _pool is not None and _pool[0][0] == key[0] else None
                _pool = (key, ThreadPoolExecutor(max_workers=key[1], thread_name_prefix="dispatcher-call"))
                if old is not None:
                    old.shutdown(wait=False)  # its handlers at work finish; its threads then end
    return _pool[1]


def reserve(calls: int, timeout: float = ROOM_WAIT, *, anyway: bool = True) -> int:
    """Wait until a message's ``calls`` have room (at most ``timeout``), count those that may start
    now as waiting for a handler thread, and return how many they are: all of them, once fewer
    calls wait than the process has threads and its threads are expected to take them all within
    AHEAD; the part expected to be taken so, while no call waits; when ``timeout`` passes, all
    (``anyway``) or none. Each stops waiting once a thread takes it (``hand_over``) or its room is
    given back (``give_back``: it did not start).

    Messages are given room in the order they asked, each as soon as it fits (a smaller one may
    pass a larger one that does not fit yet)."""
    global _waiting
    deadline = time.monotonic() + timeout
    with _lock:
        ask = _Ask(calls, threading.Condition(_lock))
        _asks.append(ask)
        try:
            while True:
                now = time.monotonic()
                _grant(now)
                if ask.granted is not None:
                    return ask.granted
                if now >= deadline:
                    fit = calls if anyway else 0
                    _waiting += fit
                    return fit
                # The first message asking looks again now and then: what the threads are expected
                # to take changes with time alone. The others wait to be given room (``_grant``).
                ask.ready.wait(min(deadline - now, RECHECK) if _asks[0] is ask else deadline - now)
        finally:
            if ask.granted is None:
                _leave(ask)


def _grant(now: float) -> None:
    """Give room to the messages asking for it that fit now, in the order they asked, and wake
    each. Under ``_lock``."""
    global _waiting
    limit = handler_threads()
    if not _asks or _waiting >= limit:
        return
    expected = _expected(limit, now)
    for ask in list(_asks):
        fit = min(ask.calls, max(expected - _waiting, 0)) if _waiting < limit else 0
        if not fit:
            break  # a later message fits no better
        if fit == ask.calls or not _waiting:
            ask.granted = fit
            _waiting += fit
            _leave(ask)
            ask.ready.notify()


def _leave(ask: _Ask) -> None:
    """Take a message off the asking list; a new first one is woken to look again with time. Under ``_lock``."""
    first = _asks[0] is ask
    _asks.remove(ask)
    if first and _asks:
        _asks[0].ready.notify()


def _expected(limit: int, now: float) -> int:
    """How many calls this process's ``limit`` threads are expected to take within AHEAD, from how
    long its handlers lately took and how long those at work have run (a handler at work twice
    that long is not expected back soon). Until a handler has returned, the idle threads alone.
    Under ``_lock``."""
    idle = max(limit - len(_running), 0)
    if _took is None:
        return idle
    took = max(_took, 1e-4)
    each = 1 + math.floor(AHEAD / took)  # what an idle thread takes within AHEAD
    expected = idle * each
    for began in _running.values():
        ran = now - began
        left = max(took - ran, 0.0)
        if ran <= 2 * took and left <= AHEAD:
            expected += 1 + math.floor((AHEAD - left) / took)
    return expected


def give_back(calls: int) -> None:
    """Return the room of reserved calls that will not be handed over."""
    global _waiting
    if calls:
        with _lock:
            _waiting -= calls
            _grant(time.monotonic())


def hand_over(runs: Iterable[T], handler: Callable[[T], R]) -> dict[Future[R], T]:
    """Give reserved calls to the pool's threads; each stops waiting as a thread takes it. Room
    reserved for a call the pool refused (it was shut down) is given back."""
    pool, runs = handler_pool(), list(runs)
    futures: dict[Future[R], T] = {}
    try:
        for run in runs:
            futures[pool.submit(_taken, handler, run)] = run
    finally:
        give_back(len(runs) - len(futures))
    return futures


def _taken(handler: Callable[[T], R], run: T) -> R:
    """Run a reserved call's handler in a pool thread: it stops waiting, and its time is kept."""
    global _waiting, _took
    thread, began = threading.get_ident(), time.monotonic()
    with _lock:
        _waiting -= 1
        _running[thread] = began
        _grant(began)
    try:
        return handler(run)
    finally:
        took = time.monotonic() - began
        with _lock:
            _running.pop(thread, None)
            _took = took if _took is None else _took + TOOK_WEIGHT * (took - _took)
            if not _waiting:  # else the thread takes a waiting call next (and says so)
                _grant(time.monotonic())


def waiting() -> int:
    """How many calls of this process wait for a handler thread, their room reserved."""
    return _waiting
