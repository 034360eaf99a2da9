"""The http handler's allow-list, redirects and header injection; redaction of secrets."""
from __future__ import annotations

import pytest

from dispatcher.exceptions import InvalidParams
from dispatcher.handlers import check_url, validate_http
from dispatcher.redact import REDACTED, redact

HOSTILE_URLS = [
    "http://127.0.0.1@evil.example/",
    "http://user:pw@127.0.0.1/",
    "http://evil.example#@127.0.0.1/",
    "http://evil.example\\@127.0.0.1/",
    "http://2130706433/",  # 127.0.0.1 as a decimal number
    "http://0177.0.0.1/",  # octal
    "http://0x7f.0.0.1/",  # hex
    "http://127.1/",
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://localhost/",
    "http://127.0.0.1.evil.example/",
    "http://evil.example/?u=http://127.0.0.1/",
    "ftp://127.0.0.1/",
    "file:///etc/passwd",
    "http://127.0.0.1 /",
    "http://127.0.0.1/\r\nX-Injected: 1",
    "http://127.0.0.1:99999/",
    "//127.0.0.1/",
]


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_urls_off_the_allow_list_are_refused_at_send(url, settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    with pytest.raises(InvalidParams):
        check_url(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1/x", "https://127.0.0.1:8443/y?z=1", "HTTP://127.0.0.1/"])
def test_allowed_urls_pass(url, settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1", "127.0.0.1:8443"]
    assert check_url(url) == url


def test_an_empty_allow_list_refuses_everything(settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = []
    with pytest.raises(InvalidParams):
        check_url("http://127.0.0.1/")


def test_a_url_passed_before_is_judged_again_under_a_changed_allow_list(settings):
    """A worker checks each call's URL again (the allow-list may have changed since send());
    what it keeps of earlier checks never outlives the allow-list they were made under."""
    url = "http://127.0.0.1:8443/y"
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1:8443"]
    assert check_url(url) == url
    for narrower in (["127.0.0.1"], ["127.0.0.1:8444"], []):
        settings.DISPATCHER_HTTP_ALLOWED_HOSTS = narrower
        with pytest.raises(InvalidParams, match="not in DISPATCHER_HTTP_ALLOWED_HOSTS"):
            check_url(url)
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1:*"]
    assert check_url(url) == url


@pytest.mark.parametrize("headers", [
    {"X-A": "v\r\nX-Injected: 1"}, {"X-A\r\nX-B": "v"}, {"X A": "v"}, {"X-A:": "v"}, {"": "v"}, {"X-A": 1},
    {"X-A": "v\n"}, {"X-A": "v\0"},
])
def test_header_injection_is_refused(headers, settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1"]
    with pytest.raises(InvalidParams):
        validate_http({"method": "GET", "url": "http://127.0.0.1/", "headers": headers})


def test_redirects_to_other_hosts_are_not_followed(settings):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dispatcher import PermanentError
    from dispatcher.handlers import http

    hits: list[str] = []

    class Redirect(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1:*"]
        with pytest.raises(PermanentError, match="HTTP 302"):
            http(method="GET", url=f"http://127.0.0.1:{server.server_address[1]}/go")
        assert hits == ["/go"]
    finally:
        server.shutdown()
        server.server_close()


def test_secrets_are_redacted_by_name_and_by_value():
    value = {
        "headers": {"Authorization": "Bearer abc", "X-Api-Key": "k", "Cookie": "s=1", "Accept": "json"},
        "password": "p", "nested": [{"client_secret": "x"}, "Bearer xyz", "token abc"], "name": "ok",
    }
    out = redact(value)
    assert out["headers"] == {"Authorization": REDACTED, "X-Api-Key": REDACTED, "Cookie": REDACTED, "Accept": "json"}
    assert out["password"] == REDACTED and out["name"] == "ok"
    assert out["nested"] == [{"client_secret": REDACTED}, REDACTED, REDACTED]
    assert value["password"] == "p", "redact must not change its input"


def test_deeply_nested_values_are_redacted_without_crashing():
    deep: object = "Bearer t"
    for _ in range(500):
        deep = [deep]
    assert "Bearer t" not in repr(redact(deep))
