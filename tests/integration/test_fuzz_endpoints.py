"""Hostile input to the HTTP API and the rate-limit admin form: a clear 4xx or form error, never a 500."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.models import CallQueue, RateLimit

pytestmark = pytest.mark.django_db

TOKEN = "fuzz-token"
hostile_text = st.one_of(
    st.text(max_size=300),
    st.sampled_from(["", " ", "*", "a*b", "\x00", "\ud800", "é" * 300, "1e309", "-1", "0", "9" * 40, "'; DROP TABLE x;--"]),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), hostile_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"method": st.one_of(hostile_text, st.just("greet"), st.just("http"))},
                          optional={"params": json_values, "keys": json_values, "priority": json_values,
                                    "run_at": json_values, "max_attempts": json_values, "queue": json_values}
                          ).map(lambda v: json.dumps(v).encode()),
))
def test_api_answers_hostile_bodies_with_a_4xx_or_a_stored_call(client, body):
    from django.test import override_settings

    with override_settings(DISPATCHER_API_TOKENS=TOKEN):
        before = CallQueue.objects.count()
        response = client.post("/api/calls/", data=body, content_type="application/json",
                               HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert response.status_code in (201, 400, 413, 415), response.content[:300]
    if response.status_code == 201:
        assert CallQueue.objects.count() == before + 1
    else:
        assert "error" in response.json() and CallQueue.objects.count() == before


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=hostile_text, limit=hostile_text, period=hostile_text, concurrency=hostile_text)
def test_rate_limit_admin_form_never_errors_and_stores_only_valid_policies(admin_client, key, limit, period, concurrency):
    before = RateLimit.objects.count()
    data = {"key": key, "limit": limit, "period": period, "concurrency": concurrency}
    try:
        response = admin_client.post("/admin/dispatcher/ratelimit/add/", data)
    except ValueError:
        # The test client itself refuses to encode some values (NUL, lone surrogates).
        return
    assert response.status_code in (200, 302)
    if response.status_code == 302:
        policy = RateLimit.objects.latest("id")
        assert policy.limit >= 1 and policy.period.total_seconds() > 0
        assert policy.concurrency is None or policy.concurrency >= 1
        RateLimit.objects.filter(id=policy.id).delete()
    else:
        assert RateLimit.objects.count() == before


@pytest.fixture
def admin_client(client):
    user = User.objects.create_superuser("fuzz-admin", "f@example.com", "pw-123456")
    client.force_login(user)
    return client
