"""The built-in ``http`` handler: one HTTP request to an allow-listed host and port."""
from __future__ import annotations

import functools
import ipaddress
import os
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit

import httpx
import idna
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.http.request import validate_host

from dispatcher import PermanentError, RateLimited, arrivals, handler, httpclient, learning, ratelimit_headers
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidParams
from dispatcher.httpclient import get_client, is_internal, read_body
from dispatcher.neterrors import network_cause
from dispatcher.redact import SECRET_NAME, scrub, secret_parts

try:  # registers the ``task`` method; a site without Django Tasks (Django 5.2, no backport) has none
    from dispatcher import backends  # noqa: F401
except ImproperlyConfigured:
    pass

HTTP_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}
HTTP_PARAMS = {"method", "url", "headers", "json", "data", "timeout"}
MAX_RETRY_AFTER = 86400.0
DEFAULT_PORTS = {"http": 80, "https": 443}
# The client sets these from the request itself; a caller's would smuggle or confuse framing.
FORBIDDEN_HEADERS = {
    "host", "content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection",
    "te", "trailer", "upgrade", "expect", "proxy-authorization", "proxy-authenticate",
}
# RFC 9110 field names and values as h11 (httpx's HTTP/1.1 engine) checks them; httpx encodes
# values as ASCII, so obs-text is refused too.
HEADER_NAME = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
HEADER_VALUE = re.compile(r"(?:[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*)?")
MAX_HEADER_VALUE = 8192
# Characters of a response body stored with the call (and about all that is read of it): enough
# for an error message or an id, never a whole download.
MAX_BODY = 4096
# A URL character that is a space, a control or DEL.
URL_REFUSED_CHAR = re.compile(r"[\x00-\x20\x7f]")


class RetryableHTTPError(Exception):
    """A 5xx answer, a timeout or a failed connection: worth another attempt."""


@dataclass(frozen=True)
class HostRule:
    """One allow-list entry: a Django ALLOWED_HOSTS pattern and the ports it opens."""

    pattern: str
    port: int | None  # None: the scheme's default port only
    any_port: bool = False

    @classmethod
    def parse(cls, entry: str) -> HostRule:
        entry = entry.strip().lower()
        host, port = entry, ""
        if entry.startswith("["):
            close = entry.find("]")
            host, port = entry[: close + 1], entry[close + 1 :].removeprefix(":")
        elif entry.count(":") == 1:
            host, port = entry.split(":")
        if port == "*":
            return cls(host, None, any_port=True)
        if port:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"bad port in allow-list entry {entry!r}")
            return cls(host, int(port))
        return cls(host, None)

    def admits(self, host: str, scheme: str, port: int | None) -> bool:
        effective = port if port is not None else DEFAULT_PORTS[scheme]
        if not (self.any_port or effective == (self.port if self.port is not None else DEFAULT_PORTS[scheme])):
            return False
        address = ip_literal(host)
        if address is not None and is_internal(address):
            # A pattern (``*``, ``.0.0.1``) never opens a loopback, private, link-local,
            # unspecified or metadata address: only that address listed literally does.
            return ip_literal(self.pattern) == address
        return validate_host(host, [self.pattern])

    def names(self, host: str, scheme: str, port: int | None) -> bool:
        """Say whether this entry names the host and its port exactly: no pattern, no any-port."""
        if self.any_port or self.pattern == "*" or self.pattern.startswith("."):
            return False
        effective = port if port is not None else DEFAULT_PORTS[scheme]
        return self.pattern == host.lower() and effective == (self.port if self.port is not None else DEFAULT_PORTS[scheme])


def ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """Return the address a host names literally (``[::1]`` too), else None."""
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def host_rules(entries: list[str]) -> list[HostRule]:
    """Parse allow-list entries; an unparsable one raises ValueError."""
    return [HostRule.parse(entry) for entry in entries if entry.strip()]


def unreachable(origin: str, host: str, scheme: str, port: int | None, timeout: float, exc: BaseException) -> str:
    """Return the text of a failure to talk to a host: its kind for an endpoint the allow-list names
    exactly, else one text for every kind.

    An operator who lists ``api.example.com`` chose that endpoint: "connection refused" or "name
    resolution" tells the caller nothing the operator did not publish. A pattern (``.example.com``,
    ``*``) or an any-port entry (``10.0.0.5:*``) lets a caller pick names and ports: there the kind
    would map which ports are open and which names resolve, so every failure reads the same. The
    worker's log names the kind in both cases (``neterrors``); the text holds no address, no OS
    message and nothing of the request.
    """
    flat = f"http: no usable answer from {origin} within {timeout:g}s"
    kind = network_cause(exc)
    if kind is None or not any(rule.names(host, scheme, port) for rule in host_rules(dispatcher_settings.HTTP_ALLOWED_HOSTS)):
        return flat
    if kind == "timeout":
        return f"http: {origin}: timeout (no complete answer within {timeout:g}s)"
    return f"http: {origin}: {kind}"


