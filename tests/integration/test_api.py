"""The JSON API: authentication, validation exactly like send(), nothing stored on bad input."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import Permission, User

from dispatcher.limits import edit
from dispatcher.models import CallQueue

pytestmark = pytest.mark.django_db

TOKEN = "t0ken-for-tests"


@pytest.fixture(autouse=True)
def api_token(settings):
    settings.DISPATCHER_API_TOKENS = TOKEN


def post(client, body, token=TOKEN, content_type="application/json"):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post("/api/calls/", data=data, content_type=content_type, **headers)


def test_a_token_holder_enqueues_a_call_and_reads_its_status(client):
    response = post(client, {"method": "greet", "params": {"name": "ada"}, "priority": 3})
    assert response.status_code == 201
    call_id = response.json()["id"]
    stored = CallQueue.objects.get(pk=call_id)
    assert (stored.method, stored.priority, stored.keys) == ("greet", 3, ["greeter", "greeter:ada"])
    status = client.get(f"/api/calls/{call_id}/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert status.status_code == 200 and status.json()["status"] == "pending"


@pytest.mark.parametrize(
    ("token", "code"), [(None, 401), ("wrong-token", 401)]
)
def test_requests_without_a_valid_token_are_refused(client, token, code):
    response = post(client, {"method": "greet", "params": {"name": "ada"}}, token=token)
    assert response.status_code == code and "error" in response.json()
    assert not CallQueue.objects.exists()


def test_status_needs_authentication(client):
    call = CallQueue.objects.send("greet", {"name": "ada"})
    assert client.get(f"/api/calls/{call.id}/").status_code == 401
    assert client.get("/api/calls/999999/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 404


@pytest.mark.parametrize(
    ("body", "content_type", "code", "message"),
    [
        ("{not json", "application/json", 400, "not valid JSON"),
        (b"\xff\xfe\x00", "application/json", 400, "not valid JSON"),
        ("[1, 2]", "application/json", 400, "JSON object"),
        ({"params": {}}, "application/json", 400, "'method' is required"),
        ({"method": "nope"}, "application/json", 400, "unknown method"),
        ({"method": "greet", "params": {"name": ""}}, "application/json", 400, "non-empty string"),
        ({"method": "greet", "params": {"name": "a"}, "evil": 1}, "application/json", 400, "unknown field"),
        ({"method": "http", "params": {"method": "GET", "url": "http://example.com/"}}, "application/json", 400, "ALLOWED_HOSTS"),
        ({"method": "greet", "params": {"name": "a"}, "run_at": "2030-01-01T00:00:00"}, "application/json", 400, "timezone"),
        ("method=greet", "application/x-www-form-urlencoded", 415, "JSON"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_store_nothing(client, body, content_type, code, message):
    response = post(client, body, content_type=content_type)
    assert response.status_code == code
    assert message in response.json()["error"]
    assert not CallQueue.objects.exists()


def test_a_staff_session_needs_the_add_permission_and_a_csrf_token():
    from django.test import Client

    user = User.objects.create_user("op", password="pw-123456", is_staff=True)
    csrf_client = Client(enforce_csrf_checks=True)
    csrf_client.force_login(user)
    body = json.dumps({"method": "greet", "params": {"name": "ada"}})
    assert csrf_client.post("/api/calls/", body, content_type="application/json").status_code == 403
    user.user_permissions.add(Permission.objects.get(codename="add_callqueue"))
    no_csrf = csrf_client.post("/api/calls/", body, content_type="application/json")
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.json()["error"]
    assert not CallQueue.objects.exists()


def test_the_example_view_sends_a_call_like_an_apps_own_view(client):
    user = User.objects.create_user("member", password="pw-123456")
    client.force_login(user)
    refused = client.post("/example/notify/", {"url": "http://example.com/hook"})
    assert refused.status_code == 400 and not CallQueue.objects.exists()
    accepted = client.post("/example/notify/", {"url": "http://127.0.0.1:9/hook"})
    assert accepted.status_code == 202
    call = CallQueue.objects.get(pk=accepted.json()["id"])
    assert call.method == "http" and call.keys == [f"partner:{user.pk}"]


def test_a_waiting_calls_status_says_when_it_will_start_counting_the_calls_ahead(client):
    from datetime import timedelta


    edit.set_policy("greeter", 1, timedelta(minutes=1))
    ids = [post(client, {"method": "greet", "params": {"name": "ada"}}).json()["id"] for _ in range(3)]
    waiting = client.get(f"/api/calls/{ids[2]}/", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").json()["waiting"]
    expected = waiting["expected"]
    assert expected["exact"] and expected["ahead"] == 2 and expected["key"] in ("greeter", "greeter:ada")
    assert waiting["until"] == expected["at"]
    assert any(r["kind"] == "queued" and "2 calls ahead" in r["text"] for r in waiting["reasons"])
