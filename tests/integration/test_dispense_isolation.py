"""One key's failure in a dispense pass skips that key set; the pass and every other key go on."""
from __future__ import annotations

import pytest
from django.db import DatabaseError

from dispatcher.dispenser import Dispenser
from dispatcher.limits import gate
from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.parametrize("bad_keys", [["poisoned"], ["poisoned", "shared"], ["a", "poisoned", "z"]])
def test_a_key_set_whose_claim_fails_is_skipped_and_the_others_are_claimed(monkeypatch, bad_keys):
    real = gate.assess

    def failing(keys, *args, **kwargs):
        if "poisoned" in keys:
            # What an unbounded table or a hostile stored value did: the statement fails.
            raise DatabaseError("target lists can have at most 1664 entries")
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(gate, "assess", failing)
    bad = [CallQueue.objects.send("noop", {}, keys=bad_keys) for _ in range(2)]
    good = [CallQueue.objects.send("noop", {}, keys=[f"tenant:{i}"]) for i in range(3)]

    report = Dispenser().run_once()

    assert report.moved == 3
    assert set(CallQueue.objects.filter(status="dispatched").values_list("id", flat=True)) == {c.id for c in good}
    assert set(CallQueue.objects.filter(status="pending").values_list("id", flat=True)) == {c.id for c in bad}


def test_the_pass_still_claims_nothing_twice_after_a_failed_batch(monkeypatch):
    calls = [CallQueue.objects.send("noop", {}, keys=[f"k{i}"]) for i in range(4)]
    real = gate.assess
    failed = []

    def fail_once(keys, *args, **kwargs):
        if len(keys) > 1 and not failed:
            failed.append(keys)
            raise DatabaseError("the batch's statement failed")
        return real(keys, *args, **kwargs)

    monkeypatch.setattr(gate, "assess", fail_once)
    report = Dispenser().run_once()
    assert failed and report.moved == 4 and report.published == 4
    assert CallQueue.objects.filter(status="dispatched").count() == len(calls)
