"""A start's transaction on PostgreSQL with BEGIN sent with the key lock and COMMIT with the mark
(``dispatcher.folded``): what it sends, and that it never leaves a transaction or a lock open.

Transactional tests: the folded start is the worker's own (autocommit, no ``atomic`` around it),
which pytest-django's default wrapping transaction would turn off.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext

from dispatcher.calls import start
from dispatcher.limits import edit, gate
from dispatcher.models import Attempt, CallQueue, KeyState, RateLimit, StartLog
from tests.integration.test_lifecycle import claim_all

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _claimed(n: int, key: str = "api") -> list[CallQueue]:
    calls = [CallQueue.objects.send("noop", keys=[key]) for _ in range(n)]
    claimed = claim_all(calls[0].key_set, n).calls
    assert len(claimed) == n
    return sorted(claimed, key=lambda c: c.id)


def _seen_elsewhere(fn):
    """Run ``fn`` on a connection of its own (another thread): what other sessions see."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert out, "the other session failed"
    return out[0]


def _key_lockable_elsewhere(key: str) -> bool:
    def lock() -> bool:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM dispatcher_keystate WHERE key = %s FOR UPDATE NOWAIT", [key])
            return cursor.fetchone() is not None

    return _seen_elsewhere(lock)


def _idle() -> bool:
    return connection.connection.info.transaction_status.name == "IDLE"


@pytest.mark.skipif(
    "prepare_threshold" in connection.settings_dict.get("OPTIONS", {}),
    reason="a prepared mark sends its COMMIT on its own (tests/integration/test_prepared.py)",
)
def test_a_start_is_three_round_trips_and_is_committed_when_it_returns():
    edit.set_policy("api", 100, timedelta(minutes=1))
    first, call = _claimed(2)
    # The first start of a process also reads the policies it then keeps.
    assert CallQueue.objects.start(first.id, first.dispatch_no, worker="w").state == "started"
    with CaptureQueriesContext(connection) as queries:
        started = CallQueue.objects.start(call.id, call.dispatch_no, worker="w")
    assert started.state == "started"
    sent = [q["sql"].strip() for q in queries]
    # BEGIN with the lock and then the head, the windows, the mark with COMMIT: nothing sent on its own.
    assert len(sent) == 3, sent
    assert sent[0].startswith("BEGIN; ") and sent[0].index("FOR UPDATE") < sent[0].index('"dispatch_no"')
    assert sent[2].endswith("; COMMIT")
    assert _idle()
    # Committed: another session sees the call running and can take the key's lock.
    assert _seen_elsewhere(lambda: CallQueue.objects.get(id=call.id).status) == "running"
    assert _key_lockable_elsewhere("api")


def test_a_deferred_start_is_committed_without_a_mark():
    edit.set_policy("api", 2, timedelta(minutes=1))
    first, second = _claimed(2)
    # Tightened while the messages waited in the broker: only one fits now.
    RateLimit.objects.filter(key="api").delete()
    edit.set_policy("api", 1, timedelta(minutes=1))
    assert CallQueue.objects.start(first.id, first.dispatch_no).state == "started"
    assert CallQueue.objects.start(second.id, second.dispatch_no).state == "deferred"
    assert _idle()
    assert _seen_elsewhere(lambda: CallQueue.objects.get(id=second.id).status) == "pending"
    assert _seen_elsewhere(lambda: KeyState.objects.get(key="api").reserved) == 0
    assert _key_lockable_elsewhere("api")


def test_a_start_that_fails_inside_leaves_nothing_written_and_no_lock_held(monkeypatch):
    edit.set_policy("api", 100, timedelta(minutes=1))
    (call,) = _claimed(1)

    def broken(*args, **kwargs):
        raise RuntimeError("judgement failed")

    monkeypatch.setattr(gate, "assess", broken)
    with pytest.raises(RuntimeError, match="judgement failed"):
        CallQueue.objects.start(call.id, call.dispatch_no, worker="w")
    assert _idle()
    assert _key_lockable_elsewhere("api")
    assert CallQueue.objects.get(id=call.id).status == "dispatched"
    assert not Attempt.objects.exists()
    # The connection is usable as it was: the next start goes through.
    monkeypatch.undo()
    assert CallQueue.objects.start(call.id, call.dispatch_no, worker="w").state == "started"


def test_a_failed_statement_inside_is_rolled_back(monkeypatch):
    edit.set_policy("api", 100, timedelta(minutes=1))
    (call,) = _claimed(1)
    real = gate.assess

    def failing_statement(*args, **kwargs):
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 / 0")  # leaves the transaction failed on the server
        return real(*args, **kwargs)

    monkeypatch.setattr(gate, "assess", failing_statement)
    with pytest.raises(Exception, match="division by zero"):
        CallQueue.objects.start(call.id, call.dispatch_no)
    assert _idle()
    assert _key_lockable_elsewhere("api")
    monkeypatch.undo()
    assert CallQueue.objects.start(call.id, call.dispatch_no).state == "started"


