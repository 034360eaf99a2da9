"""A reported cost never freezes a bucket: an extra charge is at most the bucket's capacity."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher.clock import db_now, from_us
from dispatcher.costs import MAX_UNITS, bounded_charge
from dispatcher.limits import edit
from dispatcher.models import CallQueue, KeyBucket, RateLimit
from tests.integration.test_shapes import claim_all, run_all

pytestmark = pytest.mark.django_db


def owed_for(key: str = "llm") -> timedelta:
    """How far the key's bucket state lies beyond now."""
    return max(from_us(b.tat_us) for b in KeyBucket.objects.filter(key=key)) - db_now()


@pytest.mark.parametrize("used", [2**31 - 1, 10**6, 50])
def test_a_huge_reported_cost_owes_at_most_one_refill(settings, used):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("llm", 2, timedelta(seconds=1), burst=4)
    call = CallQueue.objects.send("complete", {"max_tokens": 1, "used": used})
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    # 4 tokens at 2 a second: the bucket owes at most two seconds, never decades.
    assert owed_for() <= timedelta(seconds=2, milliseconds=500)


def test_a_reported_cost_on_a_ten_year_period_is_recorded_without_overflow(settings):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("llm", 2, timedelta(days=3650), burst=4)
    call = CallQueue.objects.send("complete", {"max_tokens": 1, "used": MAX_UNITS})
    assert run_all(claim_all(call.key_set).calls) == ["done"]
    call.refresh_from_db()
    assert call.status == CallQueue.Status.DONE
    assert owed_for() <= timedelta(days=1825 * 5, seconds=1)  # the start and one full refill


def test_after_a_huge_report_an_edited_policy_lets_calls_start_soon(settings):
    settings.DISPATCHER_ARRIVAL_GUARD = "0"
    edit.set_policy("llm", 2, timedelta(seconds=1), burst=4)
    call = CallQueue.objects.send("complete", {"max_tokens": 1, "used": MAX_UNITS})
    run_all(claim_all(call.key_set).calls)
    edit.set_policy("llm", 1000, timedelta(seconds=1), burst=4, replacing=RateLimit.objects.get(key="llm").pk)
    assert owed_for() <= timedelta(seconds=2, milliseconds=500)


def test_bounded_charge_keeps_refunds_and_cuts_extra_charges():
    assert bounded_charge(-7, 4) == -7
    assert bounded_charge(0, 4) == 0
    assert bounded_charge(3, 4) == 3
    assert bounded_charge(MAX_UNITS, 4) == 4
    assert bounded_charge(5, 0) == 1
