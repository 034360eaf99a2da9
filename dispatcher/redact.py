"""Redaction of values that look like secrets, for the admin, the API, the logs and the metrics.

The one home for redaction. Two entry points:

- ``redact(value)``: a JSON-like value (params, results) with secret-named entries replaced,
  and every string in it passed through ``redact_text``;
- ``redact_text(text)``: free text (errors, tracebacks, log lines, URLs, form bodies, XML, Python
  reprs) with the value of every secret-named ``name=value`` pair (also ``name = value`` and
  URL-encoded names such as ``api%5Fkey``), ``name: value`` header line, ``"name": "value"`` or
  ``'name': 'value'`` member and ``<name>value</name>`` element replaced, and so are credentials
  in a URL's user-info, ``Bearer``/``Basic``/``Token`` credentials, PEM private key bodies and the
  value of every secret the http handler may send (``DISPATCHER_HTTP_SECRETS``), with or without
  its scheme.

A name is secret when ``SECRET_NAME`` finds it (``password``, ``client_secret``, ``api_key``,
``X-Access-Key``, ``Ocp-Apim-Subscription-Key``, ``signature``, ``sig``, ``key``...). Redaction is
shown, never stored: the row keeps what the handler needs to run.

Every pattern here runs in time linear in its text (SPEC invariant 9): a name is matched only
from its first character (a look-behind refuses a start inside a run of name characters), runs
are bounded or possessive, and no two patterns scan the same text more than a fixed number of
times. ``bench/hostile.py`` measures 1 MB.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from typing import Any
from urllib.parse import quote, unquote

from django.conf import settings

from dispatcher.conf import dispatcher_settings

REDACTED = "********"
SECRET_NAME = re.compile(
    r"(pass(word|wd|phrase)?|secret|token|api[-_]?key|access[-_]?key|subscription[-_]?key|auth(orization)?|cookie"
    r"|credential|private[-_]?key|signature|session[-_]?id|jwt|^(sig|key|pwd)$)",
    re.I,
)
SECRET_VALUE = re.compile(r"^(bearer|basic|token)\s+\S+", re.I)
# Values that say there is no secret: ``key=None`` stays readable in a log line.
NOT_SECRET = frozenset({"", "none", "null", "nil", "undefined", "true", "false", "-", REDACTED.lower()})
# A known secret shorter than this is not searched for in text (it would hide ordinary words).
MIN_KNOWN_SECRET = 6

_NAME_CHARS = r"A-Za-z0-9_.\-\[\]%"
# -----BEGIN ... PRIVATE KEY----- ... -----END ... PRIVATE KEY----- (or the text's end).
_PEM = re.compile(
    r"(?P<begin>-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----)(?:(?!-----END )[\s\S])*+(?P<end>-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----)?"
)
# scheme://user:password@host
_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,40}://)(?P<user>[^:/@\s]{0,200}):(?P<password>[^@/\s]++)@"
)
# name=value (query strings, form bodies, prose ``password = x``); the value ends at &, ;, #,
# a comma, whitespace or a quote, or is quoted itself (to its closing quote, or the line's end).
# Only ``name=`` is consumed (``_named``): the value is read for a secret name alone, so the
# value of another name (``note="retry password=x"``, ``note=password=x``) is scanned too.
_PAIR = re.compile(rf"(?<![{_NAME_CHARS}])(?P<name>[{_NAME_CHARS}]{{1,200}})(?P<eq>[ \t]*+=[ \t]*+)")
_PAIR_VALUE = re.compile(r"\"[^\"\n]*+\"?|'[^'\n]*+'?|[^&;#\s'\",]++")
# "name": "value", 'name': 'value' (JSON quoted in an error, a Python repr), or a bare value.
# The value is matched in a look-ahead: a member consumes its value only when it is replaced
# (``_members``), so a quote in another member's value may open the next name.
_MEMBER = re.compile(
    r"(?P<q>[\"'])(?P<name>[^\"'\\\n]{1,100})(?P=q)[ \t]*:[ \t]*"
    r"(?=\"(?P<dq>(?:[^\"\\]++|\\.)*+)\"|'(?P<sq>(?:[^'\\]++|\\.)*+)'|(?P<bare>[^\s,}\]\"']++))"
)
# Name: value on a header line (the rest of the line), or inside a sentence (up to a space or quote).
_HEADER = re.compile(r"(?m)^(?P<lead>[ \t]*+)(?P<name>[A-Za-z0-9_%\-]{1,100}):[ \t]*+(?P<value>[^\r\n]*)")
_INLINE_HEADER = re.compile(r"(?<![A-Za-z0-9_%\-])(?P<name>[A-Za-z0-9_%\-]{1,100})(?P<eq>:[ \t]*+)")
_INLINE_VALUE = re.compile(r"[^\s'\",;]++")
# <name attr="...">value</name>
_ELEMENT = re.compile(
    r"<(?P<tag>[A-Za-z_][\w.\-:]{0,100})(?P<attrs>\s[^<>]{0,1000})?>(?P<value>[^<]*+)</(?P=tag)\s*>"
)
# Bearer abc, Basic abc anywhere in a text; Token abc1 only with a digit in it ("token expired" is prose).
_CREDENTIAL = re.compile(
    r"\b(?P<scheme>bearer|basic)(?P<gap>\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)"
    r"|\b(?P<tscheme>token)(?P<tgap>\s+)(?P<tvalue>(?=[A-Za-z._~+/=\-]*\d)[A-Za-z0-9._~+/=\-]+)",
    re.I,
)
_MAX_DEPTH = 50
# Some part of every secret name (SECRET_NAME, URL-encoded names included: %5F is an
# underscore, the words around it stay), and of every credential scheme: a text without any
# needs no name- or scheme-based pattern.
_NAMED = ("pass", "pwd", "secret", "token", "key", "auth", "cookie", "credential", "sig", "session", "jwt")
_SCHEMES = ("bearer", "basic", "token")


def _secret(name: str) -> bool:
    if "%" in name:
        name = unquote(name)  # api%5Fkey is api_key
    return bool(SECRET_NAME.search(name))


def _hidden(value: str) -> bool:
    return value.strip("\"' ").lower() not in NOT_SECRET


def secret_parts(secret: str) -> list[str]:
    """Return the forms of a secret an API may echo: itself, without its scheme, URL-encoded, Basic's password."""
    parts = [secret]
    scheme, gap, rest = secret.partition(" ")
    if gap and rest:
        parts.append(rest.strip())
        if scheme.lower() == "basic":
            try:
                decoded = base64.b64decode(rest.strip(), validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError, ValueError):
                decoded = ""
            parts += [decoded, decoded.partition(":")[2]]
    parts += [quote(p, safe="") for p in parts]
    return sorted({p for p in parts if len(p) >= MIN_KNOWN_SECRET}, key=len, reverse=True)