def _url_host(url: str) -> tuple[str, str, int | None]:
    return _split_host(urlsplit(url))


def _split_host(parts: SplitResult) -> tuple[str, str, int | None]:
    """Return the host as the allow-list names it (IPv6 in brackets), the scheme and the port."""
    host = parts.hostname or ""
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            host = f"[{host}]"
    except ValueError:
        pass
    return host, parts.scheme.lower(), parts.port


def _check_idna(host: str) -> None:
    """Refuse a host httpx or the TLS layer would refuse at run time (bad punycode, bad IDNA)."""
    if "" in host.removesuffix(".").split("."):
        raise InvalidParams(f"http: host {host!r} has an empty label")
    for label in host.split("."):
        if label.lower().startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError, ValueError) as exc:
                raise InvalidParams(f"http: host label {label!r} is not valid IDNA: {exc}") from None


def check_url(url: Any) -> str:
    """Return the URL if its scheme is http(s) and its host and port are allow-listed, else raise InvalidParams."""
    _checked_url(url)
    return str(url)


def _checked_url(url: Any) -> tuple[httpx.URL, str, int | None]:
    """Check a URL as ``check_url`` does; return it as the client parsed it, its host and its port."""
    if not isinstance(url, str) or not url:
        raise InvalidParams("http: 'url' must be a non-empty string")
    return _checked_against(str(url), tuple(dispatcher_settings.HTTP_ALLOWED_HOSTS))


# A worker checks each call's URL again before its request (the allow-list may have changed
# since send()); the same URL under the same allow-list passes the same way, so its last
# checks are kept (parsing it and its host's address was 0.2 ms of a call's CPU in a worker,
# docs/performance.md). A URL refused raises, and is checked again each time.
@functools.lru_cache(maxsize=256)
def _checked_against(url: str, entries: tuple[str, ...]) -> tuple[httpx.URL, str, int | None]:
    if len(url) > 8192 or URL_REFUSED_CHAR.search(url):
        raise InvalidParams("http: 'url' must not contain spaces or control characters, nor exceed 8192 characters")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise InvalidParams(f"http: malformed url {url!r}: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidParams(f"http: only http and https urls are allowed, not {parts.scheme or 'none'!r}")
    if "@" in parts.netloc:
        raise InvalidParams("http: credentials in the url are refused; put them in headers from settings")
    if not host:
        raise InvalidParams(f"http: url {url!r} names no host")
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, UnicodeError, ValueError) as exc:
        raise InvalidParams(f"http: the http client refuses url {url!r}: {exc}") from None
    _check_idna(host)
    candidate, scheme, port = _split_host(parts)
    try:
        rules = host_rules(list(entries))
    except ValueError as exc:
        raise InvalidParams(f"http: DISPATCHER_HTTP_ALLOWED_HOSTS: {exc}") from None
    if not any(rule.admits(candidate, scheme, port) for rule in rules):
        shown = f"{host}:{port}" if port is not None else host
        raise InvalidParams(
            f"http: {shown!r} is not in DISPATCHER_HTTP_ALLOWED_HOSTS ({', '.join(entries) or 'empty'}); "
            "an entry without a port opens the scheme's default port only"
        )
    return parsed, candidate, port


@dataclass(frozen=True)
class SecretGrant:
    """Where one secret may be sent: under which header (any if None), to which hosts (any allowed if none)."""

    header: str | None
    rules: tuple[HostRule, ...]


def secret_grants() -> dict[str, list[SecretGrant]]:
    """Parse DISPATCHER_HTTP_SECRETS: ``NAME``, ``NAME@host[:port]``, ``NAME:Header@host[:port]``."""
    grants: dict[str, list[SecretGrant]] = {}
    for entry in dispatcher_settings.HTTP_SECRETS:
        left, at, host = entry.partition("@")
        name, _, header = left.partition(":")
        rules = (HostRule.parse(host),) if at else ()
        grants.setdefault(name.strip(), []).append(SecretGrant(header.strip().lower() or None, rules))
    return grants


