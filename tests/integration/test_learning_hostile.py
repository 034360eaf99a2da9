"""Hostile rate-limit headers through the whole lesson (parse, pause, learnt windows, budgets,
Retry-After inference): never an exception, never a pause beyond DISPATCHER_MAX_PAUSE, never a
learnt window beyond an hour, and the configured policy untouched."""
from __future__ import annotations

import time
from datetime import timedelta

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import learning, ratelimit_headers
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.limits import edit
from dispatcher.models import KeyState, LearntLimit, RateLimit
from dispatcher.running import running
from tests.unit.test_ratelimit_headers import header_values, names

pytestmark = pytest.mark.django_db


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(names, header_values), max_size=8), st.sampled_from([200, 429, 503]))
def test_hostile_headers_never_pause_beyond_the_bound_nor_loosen_a_policy(fields, status):
    edit.set_policy("partner", 5, timedelta(seconds=10))
    raw = httpx.Headers([(name, value.encode("utf-8", "replace").decode("ascii", "replace").replace("\ufffd", "?")
                          .replace("\r", "").replace("\n", "")) for name, value in fields])
    found = ratelimit_headers.parse(raw, status, time.time())
    before = db_now()
    with running(keys=["partner"], started_at=before - timedelta(seconds=1)):
        learning.apply(found)
        if status == 429:
            learning.infer_from_retry_after(found.retry_after, found.text)
    after = db_now()
    state = KeyState.objects.filter(key="partner").first()
    if state is not None and state.paused_until is not None:
        assert state.paused_until <= after + dispatcher_settings.MAX_PAUSE
    for learnt in LearntLimit.objects.filter(key="partner"):
        assert learnt.limit >= 1 and timedelta(0) < learnt.period <= timedelta(hours=1, seconds=1)
        assert learnt.expires_at <= after + max(dispatcher_settings.LEARNT_LIMIT_TTL, timedelta(hours=1))
    policy = RateLimit.objects.get(key="partner")
    assert (policy.limit, policy.period) == (5, timedelta(seconds=10))
    LearntLimit.objects.all().delete()
    KeyState.objects.all().delete()
