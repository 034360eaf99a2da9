"""The worker's log names the kind of a network failure (refused, name resolution, TLS, timeout, reset)."""
from __future__ import annotations

import socket
import ssl

import httpcore
import httpx
import pytest

from dispatcher.handlers import RetryableHTTPError
from dispatcher.models import CallQueue
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


@pytest.mark.django_db(transaction=True)
def test_a_refused_connection_is_named_in_the_worker_log_not_in_the_call(caplog):
    call = CallQueue.objects.send("http", {"method": "GET", "url": f"http://127.0.0.1:{closed_port()}/", "timeout": 5})
    (claimed,) = claim(call.key_set, 1).calls
    with caplog.at_level("INFO", logger="dispatcher"):
        assert execute(claimed.id, claimed.dispatch_no) == "error"
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run_error")]
    assert line.endswith("cause=connection_refused")
    call.refresh_from_db()
    assert "no usable answer" in call.last_error and "refused" not in call.last_error
