"""Redaction of values that look like secrets, for the admin, the API, the logs and the metrics.

The one home for redaction. Two entry points:

- ``redact(value)``: a JSON-like value (params, results) with secret-named entries replaced,
  and every string in it passed through ``redact_text``;
- ``redact_text(text)``: free text (errors, tracebacks, log lines, URLs, form bodies, XML, Python
  reprs, YAML) with the value of every secret-named ``name=value`` pair (also ``name = value`` and
  URL-encoded names such as ``api%5Fkey``), ``name: value`` header line, ``"name": "value"`` or
  ``'name': 'value'`` member and ``<name>value</name>`` element replaced, and so are credentials
  in a URL's user-info, ``Bearer``/``Basic``/``Token`` credentials, PEM private key bodies and the
  value of every secret the http handler may send (``DISPATCHER_HTTP_SECRETS``), with or without
  its scheme.

A value that is a container is replaced whole, whatever it holds:

- an element's children, CDATA, comments and mixed text, to the close tag of the same name that
  pairs with its open tag (``<password><v>x</v></password>``, ``<ns:ApiKey><![CDATA[x]]></ns:ApiKey>``);
- after ``name=``, ``name:`` or a member's ``:``, an object, array or tuple to its matching bracket,
  quoted strings (and their escapes) skipped whole, also as a constructor's call or a prefixed
  string (``{"password": {"v": "x"}}``, ``password=['x']``, ``'auth': ('u', 'x')``,
  ``token=SecretStr('x')``, ``'password': b'x'``), across lines when the text does; after
  ``name:``, a quoted value to its closing quote too;
- after a ``name:`` line with no value (or a YAML ``|``/``>`` indicator, tag or anchor), the lines
  indented below it (``password:`` then ``  - x`` or ``  value: x``; YAML's ``- x`` at the name's
  own depth too).

A container never closed runs to the text's end: a cut-off text hides too much, never too little.
An empty one (``password=[]``, ``<password></password>``) says there is no secret and stays.

A name is secret when ``SECRET_NAME`` finds it (``password``, ``client_secret``, ``api_key``,
``X-Access-Key``, ``Ocp-Apim-Subscription-Key``, ``signature``, ``sig``, ``key``...). Redaction is
shown, never stored: the row keeps what the handler needs to run.

Every pattern here runs in time linear in its text (SPEC invariant 9): a name is matched only
from its first character (a look-behind refuses a start inside a run of name characters), runs
are bounded or possessive, and no two patterns scan the same text more than a fixed number of
times. A container's extent is found in one pass (brackets counted in a single scan that the
caller then skips; element tags paired in one pass over the tags), never searched for again from
each open. ``bench/hostile.py`` measures 1 MB.
"""
from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
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
NOT_SECRET = frozenset({"", "none", "null", "nil", "undefined", "true", "false", "-", "[]", "{}", "()", REDACTED.lower()})
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
# Where a value that is a container opens: a bracket, maybe after a constructor's name
# (``OrderedDict([...])``, ``SecretStr('x')``), or a prefixed string (``b'x'``). It ends at the
# bracket or quote, where ``_container_end`` starts.
_OPENS = r"(?:[A-Za-z_][\w.]{0,100}+)?(?=[\[{(])|[bBrRuUfF]{1,2}+(?=[\"'])"
# What a container's scan steps on: a bracket, or a quoted string skipped whole (escapes
# honoured; one never closed runs to the text's end).
_CONTAINER_TOKEN = re.compile(r"[\[\]{}()]|\"(?:[^\"\\]++|\\[\s\S]?)*+\"?|'(?:[^'\\]++|\\[\s\S]?)*+'?")
# name=value (query strings, form bodies, prose ``password = x``); the value ends at &, ;, #,
# a comma, whitespace or a quote, or is quoted itself (to its closing quote, or the line's end),
# or holds containers (``open``: each to its matching close).
# Only ``name=`` is consumed (``_named``): the value is read for a secret name alone, so the
# value of another name (``note="retry password=x"``, ``note=password=x``) is scanned too.
_PAIR = re.compile(rf"(?<![{_NAME_CHARS}])(?P<name>[{_NAME_CHARS}]{{1,200}})(?P<eq>[ \t]*+=[ \t]*+)")
_PAIR_VALUE = re.compile(rf"(?P<open>{_OPENS})|\"[^\"\n]*+\"?|'[^'\n]*+'?|(?P<bare>[^&;#\s'\",]++)")
# "name": "value", 'name': 'value' (JSON quoted in an error, a Python repr), a container or a
# bare value. The value is matched in a look-ahead: a member consumes its value only when it is
# replaced (``_members``), so a quote in another member's value may open the next name.
_MEMBER = re.compile(
    r"(?P<q>[\"'])(?P<name>[^\"'\\\n]{1,100})(?P=q)[ \t]*:[ \t]*"
    r"(?=\"(?P<dq>(?:[^\"\\]++|\\.)*+)\"|'(?P<sq>(?:[^'\\]++|\\.)*+)'"
    rf"|(?P<open>{_OPENS})|(?P<bare>[^\s,}}\]\"']++))"
)
# A member's value that holds containers, read from its start.
_MEMBER_VALUE = re.compile(rf"(?P<open>{_OPENS})|(?P<bare>[^\s,}}\]\"']++)")
# Name: value on a header line (the rest of the line, or further when a container or a quoted
# string opens it; a YAML key, maybe quoted or a list item's, whose value may be the block below
# it), or inside a sentence (up to a space or quote, or a container or quoted string whole).
_HEADER = re.compile(
    r"(?m)^(?P<lead>[ \t]*+(?:-[ \t]++)?)(?P<q>[\"']?)(?P<name>[A-Za-z0-9_%\-]{1,100})(?P=q):[ \t]*+(?P<value>[^\r\n]*)"
)
# A header's value that leaves the value to the lines below: a comment, a YAML block indicator,
# maybe after a YAML tag or anchor (``!!binary |``, ``&db``); or none.
_BLOCK_OPENER = re.compile(r"(?:[!&][^ \t]*+[ \t]*+){0,2}(?:[|>][0-9+\-]{0,2}+)?[ \t]*+(?:#.*)?")
# A header's value that may run on past its line: a container, or a quoted string.
_HEADER_OPENS = re.compile(rf"{_OPENS}|(?=[\"'])")
# A line of such a block: its indentation, and whether it is a YAML item (``- x``) or blank.
_LINE = re.compile(r"\n(?P<indent>[ \t]*+)(?:(?P<item>-)(?=[ \t\r\n]|\Z)|(?P<blank>(?=\r?\n|\r?\Z)))?")
_INLINE_HEADER = re.compile(r"(?<![A-Za-z0-9_%\-])(?P<name>[A-Za-z0-9_%\-]{1,100})(?P<eq>:[ \t]*+)")
_INLINE_VALUE = re.compile(rf"(?P<open>{_OPENS}|(?=[\"']))|(?P<bare>[^\s'\",;]++)")
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
# An element's tag, or the start of a CDATA section or a comment (what the element pass steps
# on). Only tags whose name holds a part of a secret name match, so the regex engine, not
# Python, skips every other tag; an attribute's quoted value is skipped whole, so a ``>`` or
# ``/>`` in it ends nothing.
_TAG = re.compile(
    r"<(?P<opaque>!\[CDATA\[|!--)"
    rf"|<(?P<close>/?)(?=[\w.\-:]{{0,100}}?(?i:{'|'.join(_NAMED)}))"
    r"(?P<tag>[A-Za-z_][\w.\-:]{0,100}+)(?:\s(?:[^<>\"'/]++|/(?!>)|\"[^\"<]*+\"|'[^'<]*+')*+)?(?P<empty>/?)>"
)
# The name of every close tag ``_TAG`` may pair (whose name holds a part of a secret name).
_CLOSE_TAG = re.compile(rf"</(?=[\w.\-:]{{0,100}}?(?i:{'|'.join(_NAMED)}))([A-Za-z_][\w.\-:]{{0,100}}+)")
# What ends a CDATA section, a comment.
_OPAQUE_END = {"![CDATA[": "]]>", "!--": "-->"}