def _secret_name(header: str, value: dict[str, Any], url: str | None = None) -> str:
    """Return the setting a ``{"secret": NAME}`` header value refers to, if it may go there."""
    name = value.get("secret")
    if set(value) != {"secret"} or not isinstance(name, str):
        raise InvalidParams(f"http: header {header!r} must be a string or {{\"secret\": \"SETTING_NAME\"}}")
    try:
        grants = secret_grants()
    except ValueError as exc:
        raise InvalidParams(f"http: DISPATCHER_HTTP_SECRETS: {exc}") from None
    if name not in grants:
        raise InvalidParams(f"http: secret {name!r} is not listed in DISPATCHER_HTTP_SECRETS")
    if url is not None:
        host, scheme, port = _url_host(url)
        if not any(
            (grant.header is None or grant.header == header.lower())
            and (not grant.rules or any(rule.admits(host, scheme, port) for rule in grant.rules))
            for grant in grants[name]
        ):
            raise InvalidParams(
                f"http: secret {name!r} may not be sent under header {header!r} to {host!r} "
                "(DISPATCHER_HTTP_SECRETS binds it as NAME:Header@host)"
            )
    return name


def check_headers(headers: Any, url: str) -> None:
    """Raise InvalidParams unless the headers are ones the client may send: at send() and again when the call runs."""
    if headers is None:
        return
    if not isinstance(headers, dict):
        raise InvalidParams("http: 'headers' must be an object of strings")
    for name, value in headers.items():
        if not isinstance(name, str) or not HEADER_NAME.fullmatch(name):
            raise InvalidParams(f"http: bad header name {name!r}: header names are ASCII tokens")
        if name.lower() in FORBIDDEN_HEADERS:
            raise InvalidParams(f"http: header {name!r} is set by the client from the request; it cannot be given")
        if isinstance(value, dict):
            _secret_name(name, value, url)
            continue
        if not isinstance(value, str) or len(value) > MAX_HEADER_VALUE or not HEADER_VALUE.fullmatch(value):
            raise InvalidParams(
                f"http: bad header {name!r}: values are single-line printable ASCII strings "
                "without leading or trailing spaces"
            )
        if SECRET_NAME.search(name):
            raise InvalidParams(
                f"http: header {name!r} carries a credential; give it as {{\"secret\": \"SETTING_NAME\"}} so it is "
                "read from settings when the call runs and never stored (names listed in DISPATCHER_HTTP_SECRETS)"
            )


def validate_http(params: dict[str, Any]) -> None:
    """Check the params of an ``http`` call before it is stored: what the client would refuse too."""
    unknown = set(params) - HTTP_PARAMS
    if unknown:
        raise InvalidParams(f"http: unknown params {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(HTTP_PARAMS))}")
    method = params.get("method")
    if not isinstance(method, str) or method.upper() not in HTTP_METHODS:
        raise InvalidParams(f"http: 'method' must be one of {', '.join(sorted(HTTP_METHODS))}, not {method!r}")
    url = check_url(params.get("url"))
    check_headers(params.get("headers"), url)
    if "json" in params and "data" in params:
        raise InvalidParams("http: give 'json' or 'data', not both")
    data = params.get("data")
    if data is not None and not isinstance(data, (str, dict)):
        raise InvalidParams("http: 'data' must be a string or an object of form fields")
    timeout = params.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300):
        raise InvalidParams("http: 'timeout' must be a number of seconds between 0 and 300")


def resolve_headers(headers: dict[str, Any], url: str | None = None) -> dict[str, str]:
    """Fill ``{"secret": NAME}`` header values from Django settings or the environment."""
    return _resolve_headers(headers, url)[0]


def _resolve_headers(headers: dict[str, Any], url: str | None) -> tuple[dict[str, str], list[str]]:
    """Return the headers filled in and the secret values used (to scrub them from any text)."""
    resolved, secrets = {}, []
    for header, value in headers.items():
        if isinstance(value, dict):
            try:
                name = _secret_name(header, value, url)
            except InvalidParams as exc:  # the list of secrets changed since send()
                raise PermanentError(str(exc)) from None
            secret = getattr(django_settings, name, None) or os.environ.get(name)
            if not secret:
                raise PermanentError(f"secret {name!r} for header {header!r} is not set")
            secret = str(secret)
            if not HEADER_VALUE.fullmatch(secret) or len(secret) > MAX_HEADER_VALUE:
                # Never echo the value: it may be a real credential with a stray newline.
                raise PermanentError(
                    f"secret {name!r} for header {header!r} has characters a header cannot carry "
                    "(a newline, a control or non-ASCII character, or surrounding spaces)"
                )
            resolved[header] = secret
            secrets.append(secret)
        else:
            resolved[header] = value
    return resolved, secrets