def test_a_key_row_gone_since_the_claim_is_created_in_djangos_transaction():
    edit.set_policy("api", 100, timedelta(minutes=1))
    (call,) = _claimed(1)
    KeyState.objects.filter(key="api").delete()
    assert CallQueue.objects.start(call.id, call.dispatch_no).state == "started"
    assert _idle()
    assert KeyState.objects.get(key="api").total == 1
    assert StartLog.objects.filter(key="api").count() == 1


def test_inside_the_callers_atomic_block_a_start_is_part_of_it():
    edit.set_policy("api", 100, timedelta(minutes=1))
    (call,) = _claimed(1)

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        assert CallQueue.objects.start(call.id, call.dispatch_no).state == "started"
        raise Undo
    assert CallQueue.objects.get(id=call.id).status == "dispatched"
    assert not StartLog.objects.exists()


def test_a_group_whose_call_was_started_elsewhere_writes_nothing_and_each_starts_alone(monkeypatch):
    """Unfolded (the call's heads read before the transaction and its lock): a duplicate delivery
    may start a call of the group between the two."""
    edit.set_policy("api", 100, timedelta(minutes=1))
    calls = _claimed(3)
    deliveries = [(c.id, c.dispatch_no) for c in calls]
    monkeypatch.setattr(start, "can_fold", lambda db: False)
    # A duplicate delivery starts the middle call after the group read its heads and before its
    # mark: the group's statement (locked, all or nothing) must then write none of its starts.
    heads_read = start._start_group

    raced = []

    def duplicate_first(manager, live, worker, may_wait, folded, locked):
        if not raced:  # the group's own start (the duplicate and the retries start as groups of one)
            raced.append(True)
            _seen_elsewhere(lambda: CallQueue.objects.start(*deliveries[1]).state)
        return heads_read(manager, live, worker, may_wait, folded, locked)

    monkeypatch.setattr(start, "_start_group", duplicate_first)
    started = CallQueue.objects.start_many(deliveries, worker="w")
    assert [s.state for s in started] == ["started", "stale", "started"]
    assert _idle()
    # Each call started once: one attempt each, one log row each, the key's total 3.
    assert sorted(Attempt.objects.values_list("call_id", flat=True)) == [c.id for c in calls]
    assert StartLog.objects.filter(key="api").count() == 3
    state = KeyState.objects.get(key="api")
    assert (state.total, state.reserved) == (3, 0)


def test_folded_a_duplicate_delivery_waits_for_the_groups_locks_and_then_reads_its_call_started(monkeypatch):
    """Folded, a start reads its calls' heads once it holds their keys' locks: a duplicate
    delivery of a call of a group being started waits for the group and finds the call running
    (stale), and the group starts every call, each once."""
    edit.set_policy("api", 100, timedelta(minutes=1))
    calls = _claimed(3)
    deliveries = [(c.id, c.dispatch_no) for c in calls]
    group = start._start_group
    duplicate: list = []

    def run_duplicate() -> None:
        try:
            duplicate.append(CallQueue.objects.start(*deliveries[1]))
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_duplicate)

    def with_a_duplicate(manager, live, worker, may_wait, folded, locked):
        if not thread.is_alive() and not duplicate:  # the group's start, its keys locked
            assert folded is not None and locked is not None
            thread.start()
            deadline = time.monotonic() + 10
            while not _waiting_for_a_lock() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _waiting_for_a_lock(), "the duplicate did not wait for the group's locks"
        return group(manager, live, worker, may_wait, folded, locked)

    monkeypatch.setattr(start, "_start_group", with_a_duplicate)
    started = CallQueue.objects.start_many(deliveries, worker="w")
    thread.join(30)
    assert [s.state for s in started] == ["started", "started", "started"]
    (other,) = duplicate
    assert other.state == "stale" and other.reason.startswith("call is running"), other.reason
    assert _idle()
    assert sorted(Attempt.objects.values_list("call_id", flat=True)) == [c.id for c in calls]
    assert StartLog.objects.filter(key="api").count() == 3
    state = KeyState.objects.get(key="api")
    assert (state.total, state.reserved) == (3, 0)


def _waiting_for_a_lock() -> bool:
    """Whether another session of this database waits for a lock (the duplicate's start)."""
    def read() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return cursor.fetchone()[0] > 0

    return _seen_elsewhere(read)


@pytest.mark.parametrize("text", ["{not json", "[1]", '{"e": 1}', "[["])
def test_a_key_set_written_by_hand_gets_what_the_unfolded_start_gives_it(monkeypatch, text):
    """The folded start reads the keys to lock from the stored key set in the database: one it
    cannot read as a JSON array is started as the unfolded start would (``Unfoldable``), with the
    same outcome, and no transaction or lock is left open either way."""
    outcomes = []
    for fold in (True, False):
        if not fold:
            monkeypatch.setattr(start, "can_fold", lambda db: False)
        (call,) = _claimed(1, key=f"api-{fold}")
        CallQueue.objects.filter(id=call.id).update(key_set=text)
        try:
            outcome = CallQueue.objects.start(call.id, call.dispatch_no).state
        except Exception as exc:  # what the worker's task then raises (the rescue fails the row later)
            outcome = type(exc).__name__
        assert _idle()
        outcomes.append((outcome, CallQueue.objects.get(id=call.id).status))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0] == (("started", "running") if text.startswith("{\"") else (outcomes[0][0], "dispatched"))
