"""The http handler against hostile downstreams and careless input (served on 127.0.0.1)."""
from __future__ import annotations

import gzip
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dispatcher import PermanentError
from dispatcher.exceptions import InvalidParams
from dispatcher.handlers import RetryableHTTPError, http, validate_http
from dispatcher.limits import edit
from dispatcher.models import CallQueue, KeyState, LearntLimit
from support.fakeapi import answer

pytestmark = pytest.mark.django_db


class Server:
    """A one-off HTTP server on 127.0.0.1 whose GET answer is written by ``serve(handler)``."""

    def __init__(self, serve: Callable[[BaseHTTPRequestHandler], None]):
        seen = self.seen = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                seen.append(dict(self.headers))
                try:
                    serve(self)
                except OSError:  # the client hung up, as it should
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve():
    servers: list[Server] = []

    def start(fn: Callable[[BaseHTTPRequestHandler], None]) -> Server:
        servers.append(Server(fn))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def bomb(size: int) -> bytes:
    """A gzip body of ``size`` zero bytes (about a thousandth of it on the wire)."""
    out = gzip.compress(b"\0" * (1 << 20), compresslevel=9)
    stream = gzip.compress(b"\0" * size, compresslevel=9) if size <= 64 << 20 else None
    return stream if stream is not None else out


