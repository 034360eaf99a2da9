"""The http handler's pooled client: one per process, every connection vetted, every call bounded.

One ``httpx.Client`` per worker process, created at the first call and shared by the process's
threads and greenlets: httpcore's connection pool is guarded by a lock (a gevent-aware one once
gevent has patched ``threading``), and one client per greenlet would defeat keep-alive, since
gevent runs every task in a new greenlet. It is dropped in a forked child and closed when the
worker shuts down (``close_client``, connected to Celery's shutdown signals in ``apps.py``).

The pool holds one ``DISPATCHER_HTTP_*`` value, its size (``DISPATCHER_HTTP_MAX_CONNECTIONS``,
kept alive as well as opened, so a worker of 32 threads keeps its 32 connections rather than
reconnecting 12 of them at every call, as httpx's default of 20 kept-alive ones would): the
allow-list, the secrets, the timeout and the body limit are read at every call, and the address
check at every new connection.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from http.cookiejar import DefaultCookiePolicy
from typing import Any, NoReturn

import httpcore
import httpx

from dispatcher import arrivals
from dispatcher.conf import dispatcher_settings
from dispatcher.running import here

# Connections a worker process's client opens and keeps alive at most: a -c 32 threads worker's
# calls to a few hosts, with room to spare; more only holds sockets open at the API.
MAX_CONNECTIONS = 100

_client: httpx.Client | None = None
_client_lock = threading.Lock()


class AddressRefused(Exception):
    """A name resolved to a loopback, private or link-local address, which is not allowed."""


def _left(timeout: float | None, error: type[Exception]) -> float | None:
    """Return the timeout of one network operation, cut to what is left of the call's time."""
    # The running call's deadline: every read, write and connect of its request is cut to what
    # is left, so a trickling answer cannot outlive the call.
    deadline = here().deadline
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the call's timeout has passed")
    return left if timeout is None else min(timeout, left)


