"""The built-in ``http`` handler: one HTTP request to an allow-listed host."""
from __future__ import annotations

import email.utils
import ipaddress
import os
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from django.conf import settings as django_settings
from django.http.request import validate_host

from dispatcher import PermanentError, RateLimited, handler
from dispatcher.conf import dispatcher_settings
from dispatcher.exceptions import InvalidParams
from dispatcher.redact import SECRET_NAME

HTTP_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"}
HTTP_PARAMS = {"method", "url", "headers", "json", "data", "timeout"}
MAX_RETRY_AFTER = 86400.0


class RetryableHTTPError(Exception):
    """A 5xx answer: worth another attempt."""


def check_url(url: Any) -> str:
    """Return the URL if its scheme is http(s) and its host is allow-listed, else raise InvalidParams."""
    if not isinstance(url, str) or not url:
        raise InvalidParams("http: 'url' must be a non-empty string")
    if len(url) > 8192 or any(ord(c) < 33 or ord(c) == 127 for c in url):
        raise InvalidParams("http: 'url' must not contain spaces or control characters, nor exceed 8192 characters")
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise InvalidParams(f"http: malformed url {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidParams(f"http: only http and https urls are allowed, not {parts.scheme or 'none'!r}")
    if "@" in parts.netloc:
        raise InvalidParams("http: credentials in the url are refused; put them in headers from settings")
    if not host:
        raise InvalidParams(f"http: url {url!r} names no host")
    allowed = dispatcher_settings.HTTP_ALLOWED_HOSTS
    candidate = host
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            candidate = f"[{host}]"
    except ValueError:
        pass
    if not allowed or not validate_host(candidate, allowed):
        raise InvalidParams(
            f"http: host {host!r} is not in DISPATCHER_HTTP_ALLOWED_HOSTS ({', '.join(allowed) or 'empty'})"
        )
    return url


def validate_http(params: dict[str, Any]) -> None:
    """Check the params of an ``http`` call before it is stored."""
    unknown = set(params) - HTTP_PARAMS
    if unknown:
        raise InvalidParams(f"http: unknown params {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(HTTP_PARAMS))}")
    method = params.get("method")
    if not isinstance(method, str) or method.upper() not in HTTP_METHODS:
        raise InvalidParams(f"http: 'method' must be one of {', '.join(sorted(HTTP_METHODS))}, not {method!r}")
    check_url(params.get("url"))
    headers = params.get("headers")
    if headers is not None:
        if not isinstance(headers, dict):
            raise InvalidParams("http: 'headers' must be an object of strings")
        for name, value in headers.items():
            if not name or any(c in name for c in ":\r\n \t"):
                raise InvalidParams(f"http: bad header name {name!r}: header names are tokens")
            if isinstance(value, dict):
                _secret_name(name, value)
                continue
            if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
                raise InvalidParams(f"http: bad header {name!r}: values are single-line strings")
            if SECRET_NAME.search(name):
                raise InvalidParams(
                    f"http: header {name!r} carries a credential; give it as {{\"secret\": \"SETTING_NAME\"}} so it is "
                    "read from settings when the call runs and never stored (names listed in DISPATCHER_HTTP_SECRETS)"
                )
    if "json" in params and "data" in params:
        raise InvalidParams("http: give 'json' or 'data', not both")
    data = params.get("data")
    if data is not None and not isinstance(data, (str, dict)):
        raise InvalidParams("http: 'data' must be a string or an object of form fields")
    timeout = params.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 300):
        raise InvalidParams("http: 'timeout' must be a number of seconds between 0 and 300")


def _secret_name(header: str, value: dict[str, Any]) -> str:
    """Return the setting a ``{"secret": NAME}`` header value refers to, if it is allowed."""
    name = value.get("secret")
    if set(value) != {"secret"} or not isinstance(name, str):
        raise InvalidParams(f"http: header {header!r} must be a string or {{\"secret\": \"SETTING_NAME\"}}")
    if name not in dispatcher_settings.HTTP_SECRETS:
        raise InvalidParams(f"http: secret {name!r} is not listed in DISPATCHER_HTTP_SECRETS")
    return name


def resolve_headers(headers: dict[str, Any]) -> dict[str, str]:
    """Fill ``{"secret": NAME}`` header values from Django settings or the environment."""
    resolved = {}
    for header, value in headers.items():
        if isinstance(value, dict):
            try:
                name = _secret_name(header, value)
            except InvalidParams as exc:  # the list of secrets changed since send()
                raise PermanentError(str(exc)) from None
            secret = getattr(django_settings, name, None) or os.environ.get(name)
            if not secret:
                raise PermanentError(f"secret {name!r} for header {header!r} is not set")
            resolved[header] = str(secret)
        else:
            resolved[header] = value
    return resolved


def parse_retry_after(value: str | None) -> float | None:
    """Return the seconds a Retry-After header asks for (delta-seconds or an HTTP date)."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    if seconds != seconds:
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


@handler("http", validator=validate_http)
def http(**params: Any) -> dict[str, Any]:
    """Send the request; 2xx is done, 429 pauses, 5xx and network errors retry, other 4xx fail."""
    try:
        url = check_url(params["url"])  # the allow-list may have changed since send()
    except InvalidParams as exc:
        raise PermanentError(str(exc)) from None
    timeout = params.get("timeout") or dispatcher_settings.HTTP_TIMEOUT
    request: dict[str, Any] = {"headers": resolve_headers(params.get("headers") or {})}
    if "json" in params:
        request["json"] = params["json"]
    elif isinstance(params.get("data"), dict):
        request["data"] = params["data"]
    elif params.get("data") is not None:
        request["content"] = params["data"]
    # Redirects are not followed: the next hop could be a host off the allow-list.
    with httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False) as client:
        response = client.request(params["method"].upper(), url, **request)
    body = response.text[: dispatcher_settings.HTTP_MAX_BODY]
    status = response.status_code
    if status == 429:
        raise RateLimited(retry_after=parse_retry_after(response.headers.get("retry-after")), message=f"HTTP 429: {body[:200]}")
    if status >= 500:
        raise RetryableHTTPError(f"HTTP {status}: {body[:500]}")
    if status >= 300:
        raise PermanentError(f"HTTP {status}: {body[:500]}")
    return {"status": status, "body": body}


def _validate_task(params: dict[str, Any]) -> None:
    from dispatcher.backends import check_task_params

    check_task_params(params)


@handler("task", validator=_validate_task)
def task(**params: Any) -> Any:
    """Run a Django Tasks task stored by dispatcher.backends.DispatcherBackend."""
    from dispatcher.backends import run_task

    return run_task(**params)
