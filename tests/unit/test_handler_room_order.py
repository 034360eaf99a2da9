"""A process's messages asking for handler room (``dispatcher.handlerpool.reserve``) are given it
in the order they asked, each as soon as it fits, by whatever frees the room: real threads, no
database (a process that is not a worker's main one has MESSAGE_THREADS threads)."""
from __future__ import annotations

import threading
import time

import pytest

from dispatcher import handlerpool

LIMIT = handlerpool.MESSAGE_THREADS


@pytest.fixture(autouse=True)
def _empty_room():
    """No call waits and none asks before or after a test (the conftest forgets handler times)."""
    assert handlerpool.waiting() == 0 and not handlerpool._asks
    yield
    handlerpool.give_back(handlerpool.waiting())
    assert not handlerpool._asks


class Asker:
    """A message asking for room in a thread of its own, as a worker's slot does."""

    def __init__(self, calls: int, timeout: float = 20.0, *, anyway: bool = True) -> None:
        self.granted: int | None = None
        self._thread = threading.Thread(target=self._ask, args=(calls, timeout, anyway))
        self._thread.start()

    def _ask(self, calls: int, timeout: float, anyway: bool) -> None:
        self.granted = handlerpool.reserve(calls, timeout, anyway=anyway)

    def join(self) -> int | None:
        self._thread.join(20)
        return self.granted


def _asking(count: int) -> None:
    """Wait (at most 10 s) until ``count`` messages ask for room."""
    deadline = time.monotonic() + 10
    while len(handlerpool._asks) < count and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(handlerpool._asks) == count


def test_room_given_back_goes_to_the_messages_that_asked_in_their_order():
    assert handlerpool.reserve(LIMIT) == LIMIT  # every idle thread's room taken
    first = Asker(LIMIT - 2)
    _asking(1)
    second = Asker(2)
    _asking(2)
    third = Asker(1)
    _asking(3)

    handlerpool.give_back(LIMIT)

    # The first two fit the idle threads together; the third waits: the room is spoken for.
    assert (first.join(), second.join()) == (LIMIT - 2, 2)
    assert handlerpool.waiting() == LIMIT and len(handlerpool._asks) == 1
    handlerpool.give_back(1)
    assert third.join() == 1


def test_a_smaller_message_passes_one_that_does_not_fit_yet():
    assert handlerpool.reserve(2) == 2
    large = Asker(LIMIT)  # fits only once the two waiting calls are gone
    _asking(1)
    small = Asker(3)
    assert small.join() == 3
    assert large.granted is None and handlerpool.waiting() == 5

    handlerpool.give_back(5)
    assert large.join() == LIMIT


def test_with_no_call_waiting_a_message_is_given_the_part_that_fits():
    # Two handlers at work: the six idle threads' room goes to the first message, in part.
    with handlerpool._lock:
        handlerpool._running.update({-1: time.monotonic(), -2: time.monotonic()})
    try:
        assert handlerpool.reserve(LIMIT) == LIMIT - 2
    finally:
        with handlerpool._lock:
            handlerpool._running.clear()


def test_a_message_that_may_not_start_anyway_leaves_empty_handed_and_the_next_one_is_served():
    assert handlerpool.reserve(LIMIT) == LIMIT
    leaving = Asker(3, timeout=0.3, anyway=False)
    staying = Asker(3)
    assert leaving.join() == 0
    _asking(1)
    assert staying.granted is None

    handlerpool.give_back(3)
    assert staying.join() == 3