def known_secrets() -> list[str]:
    """Return the values of the secrets the http handler may send (DISPATCHER_HTTP_SECRETS), in every echoed form."""
    try:
        names = {entry.partition("@")[0].partition(":")[0].strip() for entry in dispatcher_settings.HTTP_SECRETS}
        values = [getattr(settings, name, None) or os.environ.get(name) for name in names if name]
    except Exception:  # settings not ready or unreadable: the patterns still apply
        return []
    return sorted({part for value in values if value for part in secret_parts(str(value))}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    """Return text with every occurrence of the given secret values replaced."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def _named(text: str, head: re.Pattern[str], value: re.Pattern[str], sep: str | None = None) -> str:
    """Replace the value after every secret name ``head`` finds (``name=``, ``name:``) with
    REDACTED (the name and ``sep``, else what separated them, kept). ``head`` consumes only the
    name and its separator: a value is read (``value`` at its start) for a secret name alone, and
    skipped once replaced, so whatever another name's value holds is scanned as any text.
    Linear: each head is matched once, and each character is in at most one value read."""
    out: list[str] = []
    done = at = 0
    while (m := head.search(text, at)) is not None:
        at = m.end()
        if not _secret(m["name"]):
            continue
        found = value.match(text, at)
        if found is None or not _hidden(found[0]):
            continue
        out += [text[done:m.start()], m["name"], m["eq"] if sep is None else sep, REDACTED]
        done = at = found.end()
    return "".join(out) + text[done:] if out else text


def _member(m: re.Match[str]) -> tuple[str, int] | None:
    """Return a secret member's replacement and where its value ends (None: leave it)."""
    if not _secret(m["name"]):
        return None
    q = m["q"]
    if m["dq"] is not None:
        return f'{q}{m["name"]}{q}: "{REDACTED}"', m.end("dq") + 1
    if m["sq"] is not None:
        return f"{q}{m['name']}{q}: '{REDACTED}'", m.end("sq") + 1
    return (f"{q}{m['name']}{q}: {REDACTED}", m.end("bare")) if _hidden(m["bare"]) else None


def _members(text: str) -> str:
    """Replace the value of every secret-named member. A member whose name is not secret consumes
    only its name, so what its value holds is scanned too: in ``':':'\n'password': 'x'`` the
    value of the member ``':'`` would otherwise take the quote that opens ``'password'``. A
    replaced quoted value's closing quote may open the next name. Linear: a value's look-ahead
    stops at its first quote, and a member inside it can only begin at an escaped quote and end
    at that one."""
    out: list[str] = []
    done = 0
    for m in _MEMBER.finditer(text):
        reuse = bool(out) and m.start() == done - 1 and text[m.start()] in "\"'"
        if m.start() < done and not reuse:
            continue
        found = _member(m)
        if found is None:
            continue
        new, end = found
        out += [text[done:m.start()], new[1:] if reuse else new]
        done = end
    return "".join(out) + text[done:] if out else text


def _header(m: re.Match[str]) -> str:
    return f"{m['lead']}{m['name']}: {REDACTED}" if _secret(m["name"]) and _hidden(m["value"]) else m[0]


def _element(m: re.Match[str]) -> str:
    if not _secret(m["tag"].rpartition(":")[2]) or not _hidden(m["value"]):
        return m[0]
    return f"<{m['tag']}{m['attrs'] or ''}>{REDACTED}</{m['tag']}>"


def _redact_text(text: str, secrets: list[str]) -> str:
    if not text:
        return text
    text = scrub(text, secrets)
    # Each pattern runs only when the text holds what every match of it must: most text skips
    # most of them, at the cost of a search in C.
    if "-----BEGIN " in text:
        text = _PEM.sub(lambda m: f"{m['begin']}{REDACTED}{m['end'] or ''}", text)
    if "://" in text and "@" in text:
        text = _USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    lowered = text.lower()
    # Credentials first: a name's value read up to a space would be the scheme alone
    # (``note: Authorization: Bearer x``), and the scheme replaced would hide the credential.
    if any(word in lowered for word in _SCHEMES):
        text = _CREDENTIAL.sub(lambda m: f"{m['scheme'] or m['tscheme']}{m['gap'] or m['tgap']}{REDACTED}", text)
    if any(word in lowered for word in _NAMED):
        if "=" in text:
            text = _named(text, _PAIR, _PAIR_VALUE)
        if ":" in text:
            if '"' in text or "'" in text:
                text = _members(text)
            text = _HEADER.sub(_header, text)
            text = _named(text, _INLINE_HEADER, _INLINE_VALUE, sep=": ")
        if "</" in text:
            text = _ELEMENT.sub(_element, text)
    return text


def redact_text(text: str) -> str:
    """Return free text with every secret-looking value replaced."""
    return _redact_text(text, known_secrets()) if text else text


def _redact(value: Any, secrets: list[str], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        return REDACTED
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and _secret(k) else _redact(v, secrets, depth + 1))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redact(v, secrets, depth + 1) for v in value]
    if isinstance(value, str):
        return REDACTED if SECRET_VALUE.match(value.strip()) else _redact_text(value, secrets)
    return value


def redact(value: Any, depth: int = 0) -> Any:
    """Return a copy of a JSON-like value with secret-looking entries replaced."""
    return _redact(value, known_secrets(), depth)


class RedactingFilter(logging.Filter):
    """Redact secrets from a log record's message and traceback before any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error path
            return True
        secrets = known_secrets()
        redacted = _redact_text(message, secrets)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = _redact_text(logging.Formatter().formatException(record.exc_info), secrets)
        return True
