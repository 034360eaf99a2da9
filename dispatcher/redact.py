"""Redaction of values that look like secrets, for the admin, the API, the logs and the metrics.

The one home for redaction. Two entry points:

- ``redact(value)``: a JSON-like value (params, results) with secret-named entries replaced,
  and every string in it passed through ``redact_text``;
- ``redact_text(text)``: free text (errors, tracebacks, log lines, URLs, form bodies) with the
  value of every secret-named ``name=value`` pair (URL query strings, form data), ``name: value``
  header line and ``"name": "value"`` JSON member replaced, and so are credentials in a URL's
  user-info and ``Bearer``/``Basic``/``Token`` credentials.

A name is secret when ``SECRET_NAME`` finds it (``password``, ``client_secret``, ``api_key``,
``X-Access-Key``, ``signature``, ``sig``, ``key``...). Redaction is shown, never stored: the row
keeps what the handler needs to run.
"""
from __future__ import annotations

import logging
import re
from typing import Any

REDACTED = "********"
SECRET_NAME = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|api[-_]?key|access[-_]?key|auth(orization)?|cookie|credential"
    r"|private[-_]?key|signature|session[-_]?id|jwt|^(sig|key|pwd)$)",
    re.I,
)
SECRET_VALUE = re.compile(r"^(bearer|basic|token)\s+\S+", re.I)

# name=value in a query string or a form body; the value ends at &, ;, #, whitespace or a quote.
_PAIR = re.compile(r"(?P<name>[A-Za-z0-9_.\-\[\]%]+)=(?P<value>[^&;#\s'\"]+)")
# "name": "value" in JSON text (an error message quoting a body).
_JSON_MEMBER = re.compile(r'"(?P<name>[^"\\]{1,100})"\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"')
# Name: value on a header line (the rest of the line), or inside a sentence (up to a space or quote).
_HEADER = re.compile(r"(?im)^(?P<lead>\s*)(?P<name>[A-Za-z0-9_\-]{1,100}):[ \t]*(?P<value>\S.*?)[ \t]*$")
_INLINE_HEADER = re.compile(r"\b(?P<name>[A-Za-z0-9_\-]{1,100}):[ \t]*(?P<value>[^\s'\",;]+)")
# scheme://user:password@host
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<password>[^@/\s]+)@")
# Bearer abc, Basic abc anywhere in a text; Token abc1 only with a digit in it ("token expired" is prose).
_CREDENTIAL = re.compile(
    r"\b(?P<scheme>bearer|basic)(?P<gap>\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)"
    r"|\b(?P<tscheme>token)(?P<tgap>\s+)(?P<tvalue>(?=[A-Za-z._~+/=\-]*\d)[A-Za-z0-9._~+/=\-]+)",
    re.I,
)
_MAX_DEPTH = 50


def _secret(name: str) -> bool:
    return bool(SECRET_NAME.search(name))


def redact_text(text: str) -> str:
    """Return free text with every secret-looking value replaced."""
    if not text:
        return text
    text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    text = _PAIR.sub(lambda m: f"{m['name']}={REDACTED}" if _secret(m["name"]) else m[0], text)
    text = _JSON_MEMBER.sub(lambda m: f'"{m["name"]}": "{REDACTED}"' if _secret(m["name"]) else m[0], text)
    text = _HEADER.sub(lambda m: f"{m['lead']}{m['name']}: {REDACTED}" if _secret(m["name"]) else m[0], text)
    text = _INLINE_HEADER.sub(lambda m: f"{m['name']}: {REDACTED}" if _secret(m["name"]) else m[0], text)
    return _CREDENTIAL.sub(lambda m: f"{m['scheme'] or m['tscheme']}{m['gap'] or m['tgap']}{REDACTED}", text)


def redact(value: Any, depth: int = 0) -> Any:
    """Return a copy of a JSON-like value with secret-looking entries replaced."""
    if depth > _MAX_DEPTH:
        return REDACTED
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and _secret(k) else redact(v, depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact(v, depth + 1) for v in value]
    if isinstance(value, str):
        return REDACTED if SECRET_VALUE.match(value.strip()) else redact_text(value)
    return value


class RedactingFilter(logging.Filter):
    """Redact secrets from a log record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error path
            return True
        redacted = redact_text(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True