def test_a_gzip_bomb_is_decompressed_only_up_to_the_body_limit(serve):
    payload = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # 64 MB in about 64 KB

    def answer(req):
        req.send_response(200)
        req.send_header("Content-Encoding", "gzip")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        req.wfile.write(payload)

    server = serve(answer)
    tracemalloc.start()
    try:
        result = http(method="GET", url=f"{server.url}/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result["status"] == 200 and result["truncated"] and len(result["body"]) <= 4096
    assert "\x00" not in result["body"], "PostgreSQL cannot store NUL in the result"
    assert peak < 8 << 20, f"peak {peak / 1e6:.1f} MB while reading a 64 MB bomb"


def test_an_endless_answer_is_read_only_up_to_the_body_limit(serve):
    def answer(req):
        req.send_response(200)
        req.send_header("Content-Length", str(300 << 20))
        req.end_headers()
        chunk = b"a" * 65536
        for _ in range((300 << 20) // 65536):
            req.wfile.write(chunk)

    server = serve(answer)
    tracemalloc.start()
    began = time.monotonic()
    try:
        result = http(method="GET", url=f"{server.url}/huge")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result["truncated"] and len(result["body"]) == 4096
    assert peak < 8 << 20 and time.monotonic() - began < 5


def test_timeout_bounds_the_whole_call_against_a_trickling_answer(serve):
    def answer(req):
        req.send_response(200)
        req.send_header("Content-Length", "1000")
        req.end_headers()
        for _ in range(40):  # one byte every 0.2 s: every read is quick, the whole is not
            req.wfile.write(b"x")
            req.wfile.flush()
            time.sleep(0.2)

    server = serve(answer)
    began = time.monotonic()
    with pytest.raises(RetryableHTTPError, match="within 1s"):
        http(method="GET", url=f"{server.url}/trickle", timeout=1)
    assert time.monotonic() - began < 3  # the timeout plus a constant; unbounded, the answer takes 8 s


def test_timeout_bounds_trickling_headers_too():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle():
        conn, _ = listener.accept()
        conn.recv(65536)
        for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 100:
            if stop.is_set():
                break
            conn.send(bytes([byte]))
            time.sleep(0.1)
        conn.close()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    began = time.monotonic()
    try:
        with pytest.raises(RetryableHTTPError):
            http(method="GET", url=f"http://127.0.0.1:{port}/", timeout=1)
        assert time.monotonic() - began < 3  # the timeout plus a constant; unbounded, 10 s
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_secret_goes_only_to_the_hosts_and_header_it_is_bound_to(settings, serve):
    partner = serve(lambda req: answer(req, 200, {"ok": True}))
    other = serve(lambda req: answer(req, 200, {"ok": True}))
    settings.DISPATCHER_HTTP_SECRETS = f"PARTNER_TOKEN:Authorization@{partner.url.removeprefix('http://')}"
    settings.PARTNER_TOKEN = "Bearer s3cr3t"
    token = {"secret": "PARTNER_TOKEN"}
    with pytest.raises(InvalidParams, match="may not be sent"):
        CallQueue.objects.send("http", {"method": "GET", "url": f"{other.url}/", "headers": {"Authorization": token}})
    with pytest.raises(InvalidParams, match="may not be sent"):
        CallQueue.objects.send("http", {"method": "GET", "url": f"{partner.url}/", "headers": {"X-Anything": token}})
    assert not CallQueue.objects.exists()
    http(method="GET", url=f"{partner.url}/", headers={"Authorization": token})
    assert partner.seen[0]["Authorization"] == "Bearer s3cr3t"
    with pytest.raises(PermanentError, match="may not be sent"):  # the binding changed after send()
        http(method="GET", url=f"{other.url}/", headers={"Authorization": token})
    assert other.seen == []


def test_a_secret_a_header_cannot_carry_fails_without_showing_it(settings, serve):
    server = serve(lambda req: answer(req, 200, {"ok": True}))
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = "Bearer s3cr3t\n"
    with pytest.raises(PermanentError) as failure:
        http(method="GET", url=f"{server.url}/", headers={"Authorization": {"secret": "PARTNER_TOKEN"}})
    assert "s3cr3t" not in str(failure.value) and failure.value.__context__ is None
    assert server.seen == []


def test_a_bad_secret_shows_nowhere_in_the_call_or_the_logs(settings, serve, caplog):
    from dispatcher.worker import execute
    from tests.integration.test_lifecycle import claim_one

    server = serve(lambda req: answer(req, 200, {"ok": True}))
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = "Bearer s3cr3t\n"
    call = CallQueue.objects.send("http", {"method": "GET", "url": f"{server.url}/", "headers": {"Authorization": {"secret": "PARTNER_TOKEN"}}})
    claimed = claim_one(call)
    with caplog.at_level("DEBUG"):
        assert execute(claimed.id, claimed.dispatch_no) == "failed"
    call.refresh_from_db()
    shown = " ".join([call.last_error, call.last_traceback, caplog.text, *call.attempt_set.values_list("error", flat=True)])
    assert "PARTNER_TOKEN" in call.last_error and "s3cr3t" not in shown


def test_an_echoed_secret_is_scrubbed_from_the_stored_body(settings, serve):
    server = serve(lambda req: answer(req, 500, {"echo": req.headers["Authorization"]}))
    settings.DISPATCHER_HTTP_SECRETS = "PARTNER_TOKEN"
    settings.PARTNER_TOKEN = "Bearer s3cr3t"
    with pytest.raises(RetryableHTTPError) as failure:
        http(method="GET", url=f"{server.url}/", headers={"Authorization": {"secret": "PARTNER_TOKEN"}})
    assert "s3cr3t" not in str(failure.value) and "HTTP 500" in str(failure.value)


@pytest.mark.parametrize("name", [
    "Host", "host", "Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive", "TE", "Upgrade", "Trailer",
    "Proxy-Authorization", "Expect",
])
def test_hop_by_hop_and_framing_headers_are_refused_at_send(name):
    with pytest.raises(InvalidParams, match="set by the client"):
        CallQueue.objects.send("http", {"method": "POST", "url": "http://127.0.0.1:9/", "headers": {name: "x"}, "data": "a"})
    assert not CallQueue.objects.exists()


@pytest.mark.parametrize("headers", [
    {"X-A\x0bB": "v"}, {"X-Ä": "v"}, {"X-A": "vä"}, {"X-A": " v"}, {"X-A": "v\x7f"}, {"X-A": "a\x0bb"}, {"X(A)": "v"},
])
def test_headers_the_client_would_refuse_are_refused_at_send(headers):
    with pytest.raises(InvalidParams):
        validate_http({"method": "GET", "url": "http://127.0.0.1:9/", "headers": headers})


@pytest.mark.parametrize("url", ["http://xn--zz.example/", "https://xn--abc-.example/", "http://a..b/"])
def test_hosts_that_are_not_valid_idna_are_refused_at_send(url, settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["*"]
    with pytest.raises(InvalidParams):
        validate_http({"method": "GET", "url": url})


@pytest.mark.parametrize(("allowed", "url", "ok"), [
    (["api.example.com"], "https://api.example.com/", True),
    (["api.example.com"], "https://api.example.com:443/", True),
    (["api.example.com"], "http://api.example.com:8080/", False),
    (["api.example.com"], "https://api.example.com:5432/", False),
    (["api.example.com:8443"], "https://api.example.com:8443/", True),
    (["api.example.com:8443"], "https://api.example.com/", False),
    ([".example.com"], "https://x.example.com/", True),
    ([".example.com"], "https://x.example.com:6379/", False),
    (["127.0.0.1"], "http://127.0.0.1:5432/", False),
    (["127.0.0.1:*"], "http://127.0.0.1:5432/", True),
    (["[::1]:8080"], "http://[::1]:8080/", True),
])
def test_ports_are_allowed_explicitly(allowed, url, ok, settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = allowed
    if ok:
        validate_http({"method": "GET", "url": url})
    else:
        with pytest.raises(InvalidParams, match="ALLOWED_HOSTS"):
            validate_http({"method": "GET", "url": url})


def test_closed_and_non_http_ports_fail_with_the_same_text(settings):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["127.0.0.1:*"]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    talker = socket.socket()
    talker.bind(("127.0.0.1", 0))
    talker.listen()
    talker_port = talker.getsockname()[1]

    def garble():
        conn, _ = talker.accept()
        conn.recv(1024)
        conn.send(b"-ERR unknown command\r\n")
        conn.close()

    threading.Thread(target=garble, daemon=True).start()
    silent = socket.socket()  # accepts and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    silent_port = silent.getsockname()[1]
    texts = []
    for port in (closed_port, talker_port, silent_port):
        with pytest.raises(RetryableHTTPError) as failure:
            http(method="GET", url=f"http://127.0.0.1:{port}/", timeout=1)
        texts.append(str(failure.value).replace(str(port), "PORT"))
    talker.close()
    silent.close()
    assert texts[0] == texts[1] == texts[2]


def test_a_name_that_resolves_to_loopback_is_refused_unless_allowed(settings, serve):
    server = serve(lambda req: answer(req, 200, {"ok": True}))
    port = server.url.rsplit(":", 1)[1]
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["localhost:*"]
    with pytest.raises(PermanentError, match="loopback, private or link-local"):
        http(method="GET", url=f"http://localhost:{port}/")
    assert server.seen == []
    settings.DISPATCHER_HTTP_ALLOW_INTERNAL_NAMES = True
    assert http(method="GET", url=f"http://localhost:{port}/")["status"] == 200


def test_the_pooled_client_reuses_connections_and_keeps_no_cookies(fake_api, serve):
    for _ in range(20):
        assert http(method="GET", url=f"{fake_api.url}/ok")["status"] == 200
    assert fake_api.connections == 1

    server = serve(lambda req: answer(req, 200, {}, {"Set-Cookie": "session=abc; Path=/"}))
    http(method="GET", url=f"{server.url}/")
    http(method="GET", url=f"{server.url}/")
    assert "Cookie" not in server.seen[1]


def test_a_429_pause_is_capped(fake_api, settings):
    from dispatcher.worker import execute
    from tests.integration.test_lifecycle import claim_one

    settings.DISPATCHER_MAX_PAUSE = "10m"
    call = CallQueue.objects.send("http", {"method": "GET", "url": f"{fake_api.url}/limited/1?times=5&after=86400"},
                                  keys=["mailgun"])
    claimed = claim_one(call)
    assert execute(claimed.id, claimed.dispatch_no) == "rate_limited"
    state = KeyState.objects.get(key="mailgun")
    call.refresh_from_db()
    from dispatcher.clock import db_now

    assert state.paused_until - db_now() <= timedelta(minutes=10)
    assert call.run_at - db_now() <= timedelta(minutes=10) and call.status == "pending"


def test_a_learnt_limit_never_loosens_a_configured_policy(settings):
    from dispatcher.learning import report_rate_limit
    from dispatcher.limits.catalog import Policies

    edit.set_policy("partner", 10, timedelta(seconds=1))
    report_rate_limit(limit=1000, window=1, remaining=900, reset=1, key="partner")
    report_rate_limit(limit=1, window=10**9, retry_after=10**9, key="partner")
    policies = Policies.load().for_key("partner")
    assert (10, timedelta(seconds=1)) in [(p.limit, p.period) for p in policies]
    assert all(p.period <= timedelta(hours=1) for p in policies), "a learnt window is capped"
    assert KeyState.objects.get(key="partner").paused_until is None or LearntLimit.objects.filter(key="partner").exists()


@pytest.mark.parametrize(("name", "value"), [
    ("DISPATCHER_HTTP_ALLOWED_HOSTS", "api.example.com:99999"),
    ("DISPATCHER_HTTP_ALLOWED_HOSTS", "api.example.com:http"),
    ("DISPATCHER_HTTP_SECRETS", "TOKEN@api.example.com:x"),
])
def test_unreadable_http_settings_are_reported_by_the_system_check(name, value, settings):
    from dispatcher.checks import check_settings

    setattr(settings, name, value)
    assert [e.id for e in check_settings()] == ["dispatcher.E003"]


def test_what_remains_minus_the_calls_running_decides_whether_more_may_start():
    from dispatcher.clock import db_now
    from dispatcher.keys import key_set
    from dispatcher.learning import report_rate_limit

    for key, running in (("busy", 4), ("calm", 1)):
        KeyState.objects.create(key=key)
        CallQueue.objects.bulk_create(
            CallQueue(method="http", keys=[key], key_set=key_set([key]), status="running") for _ in range(running)
        )
    report_rate_limit(remaining=3, reset=20, key="busy")  # 3 remain, 3 others already running
    report_rate_limit(remaining=3, reset=20, key="calm")
    busy = KeyState.objects.get(key="busy")
    assert busy.paused_until is not None and busy.paused_until - db_now() <= timedelta(seconds=20)
    assert KeyState.objects.get(key="calm").paused_until is None
