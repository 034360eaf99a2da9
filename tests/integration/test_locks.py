"""Row locks held on a second connection while the dispenser claims and a worker starts.

As Django's own select_for_update tests do: one thread holds ``SELECT ... FOR UPDATE`` in an open
transaction on its own connection; the code under test runs on another. The design: a claim
skips call rows locked elsewhere (``FOR UPDATE SKIP LOCKED``) but waits for its keys' rows (the
limiter's lock, taken in key order); a start waits for its keys and then for its call row, and
judges what it finds once they are free.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections, transaction

from dispatcher.clock import db_now
from dispatcher.limits import ledger, locks
from dispatcher.models import CallQueue, KeyState
from support.processes import wait_until
from tests.claims import claim as claim_key_set

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

# Every wait here is bounded: a lock is held this long at the most, a thread joined within it.
BOUND = 30


@contextmanager
def held_elsewhere(lock: Callable[[], Any]) -> Iterator[None]:
    """Run ``lock`` in a transaction on a thread's own connection and keep it open until the block ends."""
    locked, release = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def holder() -> None:
        try:
            with transaction.atomic():
                lock()
                locked.set()
                release.wait(timeout=BOUND)
        except BaseException as exc:  # reported to the test below
            failure.append(exc)
        finally:
            locked.set()
            connections.close_all()  # this thread's connections only

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(timeout=BOUND) and not failure, failure
        yield
    finally:
        release.set()
        thread.join(timeout=BOUND)
    assert not thread.is_alive() and not failure, failure


class InThread:
    """Runs a function on a thread of its own, so on a database connection of its own."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.pid: int | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,))
        self._thread.start()
        assert self._ready.wait(timeout=BOUND) and self.pid is not None, self.error

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                self.pid = cursor.fetchone()[0]
            self._ready.set()
            self.result = fn()
        except BaseException as exc:  # re-raised by join()
            self.error = exc
        finally:
            self._ready.set()
            connections.close_all()

    def waits_for_a_lock(self) -> bool:
        """Whether PostgreSQL has the thread's statement waiting for a lock another session holds."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT cardinality(pg_blocking_pids(%s)) > 0", [self.pid])
            return bool(cursor.fetchone()[0])

    def join(self) -> Any:
        self._thread.join(timeout=BOUND)
        assert not self._thread.is_alive(), "still waiting after the lock was released"
        if self.error is not None:
            raise self.error
        return self.result


def claim(key_set: str, limit: int = 10) -> list[int]:
    return [c.id for c in claim_key_set(key_set, limit).calls]


def lock_calls(*ids: int) -> Callable[[], Any]:
    return lambda: list(CallQueue.objects.select_for_update().filter(id__in=ids))


def lock_key_and_pause(key: str, minutes: int) -> Callable[[], Any]:
    """Lock a key's row as a claim or start would, and pause the key in the same transaction."""

    def lock() -> None:
        locks.lock_keys([key])
        KeyState.objects.filter(key=key).update(paused_until=db_now() + timedelta(minutes=minutes), pause_reason="test")

    return lock


def test_claim_skips_calls_locked_elsewhere_and_takes_them_once_released(make_call):
    first, second, third = make_call(), make_call(), make_call()
    with held_elsewhere(lock_calls(first.id)):
        assert claim(first.key_set) == [second.id, third.id]
        assert CallQueue.objects.get(id=first.id).status == CallQueue.Status.PENDING
    assert claim(first.key_set) == [first.id]


def test_claim_waits_for_a_key_locked_elsewhere_and_obeys_the_pause_committed_meanwhile(make_call):
    call = make_call()
    locks.lock_keys(["api"])  # the key's row exists, as after any earlier claim
    with held_elsewhere(lock_key_and_pause("api", minutes=5)):
        claiming = InThread(lambda: claim(call.key_set))
        assert wait_until(claiming.waits_for_a_lock, timeout=BOUND)
        assert CallQueue.objects.get(id=call.id).status == CallQueue.Status.PENDING
    assert claiming.join() == []
    assert CallQueue.objects.get(id=call.id).status == CallQueue.Status.PENDING


