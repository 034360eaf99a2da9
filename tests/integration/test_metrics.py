"""/metrics: Prometheus text with numbers that match a known state; closed unless allowed."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from prometheus_client.parser import text_string_to_metric_families

from dispatcher.limits import edit
from dispatcher.models import CallQueue
from dispatcher.worker import execute
from tests.claims import claim

pytestmark = pytest.mark.django_db(transaction=True)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_report_calls_starts_and_limiter_use(client, settings):
    settings.DISPATCHER_METRICS_TOKENS = "m-token"
    edit.set_policy("greeter", 4, timedelta(minutes=1))
    done = CallQueue.objects.send("greet", {"name": "a"})
    failed = CallQueue.objects.send("explode", {"permanent": True})
    CallQueue.objects.send("greet", {"name": "b"})
    for call in (done, failed):
        claimed = claim(call.key_set, 1).calls[0]
        execute(claimed.id, claimed.dispatch_no)
    response = client.get("/metrics", HTTP_AUTHORIZATION="Bearer m-token")
    assert response.status_code == 200
    found = samples(response.content.decode())
    assert found[("dispatcher_calls", (("status", "done"),))] == 1
    assert found[("dispatcher_calls", (("status", "failed"),))] == 1
    assert found[("dispatcher_calls", (("status", "pending"),))] == 1
    assert found[("dispatcher_calls_started_total", ())] == 2
    assert found[("dispatcher_calls_done_total", ())] == 1
    assert found[("dispatcher_calls_failed_total", ())] == 1
    used = [v for (name, labels), v in found.items() if name == "dispatcher_limiter_used" and ("key", "greeter") in labels]
    assert used == [1]


def test_metrics_read_the_bearer_scheme_as_the_api_does_in_any_case(client, settings):
    settings.DISPATCHER_METRICS_TOKENS = "m-token"
    assert client.get("/metrics", HTTP_AUTHORIZATION="bearer  m-token ").status_code == 200
    assert client.get("/metrics", HTTP_AUTHORIZATION="Basic m-token").status_code == 401


def test_metrics_are_closed_to_anonymous_and_unprivileged_users(client):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer guess").status_code == 401
    user = User.objects.create_user("staff", password="pw-123456", is_staff=True)
    client.force_login(user)
    assert client.get("/metrics").status_code == 401
    user.user_permissions.add(Permission.objects.get(codename="view_callqueue"))
    client.force_login(User.objects.get(pk=user.pk))
    assert client.get("/metrics").status_code == 200
