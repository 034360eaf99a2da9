"""Query counts of the hot paths are pinned: a regression that adds a query per call is caught."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from dispatcher import dispenser as dispenser_module
from dispatcher import worker
from dispatcher.dispenser import Dispenser
from dispatcher.limits import catalog, edit
from dispatcher.models import CallQueue, KeyState
from dispatcher.store import prepared
from dispatcher.worker import execute
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)

KEY_SETS = 3

# One dispense pass after a policy edit: on PostgreSQL the waiting key sets with the clock and the
# policies' version (1), then the policies and pattern pauses, their version having moved (1);
# on SQLite the policies (1) and the key sets (1). One transaction for all the key sets it
# serves: lock their keys, read the clock and count every key's windows (one statement on
# PostgreSQL, two on SQLite), claim the calls of every key set (one UPDATE ... RETURNING on
# PostgreSQL, a SELECT and an UPDATE per key set on SQLite), move the counters (4 on PostgreSQL:
# BEGIN goes with the lock and COMMIT with the counters, dispatcher.store.folded, where no two of
# its key sets share a key; SQLite adds BEGIN and COMMIT); having moved two calls or more, its
# calls per message: the workers' slots (1, kept for a second), the calls not yet started (1)
# and, when that makes them share messages, which of their keys no call has finished under yet
# (1; a pass of one call per message skips it); then, unless the pass filled its batch, the next
# due call (with the clock on PostgreSQL: 1; SQLite: 2). On PostgreSQL none of it depends on how
# many calls or key sets the pass serves, and a pass with no edit since the process's last
# reading keeps the policies it read (one query fewer).
PASS_QUERIES = {"postgresql": 10, "sqlite": 11 + 2 * KEY_SETS}
# One worker run of a call with one limited key, from message to done, in a worker that has
# started a call before. On PostgreSQL: start, in one transaction: read the call's head and lock
# its key in one round trip with BEGIN, then one statement reads the clock, the version of the
# policies the worker kept and the window count, then one statement marks the call running and
# writes the attempt, the window log and the counters, with COMMIT (3, dispatcher.folded);
# finish: one statement for the call, the attempt and the wake-up on the database's own clock
# (1). SQLite reads the call's head before its transaction, reads the policies at every start,
# runs the statements that PostgreSQL combines one by one, in transactions, reads the clock
# before its finish and locks no key at a finish.
RUN_QUERIES = {"postgresql": 4, "sqlite": 15}
# One message of 10 such calls (DISPATCHER_CALLS_PER_MESSAGE=10) on PostgreSQL: one transaction
# starts them all: read their heads and lock their keys, read clock, policy version and windows,
# mark them running (3, BEGIN and COMMIT going with the first and the last); one statement
# records their outcomes (1). SQLite reads their heads one by one and starts them in one
# transaction too (the keys locked and the windows read once, each call marked through the
# ORM), then finishes them one by one: 105 where ten starts of one call each cost 150.
MESSAGE_QUERIES = {"postgresql": 4, "sqlite": 105}
# Where the connection prepares statements (``dispatcher.store.prepared``) a start's mark cannot
# carry its COMMIT, which goes on its own: one query more for a run or a message.
def _own_commit() -> int:
    return 1 if prepared.preparing(connection.alias) else 0


# After the finish the worker keeps the start-to-send delay it measured (the learnt arrival
# guard) when it is the key's largest of the span or a span has gone by: the key's first run
# always writes it (PostgreSQL: one conditional UPDATE for one key, after locking several in key
# order; SQLite: BEGIN, the locked read, the update, COMMIT); a run whose delay is no larger than
# what its start read does not even ask.
DELAY_QUERIES = {"postgresql": 1, "sqlite": 4}
# The first call of a key a worker process finishes marks the key answered (one UPDATE; the
# dispenser then lets its calls share messages); the process remembers it and never asks again.
ANSWERED_QUERIES = 1


@pytest.fixture(autouse=True)
def _delays_kept_after_the_answer(monkeypatch):
    """The counts are the queries of the run's own connection. A request that goes out later than
    its key remembers (a new key's first) hands its delay to the process's delay writer, on a
    connection of its own, and its answer writes only what the writer has not written by then: a
    race whose winner moves the count by DELAY_QUERIES. Here the runs keep their delays after the
    answer, as a start inside a caller's transaction does (``worker._tellers``); the writer's path
    has its own tests (tests/integration/test_window_late_send.py)."""
    monkeypatch.setattr(worker, "_tellers", lambda: (worker._move_on, None))


@pytest.fixture
def published(monkeypatch):
    """Record what the dispenser publishes instead of writing to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls, per_message=None, alone=(): sent.extend(calls))
    return sent


def _backlog(per_key_set: int, key_sets: int = KEY_SETS) -> None:
    edit.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    KeyState.objects.bulk_create([KeyState(key=f"bench:{i}") for i in range(key_sets)])
    CallQueue.objects.send_many(
        [{"method": "noop", "keys": [f"bench:{i % key_sets}"]} for i in range(per_key_set * key_sets)]
    )


