"""A limit an API announces below one call's cost: the call goes alone in an empty window, and what
the explanation says of it holds (issue 24, item 9)."""
from __future__ import annotations

from datetime import timedelta

import pytest

from dispatcher import waits
from dispatcher.clock import db_now
from dispatcher.models import CallQueue, LearntLimit
from dispatcher.worker import execute
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)


def _announce(limit: int, period: timedelta) -> None:
    now = db_now()
    LearntLimit.objects.create(
        key="llm", limit=limit, period=period, expires_at=now + timedelta(hours=1), source="ietf", observed_at=now
    )


@pytest.mark.parametrize(("limit", "cost"), [(1, 5), (3, 4), (2, 50)])
def test_a_call_costlier_than_a_learnt_limit_starts_alone_and_the_next_waits_one_window(limit, cost):
    _announce(limit, timedelta(seconds=2))
    first = CallQueue.objects.send("noop", {}, keys=["llm"], cost=cost)
    second = CallQueue.objects.send("noop", {}, keys=["llm"], cost=cost)
    (claimed,) = claim(first.key_set, 10).calls
    assert claimed.id == first.id
    assert execute(claimed.id, claimed.dispatch_no) == "done"
    explanation = waits.explain_call(CallQueue.objects.get(id=second.id))
    # Not an hour: the window the API announced, counted from the first call's start.
    assert explanation.until is not None
    assert explanation.until - explanation.now <= timedelta(seconds=2, milliseconds=500)
    assert "a limit the API announced" in explanation.summary()
    assert claim(second.key_set, 10).calls == []