def parse_retry_after(value: str | None) -> float | None:
    """Return the seconds a Retry-After header asks for (delta-seconds or an HTTP date)."""
    return ratelimit_headers.parse_retry_after(value, time.time())


def _scrub(text: str, secrets: list[str]) -> str:
    """Hide the secrets sent with the request wherever the answer echoes them, with or without their scheme."""
    return scrub(text, sorted({part for secret in secrets for part in secret_parts(secret)}, key=len, reverse=True))


@handler("http", validator=validate_http)
@arrivals.marks_sent
def http(**params: Any) -> dict[str, Any]:
    """Send the request; 2xx is done, 429 pauses, 5xx and network errors retry, other 4xx fail."""
    url = params["url"]
    try:
        # The allow-list may have changed since send(). The request goes to the URL as checked,
        # not parsed again.
        target, host, port = _checked_url(url)
        # So may the header rules: a row stored before them (or by SQL) is checked as send() would.
        check_headers(params.get("headers"), url)
    except InvalidParams as exc:
        raise PermanentError(str(exc)) from None
    timeout = float(params.get("timeout") or dispatcher_settings.HTTP_TIMEOUT)
    headers, secrets = _resolve_headers(params.get("headers") or {}, url)
    headers.setdefault("Accept-Encoding", "gzip, deflate")  # what read_body can decode with a bound
    request: dict[str, Any] = {"headers": headers}
    if "json" in params:
        request["json"] = params["json"]
    elif isinstance(params.get("data"), dict):
        request["data"] = params["data"]
    elif params.get("data") is not None:
        request["content"] = params["data"]
    origin = f"{host}:{port}" if port is not None else host
    limit = max(dispatcher_settings.tuned("HTTP_MAX_BODY", MAX_BODY), 0)
    try:
        # ``timeout`` bounds the whole call: connect, send, headers and body together.
        # The trace hook tells the worker when the request's headers go out (the learnt arrival guard).
        with httpclient.deadline(timeout), get_client().stream(
            params["method"].upper(), target, timeout=timeout, extensions={"trace": arrivals.trace}, **request
        ) as response:
            raw, truncated = read_body(response, limit * 4)
            status, answer_headers = response.status_code, response.headers
            encoding = response.charset_encoding or "utf-8"
    except httpclient.AddressRefused as exc:
        raise PermanentError(str(exc)) from None
    except httpx.TransportError as exc:
        # Its kind only where the allow-list names the endpoint (see ``unreachable``); the
        # exception stays on the chain for the worker's log.
        raise RetryableHTTPError(unreachable(origin, host, target.scheme, port, timeout, exc)) from None
    except (httpx.HTTPError, UnicodeError, ValueError) as exc:
        raise PermanentError(_scrub(f"http: request refused by the client: {type(exc).__name__}: {exc}", secrets)) from None
    except Exception as exc:  # anything else: retried, its text scrubbed, its chain (and locals) dropped
        raise RetryableHTTPError(_scrub(f"http: {type(exc).__name__}: {exc}", secrets)) from None
    try:
        body = raw.decode(encoding, errors="replace")
    except LookupError:
        body = raw.decode("utf-8", errors="replace")
    cut = len(body) > limit
    # PostgreSQL's text and jsonb cannot hold NUL: the body must be storable whatever came.
    body = _scrub(body[:limit], secrets).replace("\x00", "\ufffd")
    signal = ratelimit_headers.parse(answer_headers, status, time.time())
    if status == 429:
        learning.apply(ratelimit_headers.Signal(
            remaining=signal.remaining, reset=signal.reset, windows=signal.windows, source=signal.source, text=signal.text,
        ))  # the pause itself is the RateLimited below, on the same keys
        if signal.retry_after is not None and not signal.windows and signal.remaining is None:
            # Nothing but Retry-After: the limit is inferred from the calls it admitted.
            learning.infer_from_retry_after(signal.retry_after, signal.text)
        raise RateLimited(retry_after=learning.cap_pause(signal.wait()), message=f"HTTP 429: {body[:200]}")
    learning.apply(signal)
    if status >= 500:
        raise RetryableHTTPError(f"HTTP {status}: {body[:500]}")
    if status >= 300:
        raise PermanentError(f"HTTP {status}: {body[:500]}")
    result: dict[str, Any] = {"status": status, "body": body}
    if truncated or cut:
        result["truncated"] = True
    return result