@functools.lru_cache(maxsize=1024)  # text repeats its names: a tag, a header per line
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


def _container_end(text: str, at: int) -> int:
    """Return where the container (or quoted string) opening at ``at`` ends: after its matching
    close, brackets counted and quoted strings skipped whole with their escapes, so a bracket or
    quote inside a string closes nothing. A container never closed ends at the text's end: a
    cut-off text hides too much, never too little. Linear: one pass over what its caller then
    skips as replaced."""
    depth = 0
    for token in _CONTAINER_TOKEN.finditer(text, at):
        kind = text[token.start()]
        if kind in "[{(":
            depth += 1
        elif kind in "]})":
            depth -= 1
        if depth <= 0:
            return token.end()
    return len(text)


def _value_end(text: str, at: int, value: re.Pattern[str]) -> int | None:
    """Return where a secret name's value starting at ``at`` ends (None: nothing to hide): what
    ``value`` reads, a container to its close, and what follows a container directly (another,
    a bare run: ``SecretStr('x')[0]``), so no part of the value is left next to the REDACTED."""
    found = value.match(text, at)
    if found is None:
        return None
    end = found.end()
    while found is not None and found["open"] is not None:
        end = _container_end(text, found.end())
        found = value.match(text, end)
        if found is not None and found["bare"] is not None:
            end = found.end()
    return end if _hidden(text[at:end]) else None