class _BoundedStream(httpcore.NetworkStream):
    """A connection whose every operation ends by the current call's deadline."""

    def __init__(self, inner: httpcore.NetworkStream):
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None) -> _BoundedStream:
        return _BoundedStream(self._inner.start_tls(ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def is_internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Return whether an address is not a public one: loopback, private, link-local (metadata), unspecified, reserved.

    An IPv6 address carrying an IPv4 one (``::ffff:127.0.0.1``, 6to4, Teredo) is judged by it too.
    """
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour or (address.teredo[1] if address.teredo else None)
        if embedded is not None and is_internal(embedded):
            return True
    return not address.is_global or address.is_multicast or address.is_unspecified


def _is_internal(address: str) -> bool:
    return is_internal(ipaddress.ip_address(address.split("%")[0]))


def vetted_addresses(host: str, port: int) -> list[str]:
    """Resolve a host; refuse a name that leads to an internal address unless allowed.

    An IP address in the URL was allow-listed literally and is connected to as given. The
    connection is made to the address checked here, so a second resolution (DNS rebinding)
    cannot lead elsewhere.
    """
    try:
        ipaddress.ip_address(host)
        return [host]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not dispatcher_settings.HTTP_ALLOW_INTERNAL_NAMES:
        if any(_is_internal(a) for a in addresses):
            raise AddressRefused(
                f"http: {host} resolves to a loopback, private or link-local address; refused "
                "(list the address itself, or set DISPATCHER_HTTP_ALLOW_INTERNAL_NAMES)"
            )
    return addresses


# Hosts one process remembers having connected to, at most (cleared when full).
MAX_HOSTS = 10_000


class _GuardedBackend(httpcore.NetworkBackend):
    """Opens TCP connections only to vetted addresses, each bounded by the call's deadline, and
    says when a request opens the process's first connection to its host (``arrivals.opening``)."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()
        self._hosts: set[tuple[str, int]] = set()
        self._hosts_lock = threading.Lock()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        try:
            addresses = vetted_addresses(host, port)
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}") from exc
        failure: Exception | None = None
        for address in addresses:
            try:
                stream = self._inner.connect_tcp(
                    address, port, _left(timeout, httpcore.ConnectTimeout), local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                failure = exc
                continue
            self._connected(host, port)
            return _BoundedStream(stream)
        raise failure or httpcore.ConnectError(f"no address for {host}")

    def _connected(self, host: str, port: int) -> None:
        """Note a connection opened; the first to its host tells the running call it opened it."""
        with self._hosts_lock:
            if (host, port) in self._hosts:
                return
            if len(self._hosts) >= MAX_HOSTS:
                self._hosts.clear()
            self._hosts.add((host, port))
        arrivals.opening()

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> NoReturn:
        raise httpcore.ConnectError("unix sockets are not used")

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _NoCookies(httpx.Cookies):
    """A client's cookies that never take any from an answer."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass


def _new_client() -> httpx.Client:
    # TCP_NODELAY: a request's headers and body are two writes; Nagle's algorithm would hold
    # the body back for the server's delayed ACK.
    size = max(dispatcher_settings.tuned("HTTP_MAX_CONNECTIONS", MAX_CONNECTIONS), 1)
    transport = httpx.HTTPTransport(
        retries=0, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        limits=httpx.Limits(max_connections=size, max_keepalive_connections=size),
    )
    # httpx takes no network backend; its pool does. Pinned httpx, and tests cover the check.
    transport._pool._network_backend = _GuardedBackend()
    client = httpx.Client(transport=transport, follow_redirects=False, trust_env=False)
    # Calls are independent: a cookie one API set must not ride along on the next call. The
    # client reads no Set-Cookie at all (parsing each answer's for the jar to refuse cost 8% of
    # the handler's CPU; httpx has no option for it, hence its private attribute), and the
    # policy refuses any cookie that would reach the jar another way.
    client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))
    client._cookies = _NoCookies(client.cookies.jar)
    return client


def get_client() -> httpx.Client:
    """Return the process's client, creating it at first use."""
    global _client
    if _client is None:
        with _client_lock:
            if _client is None:
                _client = _new_client()
    return _client


def warm_client(**_: Any) -> None:
    """Build the process's client ahead of its first call (at worker start)."""
    get_client()


def close_client(**_: Any) -> None:
    """Close the process's client and its connections (at worker shutdown)."""
    global _client
    with _client_lock:
        client, _client = _client, None
    if client is not None:
        client.close()


def _forget_client() -> None:
    # A forked child must not share the parent's sockets; it builds its own client.
    global _client, _client_lock
    _client = None
    _client_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_client)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Bound every network operation inside the block to ``seconds`` from now in all."""
    run = here()
    before, run.deadline = run.deadline, time.monotonic() + seconds
    try:
        yield
    finally:
        run.deadline = before


# Most raw bytes read for one answer, whatever it decompresses to.
RAW_FACTOR = 64


def read_body(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """Read at most ``limit`` decoded bytes of a streamed answer; return them and whether more came.

    Decompression is done here, with an output bound, so that a small compressed answer that
    expands to gigabytes (a gzip bomb) costs ``limit`` bytes of memory, not its expansion.
    """
    encodings = [e.strip().lower() for e in response.headers.get("content-encoding", "").split(",") if e.strip()]
    encodings = [e for e in encodings if e != "identity"]
    decoder = None
    if len(encodings) == 1 and encodings[0] in ("gzip", "x-gzip", "deflate"):
        decoder = zlib.decompressobj(47)  # 32 + 15: a gzip or zlib header, detected
    elif encodings:
        limit = min(limit, 0)  # an encoding we do not decode: keep nothing of it
    out = bytearray()
    raw = 0
    raw_cap = max(limit, 1) * RAW_FACTOR
    for chunk in response.iter_raw(65536):
        raw += len(chunk)
        if decoder is not None:
            room = limit - len(out)
            if room <= 0:
                return bytes(out), True
            try:
                out += decoder.decompress(chunk, room)
            except zlib.error:
                return bytes(out), True
            if decoder.unconsumed_tail:
                return bytes(out), True
        else:
            out += chunk[: limit - len(out)]
            if raw > limit:
                return bytes(out), True
        if len(out) >= limit or raw > raw_cap:
            return bytes(out), True
    return bytes(out), False
