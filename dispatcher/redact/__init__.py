"""Redaction of values that look like secrets, for the admin, the API, the logs and the metrics.

The one home for redaction. Two entry points:

- ``redact(value)``: a JSON-like value (params, results) with secret-named entries replaced,
  and every string in it passed through ``redact_text``;
- ``redact_text(text)``: free text (errors, tracebacks, log lines, URLs, form bodies, XML, Python
  reprs, YAML, INI) with the value of every secret-named ``name=value`` pair (also ``name = value``,
  ``name => value`` and URL-encoded names such as ``api%5Fkey``), ``name: value`` header line,
  ``"name": "value"`` or ``'name': 'value'`` member (also with ``=>`` or ``=``, and escaped inside
  another string: ``{\\"password\\": \\"x\\"}``, ``'{\\'token\\': \\'x\\'}'``, up to four levels
  deep) and ``<name>value</name>`` element replaced, and so are credentials in a URL's user-info,
  ``Bearer``/``Basic``/``Token`` credentials, PEM private key bodies and the value of every secret
  the http handler may send (``DISPATCHER_HTTP_SECRETS``), with or without its scheme.

A quoted value runs to its closing quote, escapes honoured (``password="a\\"b"`` hides ``a\\"b``),
triple-quoted strings across lines, with the strings Python joins to it (``'ab' 'cd'``, across lines
as pprint wraps them; a string followed by ``:`` or ``=`` is the next name); one never closed runs
to the text's end.

A secret is also found by what stands next to it:

- the lines of an INI or TOML section named secret (``[password]``, ``[auth]``), to the next
  section's header or the text's end (blank lines do not end a section);
- in an object with a ``name`` or ``key`` member (``ParameterKey``, ``Name``...) whose value is a
  secret name, every other member's value (``{"name": "password", "value": "x"}``,
  ``{'Key': 'token', 'Val': 'x'}``, in any order);
- in an element named secret, or whose ``name`` or ``key`` attribute names one, every other
  attribute's value but namespace declarations (``<password value="x"/>``,
  ``<add key="ApiKey" value="x"/>``).

A value that is a container is replaced whole, whatever it holds:

- an element's children, CDATA, comments and mixed text, to the close tag of the same name that
  pairs with its open tag (``<password><v>x</v></password>``, ``<ns:ApiKey><![CDATA[x]]></ns:ApiKey>``);
  one whose name no close tag has runs to the next tag if that closes another element (XML text
  holds no ``<``: ``<data><token>x</data>``), else to the text's end;
- after ``name=``, ``name:`` or a member's separator, an object, array or tuple to its matching
  bracket, quoted strings (and their escapes, at the member's escape level) skipped whole, also as a
  constructor's call or a prefixed string (``{"password": {"v": "x"}}``, ``password=['x']``,
  ``'auth': ('u', 'x')``, ``token=SecretStr('x')``, ``'password': b'x'``), across lines when the
  text does; after ``name:``, a quoted value to its closing quote too;
- after a ``name:`` line with no value (or a YAML ``|``/``>`` indicator, tag or anchor), the lines
  indented below it (``password:`` then ``  - x`` or ``  value: x``; YAML's ``- x`` at the name's
  own depth too).

A container never closed runs to the text's end: a cut-off text hides too much, never too little.
An empty one (``password=[]``, ``<password></password>``) says there is no secret and stays.

Named by a sibling too: an object's other members when its ``name`` or ``key`` member names a
secret (``{"name": "password", "value": "x"}``), an element's content and attributes when its
``name`` or ``key`` attribute does (``<setting name="ApiKey"><value>x</value></setting>``; HTML's
void elements such as ``<input name="password">`` hold nothing, so only their attributes), and the
other fields of a form run (``name=password&value=x``). Not covered: a sibling-named object escaped
inside another string, or one whose string a stray quote earlier on its own line swallows.

A name is secret when ``SECRET_NAME`` finds it (``password``, ``client_secret``, ``api_key``,
``X-Access-Key``, ``Ocp-Apim-Subscription-Key``, ``signature``, ``sig``, ``key``...). Redaction is
shown, never stored: the row keeps what the handler needs to run.

Every pattern here runs in time linear in its text (SPEC invariant 9): a name is matched only
from its first character (a look-behind refuses a start inside a run of name characters), runs
are bounded or possessive, and no two patterns scan the same text more than a fixed number of
times. A container's extent is found in one pass (brackets counted in a single scan that the
caller then skips; element tags paired in one pass over the tags), never searched for again from
each open; an escaped string's end is found in one pass over its runs of backslashes. The passes
that read what stands next to a secret (sections, attributes, siblings) each step once over their
text, and the sibling pass runs only if a member names a secret. ``bench/hostile.py`` measures 1 MB.
"""
from __future__ import annotations

