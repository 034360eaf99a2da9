"""What kind of network failure an exception chain holds: name resolution, refused, TLS, timeout, reset, too large.

The worker's log names the kind of every failure (the exception the ``http`` handler handled stays
on the chain, ``__context__``). The call's own error names it only for a host and port the
allow-list names exactly; for a host a pattern or an any-port entry admits, every failure reads
one text, so that a caller cannot map which ports are open or which names resolve (see
``handlers.http`` and docs/http.md).
"""
from __future__ import annotations

import socket
import ssl

import httpcore
import httpx

# Innermost first: the chain's deepest known exception says what happened.
KINDS: tuple[tuple[tuple[type[BaseException], ...], str], ...] = (
    ((socket.gaierror,), "name resolution"),
    ((ssl.SSLError,), "TLS"),
    ((ConnectionRefusedError,), "connection refused"),
    ((ConnectionResetError, ConnectionAbortedError, BrokenPipeError), "connection reset"),
    ((httpx.TimeoutException, httpcore.TimeoutException, TimeoutError), "timeout"),
    ((httpx.RemoteProtocolError, httpcore.RemoteProtocolError), "not an HTTP answer (or closed early)"),
    ((httpx.LocalProtocolError, httpcore.LocalProtocolError), "request refused by the client"),
)
# h11's words for an answer whose status line and headers overflow its buffer (16 KiB).
TOO_LARGE_TEXT = "Receive buffer too long"
TOO_LARGE = "too large"
# A chain is short (the handler's error, httpx's, httpcore's, the socket's); a cycle or a long one stops here.
MAX_DEPTH = 8


def chain(exc: BaseException | None) -> list[BaseException]:
    """Return the exception and those it was raised from or while handling, outermost first."""
    found: list[BaseException] = []
    while exc is not None and exc not in found and len(found) < MAX_DEPTH:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def network_cause(exc: BaseException | None) -> str | None:
    """Return the kind of network failure behind an exception, or None when it holds none."""
    for inner in reversed(chain(exc)):
        if isinstance(inner, (httpx.RemoteProtocolError, httpcore.RemoteProtocolError)) and TOO_LARGE_TEXT in str(inner):
            return TOO_LARGE
        for classes, kind in KINDS:
            if isinstance(inner, classes):
                return kind
        if isinstance(inner, httpcore.ConnectError) and str(inner).startswith(("cannot resolve", "no address for")):
            return "name resolution"
    return None
