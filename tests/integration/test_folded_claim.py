"""A dispense pass's claim on PostgreSQL with BEGIN sent with the key lock and COMMIT with the
counters (``dispatcher.store.folded``, ``calls.dispense._claim_locked``): what it sends, that it
leaves no transaction or lock open, and where it keeps Django's transaction instead.

Transactional tests: the folded claim is the dispenser's own (autocommit, no ``atomic`` around it).
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from dispatcher.calls import dispense
from dispatcher.limits import edit, ledger
from dispatcher.limits.catalog import Policies
from dispatcher.models import CallQueue, FairShare, KeyState
from tests.integration.test_folded import _idle, _key_lockable_elsewhere, _seen_elsewhere
from tests.integration.test_lifecycle import claim_all

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _claim(key_set: str, n: int = 10) -> tuple[list, list[str]]:
    """Claim up to n calls of a key set, its policies read before; the calls and what was sent."""
    claimed, sent = _claim_sets([key_set], n)
    return claimed.calls, sent


def _claim_sets(key_sets: list[str], n: int = 10) -> tuple[dispense.BatchClaim, list[str]]:
    policies = Policies.load()
    with CaptureQueriesContext(connection) as queries:
        claimed = dispense.claim_batch(CallQueue.objects, key_sets, n, policies)
    return claimed, [q["sql"].strip() for q in queries]


def _statuses(calls: list[CallQueue]) -> set[str]:
    return _seen_elsewhere(lambda: set(CallQueue.objects.filter(id__in=[c.id for c in calls]).values_list("status", flat=True)))


def test_a_claim_sends_begin_with_the_lock_and_commit_with_the_counters_and_is_committed():
    edit.set_policy("api", 100, timedelta(minutes=1))
    calls = [CallQueue.objects.send("noop", keys=["api"]) for _ in range(3)]
    claimed, sent = _claim(calls[0].key_set)
    assert sorted(c.id for c in claimed) == [c.id for c in calls]
    assert sent[0].startswith("BEGIN; ") and "FOR UPDATE" in sent[0]
    assert sent[-1].endswith("; COMMIT") and "reserved" in sent[-1]
    assert "BEGIN" not in sent[1:] and "COMMIT" not in sent[:-1]
    assert _idle()
    # Committed: another session sees the calls dispatched, the counters moved and the key free.
    assert _statuses(calls) == {"dispatched"}
    assert _seen_elsewhere(lambda: KeyState.objects.get(key="api").reserved) == 3
    assert _key_lockable_elsewhere("api")


def test_a_claim_of_new_keys_creates_their_rows_in_djangos_transaction():
    """A key with no row yet (its first claim): the folded claim asks for the plain one."""
    edit.set_policy("fresh", 100, timedelta(minutes=1))
    call = CallQueue.objects.send("noop", keys=["fresh"])
    KeyState.objects.filter(key="fresh").delete()  # as a row written before the key had one
    claimed, sent = _claim(call.key_set)
    assert [c.id for c in claimed] == [call.id]
    assert sent[0].startswith("BEGIN; ")  # tried folded first, rolled back, then Django's
    assert "ROLLBACK" in sent and "COMMIT" in sent
    assert _idle() and _statuses([call]) == {"dispatched"}
    assert _seen_elsewhere(lambda: KeyState.objects.get(key="fresh").reserved) == 1


def test_a_claim_whose_keys_it_filled_judges_them_again_before_its_own_commit():
    edit.set_policy("tight", 2, timedelta(minutes=1))
    calls = [CallQueue.objects.send("noop", keys=["tight"]) for _ in range(3)]
    result, sent = _claim_sets([calls[0].key_set])
    assert len(result.calls) == 2 and result.verdicts[calls[0].key_set].blocked
    assert sent[0].startswith("BEGIN; ") and sent[-1] == "COMMIT"
    assert _idle() and _key_lockable_elsewhere("tight")


def test_key_sets_that_share_a_key_claim_in_djangos_transaction_and_keep_their_turns():
    """Their fair turns are written through the ORM, which opens a transaction of its own."""
    edit.set_policy("shared", 100, timedelta(minutes=1))
    calls = [CallQueue.objects.send("noop", keys=["shared", tenant]) for tenant in ("t1", "t2")]
    result, sent = _claim_sets([c.key_set for c in calls])
    assert sorted(c.id for c in result.calls) == sorted(c.id for c in calls)
    assert not any(s.startswith("BEGIN; ") for s in sent) and "COMMIT" in sent
    assert FairShare.objects.count() == 2
    assert _idle() and _statuses(calls) == {"dispatched"}


def test_a_claim_that_fails_inside_leaves_nothing_written_and_no_lock_held(monkeypatch):
    edit.set_policy("api", 100, timedelta(minutes=1))
    call = CallQueue.objects.send("noop", keys=["api"])

    def broken(*args, **kwargs):
        raise DatabaseError("the counters could not be written")

    monkeypatch.setattr(ledger, "adjust_reserved", broken)
    with pytest.raises(DatabaseError):
        claim_all(call.key_set)
    assert _idle()
    assert _statuses([call]) == {"pending"}
    assert _key_lockable_elsewhere("api")


def test_inside_the_callers_atomic_block_a_claim_is_part_of_it():
    edit.set_policy("api", 100, timedelta(minutes=1))
    call = CallQueue.objects.send("noop", keys=["api"])

    class Undo(Exception):
        pass

    with pytest.raises(Undo), transaction.atomic():
        claimed, sent = _claim(call.key_set)
        assert [c.id for c in claimed] == [call.id]
        assert not any(s.startswith("BEGIN; ") or s.endswith("; COMMIT") for s in sent)
        raise Undo
    assert CallQueue.objects.get(id=call.id).status == "pending"
    assert KeyState.objects.get(key="api").reserved == 0
