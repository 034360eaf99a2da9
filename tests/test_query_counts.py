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

# One dispense pass over calls in KEY_SETS key sets, each set with one limited key whose
# KeyState row exists: the policies and pattern pauses (2), the waiting key sets (1); per key
# set one transaction: lock the key rows, read the clock, count the key's window, select the
# calls and mark them dispatched (one UPDATE ... RETURNING on PostgreSQL), move the counters
# (5 on PostgreSQL, plus BEGIN/COMMIT); then the
# clock and the next due call (2). None of it depends on how many calls a key set holds.
PASS_QUERIES = {"postgresql": 3 + KEY_SETS * 7 + 2, "sqlite": 25}  # SQLite logs its transaction statements differently
# One worker run of a call with one limited key, from message to done: read the call's head,
# the policies and pauses (3); start: lock keys, lock the call, clock, window count, record the
# start, the attempt, the call, the counters (8); finish: lock keys, clock, the call, the
# attempt, the counters, wake the dispensers (6 on PostgreSQL); plus BEGIN/COMMIT where logged.
RUN_QUERIES = {"postgresql": 21, "sqlite": 18}


@pytest.fixture
def published(monkeypatch):
    """Record what the dispenser publishes instead of writing to a broker."""
    sent: list = []
    monkeypatch.setattr(dispenser_module, "publish_run_calls", lambda calls: sent.extend(calls))
    return sent


def _backlog(per_key_set: int) -> None:
    RateLimit.objects.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    KeyState.objects.bulk_create([KeyState(key=f"bench:{i}") for i in range(KEY_SETS)])
    CallQueue.objects.send_many(
        [{"method": "noop", "keys": [f"bench:{i % KEY_SETS}"]} for i in range(per_key_set * KEY_SETS)]
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


def test_a_worker_run_of_one_call_costs_a_pinned_number_of_queries(published):
    RateLimit.objects.set_policy("bench:*", 1_000_000, timedelta(seconds=1))
    call = CallQueue.objects.send("noop", keys=["bench:0"])
    claimed = CallQueue.objects.claim(call.key_set, 1, Policies.load()).calls[0]
    with CaptureQueriesContext(connection) as queries:
        assert execute(claimed.id, claimed.dispatch_no) == "done"
    assert len(queries) == RUN_QUERIES[connection.vendor], "\n".join(q["sql"][:120] for q in queries)