def test_start_waits_for_its_key_locked_elsewhere_and_defers_to_the_pause_committed_meanwhile(make_call):
    call = make_call()
    assert claim(call.key_set) == [call.id]
    dispatch_no = CallQueue.objects.get(id=call.id).dispatch_no
    with held_elsewhere(lock_key_and_pause("api", minutes=5)):
        starting = InThread(lambda: CallQueue.objects.start(call.id, dispatch_no))
        assert wait_until(starting.waits_for_a_lock, timeout=BOUND)
        assert CallQueue.objects.get(id=call.id).status == CallQueue.Status.DISPATCHED
    started = starting.join()
    assert started.state == "deferred" and "paused" in started.reason
    stored = CallQueue.objects.get(id=call.id)
    assert stored.status == CallQueue.Status.PENDING and stored.attempts == 0
    # It keeps its place (its run_at); the pause holds it, as every dispenser reads it.
    assert stored.run_at == call.run_at
    assert claim(call.key_set) == []


def test_start_waits_for_its_call_row_and_finds_it_taken_back_by_then(make_call):
    call = make_call()
    assert claim(call.key_set) == [call.id]
    dispatch_no = CallQueue.objects.get(id=call.id).dispatch_no

    def take_back() -> None:
        # What a rescue does to a dispatched call it judges lost: lock the row, make it wait again.
        lock_calls(call.id)()
        CallQueue.objects.filter(id=call.id).update(status=CallQueue.Status.PENDING, dispatched_at=None)

    with held_elsewhere(take_back):
        starting = InThread(lambda: CallQueue.objects.start(call.id, dispatch_no))
        assert wait_until(starting.waits_for_a_lock, timeout=BOUND)
    started = starting.join()
    assert started.state == "stale"
    stored = CallQueue.objects.get(id=call.id)
    assert stored.status == CallQueue.Status.PENDING and stored.attempts == 0 and not stored.attempt_set.exists()


def test_a_send_delay_write_of_several_keys_takes_them_in_key_order():
    # Rows placed in the table against key order ("b" before "a"): an UPDATE finds them that way.
    locks.lock_keys(["order:b"])
    locks.lock_keys(["order:a"])
    spans = {"order:a": timedelta(seconds=1), "order:b": timedelta(seconds=1)}
    # A start of both keys holds "order:a" and will ask for "order:b" next.
    with held_elsewhere(lambda: locks.lock_keys(["order:a"])):
        write = InThread(lambda: ledger.remember_send_delay(spans, timedelta(milliseconds=7)))
        assert wait_until(write.waits_for_a_lock, BOUND)
        # The write waits for "a" holding nothing, so the start gets "b" (else: a deadlock).
        with transaction.atomic():
            assert [s.key for s in KeyState.objects.select_for_update(nowait=True).filter(key="order:b")] == ["order:b"]
    assert write.join() == 2
    assert set(KeyState.objects.filter(key__startswith="order:").values_list("send_delay_us", flat=True)) == {7000}


def test_marking_several_keys_answered_holds_one_key_at_a_time():
    # Rows placed in the table against key order ("b" before "a"): an UPDATE finds them that way.
    locks.lock_keys(["order:b"])
    locks.lock_keys(["order:a"])
    # A start of both keys holds "order:a" and will ask for "order:b" next.
    with held_elsewhere(lambda: locks.lock_keys(["order:a"])):
        mark = InThread(lambda: ledger.mark_answered(["order:b", "order:a"]))
        assert wait_until(mark.waits_for_a_lock, BOUND)
        # The mark waits for "a" holding nothing, so the start gets "b" (else: a deadlock).
        with transaction.atomic():
            assert [s.key for s in KeyState.objects.select_for_update(nowait=True).filter(key="order:b")] == ["order:b"]
    mark.join()
    assert KeyState.objects.filter(key__startswith="order:", answered_at__isnull=True).count() == 0