def _pass_queries(published: list) -> int:
    """The queries of one pass, as if it grouped its calls (a pass that did not read no answered keys)."""
    with CaptureQueriesContext(connection) as queries:
        report = Dispenser(batch=10_000).run_once()
    assert report.moved == len(published) == CallQueue.objects.filter(status="dispatched").count()
    return len(queries) + (0 if report.per_message > 1 else 1)


@pytest.mark.parametrize("per_key_set", [1, 10, 200])
def test_a_dispense_pass_costs_the_same_queries_however_many_calls_it_moves(published, per_key_set):
    _backlog(per_key_set)
    assert _pass_queries(published) == PASS_QUERIES[connection.vendor]
    assert len(published) == per_key_set * KEY_SETS


@pytest.mark.postgres
@pytest.mark.parametrize("key_sets", [1, 20])
def test_on_postgresql_a_pass_costs_the_same_queries_however_many_key_sets_it_serves(published, key_sets):
    _backlog(5, key_sets)
    assert _pass_queries(published) == PASS_QUERIES["postgresql"]
    assert len(published) == 5 * key_sets


@pytest.mark.postgres
def test_on_postgresql_a_pass_with_no_policy_edit_since_the_last_reads_no_policies(published):
    if connection.vendor != "postgresql":
        pytest.skip("the policies' version is PostgreSQL's")
    _backlog(2)
    assert _pass_queries(published) == PASS_QUERIES["postgresql"]
    CallQueue.objects.send_many([{"method": "noop", "keys": [f"bench:{i}"]} for i in range(KEY_SETS)])
    with CaptureQueriesContext(connection) as queries:
        report = Dispenser(batch=10_000).run_once()
    assert report.moved == KEY_SETS
    shared = 0 if report.per_message > 1 else 1  # as _pass_queries counts
    assert len(queries) + shared == PASS_QUERIES["postgresql"] - 1, "\n".join(q["sql"][:100] for q in queries)
    # An edit is seen by the next pass: it reads the policies again, and judges by them.
    edit.set_policy("bench:*", 1, timedelta(hours=1))
    published.clear()
    CallQueue.objects.send_many([{"method": "noop", "keys": [f"bench:{i}"]} for i in range(KEY_SETS)])
    report = Dispenser(batch=10_000).run_once()
    assert report.moved == 0 and published == []


def test_a_worker_run_of_one_call_costs_a_pinned_number_of_queries(published):
    edit.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    calls = [CallQueue.objects.send("noop", keys=["bench:0"]) for _ in range(2)]
    first, second = claim(calls[0].key_set, 2).calls
    # The first run of a process reads the policies it then keeps (one query more on PostgreSQL;
    # a process that kept older ones reads the version first: two), writes the key's first
    # measured delay and marks the key answered.
    catalog.forget_policies()
    with CaptureQueriesContext(connection) as queries:
        assert execute(first.id, first.dispatch_no) == "done"
    kept_read = 1 if connection.vendor == "postgresql" else 0
    expected = RUN_QUERIES[connection.vendor] + _own_commit() + DELAY_QUERIES[connection.vendor] + kept_read + ANSWERED_QUERIES
    assert len(queries) == expected, "\n".join(q["sql"][:120] for q in queries)
    # The second is measured: its delay no larger than the one kept, it writes none.
    KeyState.objects.filter(key="bench:0").update(send_delay_us=10**9)
    with CaptureQueriesContext(connection) as queries:
        assert execute(second.id, second.dispatch_no) == "done"
    assert len(queries) == RUN_QUERIES[connection.vendor] + _own_commit(), "\n".join(q["sql"][:120] for q in queries)


def test_a_message_of_ten_calls_costs_the_queries_of_fewer_than_one_call(published):
    from dispatcher.worker import execute_many

    edit.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    calls = [CallQueue.objects.send("noop", keys=[f"bench:{i % 2}"]) for i in range(12)]
    groups = [claim(key_set, 6).calls for key_set in sorted({c.key_set for c in calls})]
    # A message of a call of each key first, as a worker would have run: the policies kept, the
    # keys answered, and the process knows its handlers return at once (a message starts what
    # its threads can soon take: dispatcher.handlerpool).
    assert execute_many([(group[0].id, group[0].dispatch_no) for group in groups]) == {"done": 2}
    claimed = [None, None] + [c for group in groups for c in group[1:]]
    # Measured, their delays no larger than the ones kept: none is written (a write would be one
    # statement more, on this same connection: tests/integration/test_learnt_guard.py).
    KeyState.objects.filter(key__in=["bench:0", "bench:1"]).update(send_delay_us=10**9, send_delay_since=Now())
    with CaptureQueriesContext(connection) as queries:
        assert execute_many([(c.id, c.dispatch_no) for c in claimed[2:]]) == {"done": 10}
    assert len(queries) == MESSAGE_QUERIES[connection.vendor] + _own_commit(), "\n".join(q["sql"][:120] for q in queries)
