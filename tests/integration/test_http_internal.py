"""The http handler: wildcards never open internal addresses, echoed secrets are hidden in every form,
headers are checked again when the call runs (served on 127.0.0.1)."""
from __future__ import annotations

import base64

import pytest

from dispatcher import PermanentError
from dispatcher.checks import check_wildcard_hosts
from dispatcher.exceptions import InvalidParams
from dispatcher.handlers import http, validate_http
from dispatcher.models import CallQueue
from dispatcher.worker import execute
from support.fakeapi import answer
from tests.integration.test_http_hostile import serve  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db

INTERNAL = [
    "127.0.0.1", "0.0.0.0", "[::ffff:127.0.0.1]", "[::1]", "[::]", "10.0.0.1", "169.254.169.254", "192.168.1.1",
    "172.16.0.1", "100.64.0.1", "[fe80::1]", "[fd00::1]", "[2002:7f00:1::]", "[::ffff:169.254.169.254]", "127.1.2.3",
]


@pytest.mark.parametrize("wildcard", [["*"], ["*:*"], [".0.0.1:*", ".1:*"], ["*:80", "*:443"]])
@pytest.mark.parametrize("host", INTERNAL)
def test_a_wildcard_never_opens_an_internal_address(settings, wildcard, host):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = wildcard
    with pytest.raises(InvalidParams, match="ALLOWED_HOSTS"):
        validate_http({"method": "GET", "url": f"http://{host}/"})


@pytest.mark.parametrize("host", ["93.184.216.34", "[2606:2800:220:1:248:1893:25c8:1946]", "api.example.com"])
def test_a_wildcard_still_opens_public_hosts(settings, host):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["*"]
    validate_http({"method": "GET", "url": f"http://{host}/"})


@pytest.mark.parametrize(("listed", "url"), [
    ("127.0.0.1:*", "http://127.0.0.1:8080/"), ("10.0.0.1", "http://10.0.0.1/"), ("[::1]:8080", "http://[::1]:8080/"),
])
def test_an_internal_address_listed_literally_is_open(settings, listed, url):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["*", listed]
    validate_http({"method": "GET", "url": url})


def test_a_wildcard_added_after_send_does_not_reach_the_address_at_run_time(settings, serve):  # noqa: F811
    server = serve(lambda req: answer(req, 200, {"ok": True}))
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["*:*"]
    with pytest.raises(PermanentError, match="ALLOWED_HOSTS"):
        http(method="GET", url=f"{server.url}/")
    assert server.seen == []


def test_check_warns_about_a_wildcard(settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["api.example.com", "*:*"]
    assert "dispatcher.W002" in [m.id for m in check_wildcard_hosts(None)]
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["api.example.com", ".example.com"]
    assert "dispatcher.W002" not in [m.id for m in check_wildcard_hosts(None)]


# --- secrets echoed without their scheme ---------------------------------------------------

def _send_secret(settings, server, value: str) -> dict:
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = value
    return {"method": "GET", "url": f"{server.url}/", "headers": {"Authorization": {"secret": "PARTNER_TOKEN"}}}


def test_a_bare_token_echoed_in_a_401_is_hidden(settings, serve):  # noqa: F811
    def deny(req):
        token = req.headers["Authorization"].split(" ", 1)[1]
        answer(req, 401, {"error": f"invalid credential {token}"})

    server = serve(deny)
    with pytest.raises(PermanentError) as failure:
        http(**_send_secret(settings, server, "Bearer echo-sekrit-777"))
    assert "echo-sekrit-777" not in str(failure.value) and "HTTP 401" in str(failure.value)


@pytest.mark.parametrize(("secret", "echo"), [
    ("Bearer echo-sekrit-777", lambda v: v.split(" ", 1)[1]),
    ("Bearer echo/sekrit+777", lambda v: "token=" + v.split(" ", 1)[1].replace("/", "%2F").replace("+", "%2B")),
    ("Basic " + base64.b64encode(b"ann:pa55word-xyz").decode(), lambda v: "user ann, password pa55word-xyz"),
    ("sk_live_abcdef123456", lambda v: f"key {v} unknown"),
])
def test_an_echoed_secret_is_hidden_in_a_stored_body_in_every_form(settings, serve, secret, echo):  # noqa: F811
    server = serve(lambda req: answer(req, 200, {"echo": echo(req.headers["Authorization"])}))
    result = http(**_send_secret(settings, server, secret))
    body = result["body"]
    for part in ("echo-sekrit-777", "echo/sekrit+777", "echo%2Fsekrit%2B777", "pa55word-xyz", "sk_live_abcdef123456"):
        assert part not in body


def test_a_stored_error_holding_a_bare_secret_is_hidden_in_the_admin_and_the_api(settings, make_call, client):
    from django.contrib.auth.models import User

    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = "Bearer echo-sekrit-777"
    settings.DISPATCHER_API_TOKENS = "api-token-123456"
    call = make_call(status="failed", last_error="HTTP 401: invalid credential echo-sekrit-777",
                     result={"body": "you sent echo-sekrit-777"})
    staff = User.objects.create_superuser("root", password="pw")
    client.force_login(staff)
    page = client.get(f"/admin/dispatcher/callqueue/{call.id}/change/").content.decode()
    assert "HTTP 401" in page and "echo-sekrit-777" not in page
    shown = client.get(f"/api/calls/{call.id}/", HTTP_AUTHORIZATION="Bearer api-token-123456").content.decode()
    assert "HTTP 401" in shown and "echo-sekrit-777" not in shown


# --- headers checked again when the call runs ----------------------------------------------

@pytest.mark.parametrize("headers", [
    {"Host": "internal.example"}, {"Cookie": "session=abc"}, {"Content-Length": "0"}, {"Transfer-Encoding": "chunked"},
    {"X-A": "a\r\nX-Injected: 1"}, {"Authorization": "Bearer stored-in-clear"}, {"X-Ä": "v"}, "not-an-object",
])
def test_headers_stored_without_the_rules_are_refused_when_the_call_runs(serve, headers):  # noqa: F811
    server = serve(lambda req: answer(req, 200, {"ok": True}))
    call = CallQueue.objects.send("http", {"method": "GET", "url": f"{server.url}/"}, keys=["partner"])
    # As if stored before the rules, or by SQL.
    CallQueue.objects.filter(id=call.id).update(params={"method": "GET", "url": f"{server.url}/", "headers": headers})
    claimed = CallQueue.objects.filter(id=call.id)
    claimed.update(status="dispatched", dispatch_no=1)
    assert execute(call.id, 1) == "failed"
    call.refresh_from_db()
    assert "http: " in call.last_error
    assert server.seen == []
