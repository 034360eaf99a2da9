"""A claim's COMMIT does not wait for the disk (a lost claim leaves nothing wrong); nothing else's does."""
from __future__ import annotations

import pytest
from django.db import connection, transaction

from dispatcher.dispenser import Dispenser
from dispatcher.models import CallQueue
from dispatcher.store import call_sql, functions
from tests.integration.test_lifecycle import claim_all

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return cursor.fetchone()[0]


def test_a_dispense_pass_commits_its_claim_unflushed_and_the_session_stays_durable():
    seen: list[str] = []

    def watch(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if sql in (call_sql.claim_due(), functions.claim("default").statement):
            # Inside the claim's transaction, as its calls are marked dispatched.
            with context["connection"].cursor() as cursor:
                cursor.execute("SHOW synchronous_commit")
                seen.append(cursor.fetchone()[0])
        return result

    assert _synchronous_commit() == "on"
    sent = [CallQueue.objects.send("noop", {}, keys=["api"]) for _ in range(3)]
    with connection.execute_wrapper(watch):
        report = Dispenser().run_once()
    assert report.moved == 3
    assert seen and set(seen) == {"off"}
    # Set for the claim's transaction alone: the session's next ones (a start, a finish) wait for the disk.
    assert _synchronous_commit() == "on"
    assert set(CallQueue.objects.filter(id__in=[c.id for c in sent]).values_list("status", flat=True)) == {"dispatched"}


def test_a_claim_inside_a_callers_transaction_leaves_its_commit_durable():
    call = CallQueue.objects.send("noop", {}, keys=["api"])
    with transaction.atomic():
        assert [c.id for c in claim_all(call.key_set).calls] == [call.id]
        assert _synchronous_commit() == "on"


def test_a_claim_lost_to_a_crash_leaves_its_call_to_run_once():
    from dispatcher.models import Attempt, KeyState
    from dispatcher.worker import execute

    call = CallQueue.objects.send("noop", {}, keys=["api"])
    rows = CallQueue.objects.filter(id=call.id)
    before_call = rows.values("status", "dispatch_no", "dispatched_at").get()
    claimed = claim_all(call.key_set).calls
    lost_message = (call.id, claimed[0].dispatch_no)
    # The database crashes before the claim reached the disk: it comes back as it was before it.
    rows.update(**before_call)
    KeyState.objects.filter(key="api").update(reserved=0, reserved_units=0)
    assert execute(*lost_message) == "stale"
    # Claimed again, the call gets the same dispatch number: whichever message comes first runs it.
    again = claim_all(call.key_set).calls
    assert (call.id, again[0].dispatch_no) == lost_message
    assert [execute(*lost_message), execute(*lost_message)] == ["done", "stale"]
    assert Attempt.objects.filter(call=call).count() == 1
    assert KeyState.objects.get(key="api").reserved == 0