import base64
import binascii
import logging
import os
import re
from typing import Any
from urllib.parse import quote

from django.conf import settings

from dispatcher.conf import dispatcher_settings
from dispatcher.redact.extents import replace_spans
from dispatcher.redact.markup import attribute_spans, elements, forms, named_element_spans, section_spans, sibling_spans
from dispatcher.redact.names import MIN_KNOWN_SECRET, NAMED, NOT_SECRET, REDACTED, SECRET_NAME, SECRET_VALUE, is_secret
from dispatcher.redact.pairs import INLINE_HEADER, INLINE_VALUE, MEMBER_EQ, PAIR, PAIR_VALUE, headers, members, named

__all__ = [
    "MIN_KNOWN_SECRET", "NOT_SECRET", "REDACTED", "SECRET_NAME", "SECRET_VALUE", "RedactingFilter", "known_secrets",
    "redact", "redact_text", "scrub", "secret_parts",
]

# -----BEGIN ... PRIVATE KEY----- ... -----END ... PRIVATE KEY----- (or the text's end).
_PEM = re.compile(
    r"(?P<begin>-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY-----)(?:(?!-----END )[\s\S])*+(?P<end>-----END [A-Z0-9 ]{0,40}PRIVATE KEY-----)?"
)
# scheme://user:password@host
_USERINFO = re.compile(
    r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,40}://)(?P<user>[^:/@\s]{0,200}):(?P<password>[^@/\s]++)@"
)
# Bearer abc, Basic abc anywhere in a text; Token abc1 only with a digit in it ("token expired" is prose).
_CREDENTIAL = re.compile(
    r"\b(?P<scheme>bearer|basic)(?P<gap>\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)"
    r"|\b(?P<tscheme>token)(?P<tgap>\s+)(?P<tvalue>(?=[A-Za-z._~+/=\-]*\d)[A-Za-z0-9._~+/=\-]+)",
    re.I,
)
_MAX_DEPTH = 50
_SCHEMES = ("bearer", "basic", "token")


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
    if any(word in lowered for word in NAMED):
        quoted = '"' in text or "'" in text
        if "[" in text:
            text = replace_spans(text, section_spans(text))
        if "<" in text and "=" in text:  # before ``key="token"`` is hidden as a pair
            text = replace_spans(text, attribute_spans(text) + named_element_spans(text))
        if quoted:  # before a member named ``key`` hides the name it gives its siblings
            text = replace_spans(text, sibling_spans(text))
        if "=" in text:
            if "&" in text:  # before a field named ``key`` hides the name it gives its siblings
                text = forms(text)
            text = named(text, PAIR, PAIR_VALUE)
        if quoted and (":" in text or MEMBER_EQ.search(text) is not None):
            text = members(text)
        if ":" in text:
            text = headers(text)
            text = named(text, INLINE_HEADER, INLINE_VALUE, sep=": ")
        if "<" in text:
            text = elements(text)
    return text


def redact_text(text: str) -> str:
    """Return free text with every secret-looking value replaced."""
    return _redact_text(text, known_secrets()) if text else text


def _redact(value: Any, secrets: list[str], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        return REDACTED
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret(k) else _redact(v, secrets, depth + 1))
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
