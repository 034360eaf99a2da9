"""Query counts of the hot paths are pinned: a regression that adds a query per call is caught."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dispatcher import dispenser as dispenser_module
from dispatcher.dispenser import Dispenser
from dispatcher.limiter import Policies
from dispatcher.models import CallQueue, KeyState, RateLimit
from dispatcher.worker import execute

pytestmark = pytest.mark.django_db(transaction=True)

KEY_SETS = 3

# One dispense pass: the policies and pattern pauses (1), the waiting key sets (1); one
# transaction for all the key sets it serves: lock their keys, read the clock, count every
# key's windows, claim the calls of every key set (one UPDATE ... RETURNING on PostgreSQL,
# a SELECT and an UPDATE per key set on SQLite), move the counters (5 on PostgreSQL, plus
# BEGIN/COMMIT); then, unless the pass filled its batch, the clock and the next due call (2).
# On PostgreSQL none of it depends on how many calls or key sets the pass serves.
PASS_QUERIES = {"postgresql": 11, "sqlite": 8 + 2 * KEY_SETS}
# One worker run of a call with one limited key, from message to done: read the call's head
# (1); start, in one transaction: lock the key, the policies and pattern pauses with the clock
# (one statement on PostgreSQL), the window count, then one statement marks the call running and
# writes the attempt, the window log and the counters (4, plus BEGIN/COMMIT); finish: the clock, then one statement for the
# call, the attempt, the counters and the wake-up (2). SQLite runs the statements that
# PostgreSQL combines one by one, in transactions.
RUN_QUERIES = {"postgresql": 9, "sqlite": 17}
# After the finish the worker keeps the start-to-send delay it measured (the learnt arrival
# guard) when it is the key's largest of the span or a span has gone by: the key's first run
# always writes it (PostgreSQL: one conditional UPDATE; SQLite: BEGIN, the locked read, the
# update, COMMIT); a run whose delay is no larger than what its start read does not even ask.
DELAY_QUERIES = {"postgresql": 1, "sqlite": 4}


@pytest.fixture
def published(monkeypatch):
    """Record what the dispenser publishes instead of writing to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls: sent.extend(calls))
    return sent


def _backlog(per_key_set: int, key_sets: int = KEY_SETS) -> None:
    RateLimit.objects.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    KeyState.objects.bulk_create([KeyState(key=f"bench:{i}") for i in range(key_sets)])
    CallQueue.objects.send_many(
        [{"method": "noop", "keys": [f"bench:{i % key_sets}"]} for i in range(per_key_set * key_sets)]
    )


def _pass_queries(published: list) -> int:
    with CaptureQueriesContext(connection) as queries:
        report = Dispenser(batch=10_000).run_once()
    assert report.moved == len(published) == CallQueue.objects.filter(status="dispatched").count()
    return len(queries)


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


def test_a_worker_run_of_one_call_costs_a_pinned_number_of_queries(published):
    RateLimit.objects.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    call = CallQueue.objects.send("noop", keys=["bench:0"])
    claimed = CallQueue.objects.claim(call.key_set, 1, Policies.load()).calls[0]
    with CaptureQueriesContext(connection) as queries:
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    expected = RUN_QUERIES[connection.vendor] + DELAY_QUERIES[connection.vendor]
    assert len(queries) == expected, "\n".join(q["sql"][:120] for q in queries)
    # The next run of the key, its delay no larger than the one kept: no write.
    KeyState.objects.filter(key="bench:0").update(send_delay_us=10**9)
    call = CallQueue.objects.send("noop", keys=["bench:0"])
    claimed = CallQueue.objects.claim(call.key_set, 1, Policies.load()).calls[0]
    with CaptureQueriesContext(connection) as queries:
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    assert len(queries) == RUN_QUERIES[connection.vendor], "\n".join(q["sql"][:120] for q in queries)