def _named(text: str, head: re.Pattern[str], value: re.Pattern[str], sep: str | None = None) -> str:
    """Replace the value after every secret name ``head`` finds (``name=``, ``name:``) with
    REDACTED (the name and ``sep``, else what separated them, kept); a container is replaced
    whole. ``head`` consumes only the name and its separator: a value is read (``value`` at its
    start) for a secret name alone, and skipped once replaced, so whatever another name's value
    holds is scanned as any text. Linear: each head is matched once, and each character is in at
    most one value read."""

    def replaced(m: re.Match[str]) -> tuple[str, int] | None:
        if not _secret(m["name"]) or (end := _value_end(text, m.end(), value)) is None:
            return None
        return f"{m['name']}{m['eq'] if sep is None else sep}{REDACTED}", end

    return _replace_values(text, head, replaced)


def _replace_values(text: str, head: re.Pattern[str], replaced: Callable[[re.Match[str]], tuple[str, int] | None]) -> str:
    """Replace, from each match of ``head`` on, what ``replaced`` says (its text, and where the
    value it replaces ends; None: leave it), the search going on after the replaced value."""
    out: list[str] = []
    done = at = 0
    while (m := head.search(text, at)) is not None:
        at = m.end()
        if (found := replaced(m)) is None:
            continue
        new, end = found
        out += [text[done:m.start()], new]
        done = at = end
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
    if m["open"] is not None:
        end = _value_end(m.string, m.start("open"), _MEMBER_VALUE)
        return None if end is None else (f"{q}{m['name']}{q}: {REDACTED}", end)
    return (f"{q}{m['name']}{q}: {REDACTED}", m.end("bare")) if _hidden(m["bare"]) else None


def _members(text: str) -> str:
    """Replace the value of every secret-named member. A member whose name is not secret consumes
    only its name, so what its value holds is scanned too: in ``':':'\n'password': 'x'`` the
    value of the member ``':'`` would otherwise take the quote that opens ``'password'``. A
    replaced quoted value's closing quote may open the next name; a replaced container is skipped
    whole. Linear: a value's look-ahead stops at its first quote, a member inside it can only
    begin at an escaped quote and end at that one, and a container is scanned once."""
    out: list[str] = []
    done = at = 0
    while (m := _MEMBER.search(text, at)) is not None:
        at = m.end()
        found = _member(m)
        if found is None:
            continue
        new, end = found
        reuse = bool(out) and m.start() == done - 1
        out += [text[done:m.start()], new[1:] if reuse else new]
        done = end
        at = end - 1 if m["dq"] is not None or m["sq"] is not None else end
    return "".join(out) + text[done:] if out else text


def _block_end(text: str, at: int, column: int) -> int:
    """Return where the block below a ``name:`` line ends (``at``: that line's end): the lines
    indented deeper than the name, and YAML's ``- x`` items at its depth; blank lines within it,
    not after it. Linear: each line is looked at once, its content skipped by the regex engine."""
    below = text.find("\n", at) + 1
    first = text[below:below + 1] if below else ""
    if first not in (" ", "\t", "\r", "\n") and (column or first != "-"):
        return at  # the next line starts at the margin, and is no item of a name there: no block
    end = at
    inside = False  # the line before is the block's: it ends where this one starts
    for line in _LINE.finditer(text, at):
        if inside:
            end = line.start() - (text[line.start() - 1] == "\r")
        depth = len(line["indent"])
        inside = line["blank"] is None and (depth > column or (depth == column and line["item"] is not None))
        if not inside and line["blank"] is None:
            return end
    return len(text) - text.endswith("\r") if inside else end


