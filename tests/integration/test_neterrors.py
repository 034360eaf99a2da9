"""A network failure keeps its kind (name resolution, refused, TLS, timeout, reset, too large): in the
worker's log always, in the call's error and its attempt for an endpoint the allow-list names exactly."""
from __future__ import annotations

import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterator

import httpcore
import httpx
import pytest

from dispatcher.handlers import RetryableHTTPError
from dispatcher.models import Attempt, CallQueue
from dispatcher.neterrors import network_cause
from dispatcher.worker import execute
from tests.claims import claim


def raised(*layers: BaseException) -> BaseException:
    """Return the outermost of ``layers`` (innermost first), each raised while handling the one before,
    the last one ``from None`` as the http handler raises its own error."""
    caught: BaseException | None = None
    for n, layer in enumerate(layers):
        try:
            try:
                if caught is not None:
                    raise caught
            except BaseException as inner:
                if n == len(layers) - 1:
                    raise layer from None
                raise layer from inner
            raise layer
        except BaseException as exc:
            caught = exc
    assert caught is not None
    return caught


@pytest.mark.parametrize(("inner", "kind"), [
    (socket.gaierror(-2, "Name or service not known"), "name resolution"),
    (ConnectionRefusedError(111, "Connection refused"), "connection refused"),
    (ssl.SSLCertVerificationError("certificate verify failed"), "TLS"),
    (ConnectionResetError(104, "Connection reset by peer"), "connection reset"),
    (httpcore.ReadTimeout("timed out"), "timeout"),
])
def test_the_kind_of_a_network_failure_survives_the_handler_s_one_text(inner, kind):
    error = raised(inner, httpcore.ConnectError("x"), httpx.ConnectError("x"), RetryableHTTPError("http: no usable answer"))
    assert network_cause(error) == kind


def test_an_error_with_no_network_failure_has_no_cause():
    assert network_cause(ValueError("boom")) is None
    assert network_cause(None) is None
    assert network_cause(raised(KeyError("k"), RuntimeError("handler"))) is None


def test_our_resolver_s_refusal_to_resolve_reads_as_name_resolution():
    assert network_cause(raised(httpcore.ConnectError("cannot resolve api.example"), RetryableHTTPError("x"))) == "name resolution"


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket closes


def run_once(url: str, caplog: pytest.LogCaptureFixture, timeout: float = 5) -> tuple[CallQueue, Attempt, str]:
    """Send one http call, run it as a worker does; return the call, its attempt and the worker's log line."""
    call = CallQueue.objects.send("http", {"method": "GET", "url": url, "timeout": timeout})
    (claimed,) = claim(call.key_set, 1).calls
    with caplog.at_level("INFO", logger="dispatcher"):
        assert execute(claimed.id, claimed.dispatch_no) == "error"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run_error")]
    call.refresh_from_db()
    return call, call.attempt_set.get(), line


Serve = Callable[[socket.socket], None]


@pytest.fixture
def fake_server() -> Iterator[Callable[[Serve], int]]:
    """Start servers on 127.0.0.1 that treat one connection as told; return their ports."""
    sockets: list[socket.socket] = []

    def start(treat: Serve) -> int:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(10)
        sockets.append(server)

        def accept() -> None:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                try:
                    conn.recv(65536)
                    treat(conn)
                except OSError:
                    pass

        threading.Thread(target=accept, daemon=True).start()
        return server.getsockname()[1]

    yield start
    for server in sockets:
        server.close()


def never_answer(conn: socket.socket) -> None:
    conn.recv(1)  # until the client gives up


def reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST


def huge_head(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Padding: " + b"a" * 200_000 + b"\r\n\r\n")


def plain_http(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.mark.django_db(transaction=True)
def test_a_refused_connection_behind_an_any_port_entry_is_named_in_the_worker_log_not_in_the_call(caplog):
    call, attempt, line = run_once(f"http://127.0.0.1:{closed_port()}/", caplog)
    assert line.endswith("cause=connection_refused")
    assert "no usable answer" in call.last_error and "refused" not in call.last_error
    assert attempt.error == call.last_error


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("scheme", "treat", "kind"), [
    ("http", None, "connection refused"),
    ("http", never_answer, "timeout"),
    ("http", reset, "connection reset"),
    ("http", huge_head, "too large"),
    ("https", plain_http, "TLS"),
])
def test_a_listed_endpoint_s_failure_keeps_its_kind_in_the_call_its_attempt_and_the_log(
    settings, caplog, fake_server, scheme, treat, kind
):
    port = closed_port() if treat is None else fake_server(treat)
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = [f"127.0.0.1:{port}"]
    call, attempt, line = run_once(f"{scheme}://127.0.0.1:{port}/v1?token=abc", caplog, timeout=1)
    assert call.last_error.startswith(f"dispatcher.handlers.RetryableHTTPError: http: 127.0.0.1:{port}: {kind}")
    assert attempt.error == call.last_error
    assert line.endswith(f"cause={kind.replace(' ', '_')}")
    # The kind and the endpoint, nothing of the request or the OS's own words.
    assert "token" not in call.last_error and "/v1" not in call.last_error and "Errno" not in call.last_error


@pytest.mark.django_db(transaction=True)
def test_a_listed_name_that_does_not_resolve_reads_name_resolution(settings, caplog):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = ["api.dispatcher-test.invalid"]
    call, _, line = run_once("http://api.dispatcher-test.invalid/", caplog)
    assert call.last_error.endswith("http: api.dispatcher-test.invalid: name resolution")
    assert line.endswith("cause=name_resolution")


@pytest.mark.django_db(transaction=True)
def test_behind_a_pattern_a_name_that_does_not_resolve_reads_like_any_other_failure(settings, caplog):
    settings.DISPATCHER_HTTP_ALLOWED_HOSTS = [".dispatcher-test.invalid"]
    call, _, line = run_once("http://api.dispatcher-test.invalid/", caplog)
    assert "no usable answer from api.dispatcher-test.invalid" in call.last_error
    assert "resolution" not in call.last_error
    assert line.endswith("cause=name_resolution")


def test_an_answer_head_over_the_client_s_bound_reads_too_large():
    error = raised(RuntimeError("Receive buffer too long"), httpcore.RemoteProtocolError("Receive buffer too long"),
                   httpx.RemoteProtocolError("Receive buffer too long"), RetryableHTTPError("x"))
    assert network_cause(error) == "too large"
