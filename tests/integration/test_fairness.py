"""Key sets that share a key get equal turns of its room, whatever order they sent in, across passes,
dispensers and restarts (SPEC invariant 5)."""
from __future__ import annotations

import io
import threading
from collections import Counter
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

from dispatcher.dispenser import Dispenser
from dispatcher.limits import edit
from dispatcher.models import CallQueue, FairShare, KeyState
from dispatcher.worker import execute

pytestmark = pytest.mark.django_db(transaction=True)

TENANTS = 8


def _send_in_tenant_order(per_tenant: int) -> None:
    """Each tenant sends all its calls before the next one does (tenant 0's first)."""
    for tenant in range(TENANTS):
        for _ in range(per_tenant):
            CallQueue.objects.send("noop", {}, keys=["mail", f"mail:t{tenant}"])


def _claimed_by_tenant() -> Counter[str]:
    calls = CallQueue.objects.exclude(status=CallQueue.Status.PENDING)
    return Counter(next(k for k in call.keys if k.startswith("mail:")) for call in calls)


def test_tenants_that_sent_last_get_the_same_share_of_the_shared_key_as_those_that_sent_first():
    edit.set_policy("mail", 8, timedelta(minutes=1))
    edit.set_policy("mail:*", 2, timedelta(minutes=1))
    _send_in_tenant_order(5)

    Dispenser().run_once()

    assert _claimed_by_tenant() == Counter({f"mail:t{tenant}": 1 for tenant in range(TENANTS)})


def test_turns_are_kept_across_passes_and_dispensers():
    # The shared key runs three calls at a time; eight tenants queue three calls each; every pass
    # is a new dispenser, and the claimed calls run to the end before the next pass.
    edit.set_policy("mail", 1000, timedelta(minutes=1), concurrency=3)
    _send_in_tenant_order(3)
    served_after: list[int] = []
    for _ in range(TENANTS):
        claimed = Dispenser().run_once()
        for call in CallQueue.objects.filter(status=CallQueue.Status.DISPATCHED):
            assert execute(call.id, call.dispatch_no) == "done"
        served_after.append(len(_claimed_by_tenant()))
        assert claimed.moved == 3
    # Nine calls over three passes reached all eight tenants (sent in order, the first three
    # tenants alone would have taken them); in the end every tenant had its three.
    assert served_after[2] == TENANTS
    assert _claimed_by_tenant() == Counter({f"mail:t{tenant}": 3 for tenant in range(TENANTS)})
    assert FairShare.objects.count() == TENANTS


@pytest.mark.postgres
def test_several_dispensers_at_once_give_every_tenant_a_turn_in_the_first_window():
    edit.set_policy("mail", 8, timedelta(minutes=1))
    edit.set_policy("mail:*", 2, timedelta(minutes=1))
    _send_in_tenant_order(5)
    barrier = threading.Barrier(3)

    def dispense() -> None:
        try:
            barrier.wait()
            Dispenser().run_once()
        finally:
            connections.close_all()

    threads = [threading.Thread(target=dispense) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert _claimed_by_tenant() == Counter({f"mail:t{tenant}": 1 for tenant in range(TENANTS)})


def test_dispatcher_status_shows_each_tenants_share_of_the_shared_key_and_its_oldest_wait():
    edit.set_policy("mail", 1000, timedelta(minutes=1), concurrency=3)
    _send_in_tenant_order(3)
    for _ in range(2):
        Dispenser().run_once()
        for call in CallQueue.objects.filter(status=CallQueue.Status.DISPATCHED):
            execute(call.id, call.dispatch_no)
    out = io.StringIO()
    call_command("dispatcher_status", stdout=out)
    text = out.getvalue()
    assert "shares of mail over the last 1m (least served first):" in text
    lines = [line for line in text.splitlines() if line.startswith("  mail:t")]
    assert len(lines) == TENANTS
    # Six calls over eight tenants: two tenants got none yet, and they are listed first.
    assert [line.split(": ", 1)[1].split()[0] for line in lines[:2]] == ["0", "0"]
    assert all("oldest wait" in line for line in lines)


def test_a_tenant_with_weight_two_gets_twice_the_shared_key():
    edit.set_policy("mail", 1000, timedelta(minutes=1), concurrency=3)
    out = io.StringIO()
    call_command("ratelimit", "weight", "mail:t1", "2", stdout=out)
    assert out.getvalue().strip() == "weight of mail:t1: 2"
    for tenant in (0, 1):
        for _ in range(12):
            CallQueue.objects.send("noop", {}, keys=["mail", f"mail:t{tenant}"])
    for _ in range(4):
        Dispenser().run_once()
        for call in CallQueue.objects.filter(status=CallQueue.Status.DISPATCHED):
            execute(call.id, call.dispatch_no)
    assert _claimed_by_tenant() == Counter({"mail:t0": 4, "mail:t1": 8})


def test_a_weight_is_refused_out_of_range_and_changes_nothing():
    for bad in ("0", "1001", "two", "-1"):
        with pytest.raises(CommandError):
            call_command("ratelimit", "weight", "mail:*", bad)
    assert not KeyState.objects.filter(weight__isnull=False).exists()


def test_the_dashboard_shows_each_tenants_share_of_the_shared_key(admin_client):
    edit.set_policy("mail", 1000, timedelta(minutes=1), concurrency=3)
    _send_in_tenant_order(3)
    Dispenser().run_once()
    for call in CallQueue.objects.filter(status=CallQueue.Status.DISPATCHED):
        execute(call.id, call.dispatch_no)
    page = admin_client.get("/dispatcher/dashboard/?q=mail").content.decode()
    assert "Shares of mail over its last window, least served first" in page
    assert page.count("<td>mail:t") == TENANTS