def _header_end(text: str, m: re.Match[str]) -> int | None:
    """Return where a secret header's value ends (None: leave it): the block below it when its
    line holds none, a container's extent when it opens one, else the line's end."""
    if not _secret(m["name"]):
        return None
    value = m["value"]
    if not value or (value[0] in "|>#!&" and _BLOCK_OPENER.fullmatch(value)):
        end = _block_end(text, m.end(), len(m["lead"]))
        return end if _hidden(text[m.start("value"):end].strip()) else None
    if m["q"]:  # "name": value on a line is a member's (``_members``)
        return None
    if not _hidden(value):
        return None
    opens = _HEADER_OPENS.match(text, m.start("value"))
    if opens is None:
        return m.end()
    # As a value on one line, it runs on to the end of the line its container closes on.
    close = _container_end(text, opens.end())
    line_end = text.find("\n", close)
    return len(text) if line_end < 0 else line_end - (text[line_end - 1] == "\r")


def _headers(text: str) -> str:
    """Replace the value of every secret-named header line: the rest of the line, and the lines a
    container or a YAML block below it runs on to. Linear: each line is matched once, and a
    replaced block is skipped."""

    def replaced(m: re.Match[str]) -> tuple[str, int] | None:
        end = _header_end(text, m)
        return None if end is None else (f"{m['lead']}{m['q']}{m['name']}{m['q']}: {REDACTED}", end)

    return _replace_values(text, _HEADER, replaced)


def _tags(text: str) -> Iterator[tuple[int, re.Match[str]]]:
    """Yield every tag ``_TAG`` finds with its scope: 0, or the number of the CDATA section or
    comment it is in (inside one, another's start is text). Linear: each section's end is
    searched for once, and the tags are found in one pass."""
    at = scopes = 0
    while True:
        for m in _TAG.finditer(text, at):
            if m["opaque"]:
                break
            yield 0, m
        else:
            return
        scopes += 1
        close = _OPAQUE_END[m["opaque"]]
        stop = text.find(close, m.end())
        stop = len(text) if stop < 0 else stop
        yield from ((scopes, tag) for tag in _TAG.finditer(text, m.end(), stop) if not tag["opaque"])
        at = stop + len(close)


def _element_spans(text: str) -> list[tuple[int, int]]:
    """Return the content (start, end) of every secret-named element: from its open tag to the
    close tag of the same name that pairs with it as nesting pairs them, or to the text's end if
    none does. A CDATA section or a comment is a scope of its own (its tags pair only with each
    other), so ``<password><![CDATA[</password>x]]></password>`` hides ``x``. An open tag whose
    name no close tag has runs to the end: the pass stops there. Empty contents are left out."""
    spans: list[tuple[int, int]] = []
    opened: dict[tuple[int, str], list[int]] = {}
    closed = set(_CLOSE_TAG.findall(text))
    for scope, tag in _tags(text):
        close, name, empty = tag.group("close", "tag", "empty")
        if empty or not _secret(name.rpartition(":")[2]):
            continue
        if not close:
            opened.setdefault((scope, name), []).append(tag.end())
            if name not in closed:
                break
        elif (starts := opened.get((scope, name))) and (start := starts.pop()) < tag.start():
            spans.append((start, tag.start()))
    # Each element never closed runs to the end: the first holds all the others.
    unclosed = [starts[0] for starts in opened.values() if starts]
    return spans + [(min(unclosed), len(text))] if unclosed else spans


def _elements(text: str) -> str:
    """Replace the content of every secret-named element, whatever it holds (children, CDATA,
    comments, mixed text); contents that overlap or touch, as nested or malformed markup makes
    them, are replaced as one."""
    merged: list[list[int]] = []
    for start, end in sorted(_element_spans(text)):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[str] = []
    done = 0
    for start, end in merged:
        if _hidden(text[start:end].strip()):
            out += [text[done:start], REDACTED]
            done = end
    return "".join(out) + text[done:] if out else text


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
            text = _headers(text)
            text = _named(text, _INLINE_HEADER, _INLINE_VALUE, sep=": ")
        if "<" in text:
            text = _elements(text)
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
