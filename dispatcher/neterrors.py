"""What kind of network failure an exception chain holds: name resolution, refused, TLS, timeout, reset.

The ``http`` handler gives a caller one text for every failure to talk to a host (see
``handlers.http``), so that a call's error says nothing of which ports are open; the exception it
handled stays on the chain (``__context__``), and the worker's log names its kind for the operator.
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
        for classes, kind in KINDS:
            if isinstance(inner, classes):
                return kind
        if isinstance(inner, httpcore.ConnectError) and str(inner).startswith(("cannot resolve", "no address for")):
            return "name resolution"
    return None
