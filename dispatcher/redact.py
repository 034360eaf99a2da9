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

Not covered: a sibling-named object escaped inside another string, one whose string a stray quote
earlier on its line swallows, and form bodies (``name=password&value=x``); an element named by its
``name`` attribute keeps its content (``<setting name="ApiKey"><value>x</value></setting>``).

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
import functools
import itertools
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
# (``OrderedDict([...])``, ``SecretStr('x')``). It ends at the bracket, where ``_container_end``
# starts.
_OPENS = r"(?:[A-Za-z_][\w.]{0,100}+)?(?=[\[{(])"
# Where a value that is a quoted string opens (``_strings_end`` reads it): maybe prefixed
# (``b'x'``), maybe escaped inside another string, at one of the levels ``_LEVELS`` knows
# (``\"x\"``: JSON inside a JSON string; ``\'x\'``: a repr inside a repr).
_ESCAPES = r"(?:\\{15}|\\{7}|\\{3}|\\)?+"
_STRING_AHEAD = rf"(?=[bBrRuUfF]{{0,2}}+{_ESCAPES}[\"'])"
_STRING = re.compile(rf"(?P<prefix>[bBrRuUfF]{{0,2}}+)(?P<q>\"\"\"|'''|{_ESCAPES}[\"'])")
# The escape level of a quote with this many backslashes before it: each level escapes the one
# inside it once, so a string's quote at level n has 2**n - 1.
_LEVELS = {0: 0, 1: 1, 3: 2, 7: 3, 15: 4}
# A string's body after its opening quote, escapes honoured, to its closing quote or the text's end.
_BODY = {
    '"': re.compile(r'(?:[^"\\]++|\\[\s\S]?)*+"?'),
    "'": re.compile(r"(?:[^'\\]++|\\[\s\S]?)*+'?"),
    '"""': re.compile(r'(?:[^"\\]++|\\[\s\S]?|"(?!""))*+(?:"""|\Z)'),
    "'''": re.compile(r"(?:[^'\\]++|\\[\s\S]?|'(?!''))*+(?:'''|\Z)"),
}
# What an escaped string's scan steps on: a run of backslashes ending in a quote (whether it
# opens or closes a string depends on the run's length, ``_delimits``), and in a container a bracket.
_QUOTE_RUN = re.compile(r"(?<!\\)\\*+[\"']")
_ESCAPED_TOKEN = re.compile(r"[\[\]{}()]|(?<!\\)\\*+[\"']")
# What separates two strings Python joins (``'ab' 'cd'``; across lines as pprint wraps them).
_ADJACENT = re.compile(rf"\s*+{_STRING_AHEAD}")
# After a string: it is the next member's (or pair's) name, no part of the value before it.
_NAME_SEP = re.compile(r"[ \t]*+[:=]")
# What a container's scan steps on: a bracket, or a quoted string skipped whole (triple-quoted
# too; escapes honoured; one never closed runs to the text's end).
_CONTAINER_TOKEN = re.compile(
    r"[\[\]{}()]|\"\"\"(?:[^\"\\]++|\\[\s\S]?|\"(?!\"\"))*+(?:\"\"\"|\Z)|'''(?:[^'\\]++|\\[\s\S]?|'(?!''))*+(?:'''|\Z)"
    r"|\"(?:[^\"\\]++|\\[\s\S]?)*+\"?|'(?:[^'\\]++|\\[\s\S]?)*+'?"
)
# name=value (query strings, form bodies, prose ``password = x``, Ruby's and PHP's
# ``password => x``); the value ends at &, ;, #, a comma, whitespace or a quote, or is a quoted
# string (to its closing quote, escapes honoured, with the strings adjacent to it), or holds
# containers (``open``: each to its matching close).
# Only ``name=`` is consumed (``_named``): the value is read for a secret name alone, so the
# value of another name (``note="retry password=x"``, ``note=password=x``) is scanned too.
_PAIR = re.compile(rf"(?<![{_NAME_CHARS}])(?P<name>[{_NAME_CHARS}]{{1,200}})(?P<eq>[ \t]*+=>?[ \t]*+)")
_PAIR_VALUE = re.compile(rf"(?P<open>{_OPENS})|(?P<string>{_STRING_AHEAD})|(?P<bare>[^&;#\s'\",]++)")
# "name": "value", 'name': 'value' (JSON quoted in an error, a Python repr; escaped inside
# another string too: ``{\"password\": \"x\"}``), also with ``=>`` or ``=`` (PHP, Ruby, TOML):
# a string, a container or a bare value. What the value is, is seen in a look-ahead: a member
# reads its value only when it is replaced (``_members``), so a quote in another member's value
# may open the next name.
_PLAIN = r"\"(?:[^\"\\]++|\\[\s\S])*+\"|'(?:[^'\\]++|\\[\s\S])*+'"
_MEMBER = re.compile(
    rf"(?<!\\)(?P<q>{_ESCAPES}[\"'])(?P<name>[^\"'\\\n]{{1,100}})(?P=q)(?P<sep>[ \t]*+(?::|=>?)[ \t]*+)"
    # A plain string (most values) is read here, in one step, when no string follows it but the
    # next member's name (``_strings_end`` joins any other).
    rf"(?=(?P<plain>{_PLAIN})(?=\s*+(?:{_PLAIN})[ \t]*+[:=]|(?!\s*+[bBrRuUfF]{{0,2}}+\\*+[\"']))"
    rf"|(?P<string>{_STRING_AHEAD})|(?P<open>{_OPENS})|(?P<bare>[^\s,}}\]\"']++))"
)
# What a member with ``=`` or ``=>`` needs: a quote before it (the members pass runs only then).
_MEMBER_EQ = re.compile(r"[\"'][ \t]*+=")
# A member's value that holds containers, read from its start.
_MEMBER_VALUE = re.compile(rf"(?P<open>{_OPENS})|(?P<string>{_STRING_AHEAD})|(?P<bare>[^\s,}}\]\"']++)")
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
_HEADER_OPENS = re.compile(rf"(?P<open>{_OPENS})|(?P<string>{_STRING_AHEAD})")
# A line of such a block: its indentation, and whether it is a YAML item (``- x``) or blank.
_LINE = re.compile(r"\n(?P<indent>[ \t]*+)(?:(?P<item>-)(?=[ \t\r\n]|\Z)|(?P<blank>(?=\r?\n|\r?\Z)))?")
_INLINE_HEADER = re.compile(r"(?<![A-Za-z0-9_%\-])(?P<name>[A-Za-z0-9_%\-]{1,100})(?P<eq>:[ \t]*+)")
_INLINE_VALUE = re.compile(rf"(?P<open>{_OPENS})|(?P<string>{_STRING_AHEAD})|(?P<bare>[^\s'\",;]++)")
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
# A name whose value names the secret its siblings hold: ``{"name": "password", "value": "x"}``,
# ``<add key="ApiKey" value="x"/>``, ``{"Key": ..., "Value": ...}``, ``ParameterKey``.
_NAMING_WORD = r"(?i:(?:param(?:eter)?|attribute|field|setting|var(?:iable)?)?[-_]?(?:name|key))"
_NAMING = re.compile(_NAMING_WORD)
# A tag with attributes, whose name or attributes hold a part of a secret name (the look-ahead
# stops at the next ``<`` or ``>``, so each character is looked at from one ``<`` only), and its
# attributes, a value quoted (to its closing quote, or the text's end) or bare.
_ATTRIBUTE = r"""\s*+(?P<name>[^\s=<>"'/]{1,100}+)(?:\s*+=\s*+(?P<value>"[^"]*+"?|'[^']*+'?|[^\s"'<>]++))?"""
_ATTRIBUTED_TAG = re.compile(
    rf"<(?=[^<>]*?(?i:{'|'.join(_NAMED)}))(?P<tag>[A-Za-z_][\w.\-:]{{0,100}}+)(?P<attributes>\s(?:{_ATTRIBUTE.replace('?P<name>', '').replace('?P<value>', '')})++)"
)
_ATTRIBUTE_RE = re.compile(_ATTRIBUTE)
# An attribute that names its element's secret (``key="ApiKey"``), and the name it gives.
_NAMING_ATTRIBUTE = re.compile(
    rf"""(?<![^\s])(?:[\w.\-]{{1,50}}:)?{_NAMING_WORD}"""
    r"""\s*+=\s*+(?:"(?P<dq>[^"<>]{1,100})"|'(?P<sq>[^'<>]{1,100})'|(?P<bare>[^\s"'<>]{1,100}))"""
)
# What the sibling pass steps on: a bracket, or a string skipped whole, a member's name when a
# separator follows it. A string ends at its line's end at the latest, and an apostrophe in a
# word (``it's``) opens none, so a stray quote in prose hides no object on another line from it.
_OBJECT_TOKEN = re.compile(
    r"[\[\]{}()]|(?P<string>\"(?:[^\"\\\n]++|\\[^\n]?)*+\"?|(?<![A-Za-z0-9])'(?:[^'\\\n]++|\\[^\n]?)*+'?)"
    r"(?P<sep>[ \t]*+(?::|=>?)[ \t]*+)?"
)
# A member whose string value may name a secret (the sibling pass runs only if one does).
_NAMING_MEMBER = re.compile(
    rf"([\"']){_NAMING_WORD}\1[ \t]*+(?::|=>?)[ \t]*+([\"'])(?P<named>[^\"'\\\n]{{1,100}})\2"
)
# An INI or TOML section's header line (``[password]``, ``[[servers.auth]]``), maybe with a
# comment; a line's start is found as the ``\n`` before it (a literal the engine searches fast).
_SECTION = r"[ \t]*+\[{1,2}+(?P<section>[^\[\]\r\n]{1,200}+)\]{1,2}+[ \t]*+(?:[#;][^\r\n]*+)?\r?(?=\n|\Z)"
_FIRST_SECTION = re.compile(_SECTION)
_SECTION_LINE = re.compile(rf"\n{_SECTION}")


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


def _delimits(run: str, level: int) -> bool:
    """Say whether a run of backslashes and the quote after it opens or closes a string escaped
    ``level`` times: a quote escaped once more than that is the string's content, a backslash
    escaped is a backslash (at level 1: ``\\"`` closes, ``\\\\\\"`` is a quote inside it)."""
    return (len(run) - 1) % (2 << level) == (1 << level) - 1


def _string_end(text: str, opened: re.Match[str]) -> int:
    """Return where the quoted string ``opened`` opens (maybe prefixed, triple-quoted or escaped)
    ends: after its closing quote, escapes honoured, or at the text's end if it is never closed.
    Linear: one pass over what its caller then skips as replaced."""
    q = opened["q"]
    if q in _BODY:
        found = _BODY[q].match(text, opened.end())
        return found.end() if found is not None else len(text)
    level = _LEVELS[len(q) - 1]
    return next((run.end() for run in _QUOTE_RUN.finditer(text, opened.end())
                 if run.group()[-1] == q[-1] and _delimits(run.group(), level)), len(text))


def _strings_end(text: str, at: int) -> int:
    """Return where the quoted string at ``at`` ends, with the strings of its escape level
    adjacent to it that Python joins to it (``'ab' 'cd'``, across lines as pprint wraps them); a
    string followed by ``:`` or ``=`` is the next name, no part of this value."""
    first = _STRING.match(text, at)
    if first is None:
        return at
    end = _string_end(text, first)
    while (gap := _ADJACENT.match(text, end)) is not None:
        part = _STRING.match(text, gap.end())
        if part is None or part["q"].count("\\") != first["q"].count("\\"):
            break  # a quote of another escape level: another string's
        after = _string_end(text, part)
        if _NAME_SEP.match(text, after):
            break
        end = after
    return end


def _container_end(text: str, at: int, level: int = 0) -> int:
    """Return where the container (or quoted string) opening at ``at`` ends: after its matching
    close, brackets counted and quoted strings skipped whole with their escapes, so a bracket or
    quote inside a string closes nothing; in a text escaped ``level`` times, its strings are
    those ``_delimits`` says. A container never closed ends at the text's end: a cut-off text
    hides too much, never too little. Linear: one pass over what its caller then skips as
    replaced."""
    if level:
        return _escaped_container_end(text, at, level)
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


def _escaped_container_end(text: str, at: int, level: int) -> int:
    """Return where a container escaped ``level`` times (``{\\"v\\": \\"x}\\"}``) ends, as
    ``_container_end`` does: a bracket counts outside its strings only."""
    depth = 0
    quote = ""  # the quote of the string the scan is in
    for token in _ESCAPED_TOKEN.finditer(text, at):
        run = token.group()
        if run[-1] in "\"'":
            if (not quote or run[-1] == quote) and _delimits(run, level):
                quote = "" if quote else run[-1]
            continue
        if quote:
            continue
        depth += 1 if run in "[{(" else -1
        if depth <= 0:
            return token.end()
    return len(text)


def _value_end(text: str, at: int, value: re.Pattern[str], level: int = 0) -> int | None:
    """Return where a secret name's value starting at ``at`` ends (None: nothing to hide): what
    ``value`` reads, a string with the strings adjacent to it, a container to its close, and
    what follows either directly (another, a bare run: ``SecretStr('x')[0]``), so no part of the
    value is left next to the REDACTED."""
    found = value.match(text, at)
    if found is None:
        return None
    end = found.end()
    while found is not None and found["bare"] is None:
        string = found["string"] is not None
        end = _strings_end(text, end) if string else _container_end(text, end, level)
        found = value.match(text, end)
        if string and found is not None and found["string"] is not None:
            break  # a quote right after a string's, of another escape level (an outer string's close)
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
    """Return a secret member's replacement and where its value ends (None: leave it): a string
    stays quoted as it was (``"password": "********"``), anything else is replaced bare."""
    if not _secret(m["name"]):
        return None
    text, q, plain = m.string, m["q"], m["plain"]
    if plain is not None:
        return f"{q}{m['name']}{q}{m['sep']}{plain[0]}{REDACTED}{plain[0]}", m.end("plain")
    head = f"{q}{m['name']}{q}{m['sep']}"
    if m["bare"] is not None:
        return (f"{head}{REDACTED}", m.end("bare")) if _hidden(m["bare"]) else None
    string = _STRING.match(text, m.end())
    if string is not None and not string["prefix"]:
        # Kept quoted, so what follows its closing quote (maybe the next name) is read as text.
        last = _strings_end(text, m.end())
        return (f"{head}{string['q']}{REDACTED}{string['q']}", last) if _hidden(text[m.end():last]) else None
    end = _value_end(text, m.end(), _MEMBER_VALUE, _LEVELS[len(q) - 1])
    return None if end is None else (f"{head}{REDACTED}", end)


def _members(text: str) -> str:
    """Replace the value of every secret-named member. A member whose name is not secret consumes
    only its name, so what its value holds is scanned too: in ``':':'\n'password': 'x'`` the
    value of the member ``':'`` would otherwise take the quote that opens ``'password'``. A
    replaced string's closing quote may open the next name; a replaced value is skipped whole.
    Linear: a value is read only after a secret name, and once."""
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
        at = end - 1 if new[-1] == text[end - 1] in "\"'" else end
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
    # As a value on one line, it runs on to the end of the line its container or string closes on.
    close = _container_end(text, opens.end()) if opens["open"] is not None else _strings_end(text, opens.end())
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


def _section_spans(text: str) -> list[tuple[int, int]]:
    """Return the body of every secret-named INI or TOML section (``[password]``, ``[auth]``):
    its lines to the next section's header, or to the text's end (blank lines do not end a
    section); blank lines before the next header are left out. Linear: the headers are found in
    one pass."""
    spans: list[tuple[int, int]] = []
    body = -1  # where the body of the secret section just read starts (-1: none)
    first = _FIRST_SECTION.match(text)
    for header in itertools.chain([first] if first else [], _SECTION_LINE.finditer(text)):
        start = header.start() + (header is not first)
        if body >= 0 and text[body:start].strip():
            spans.append((body, start))
        body = header.end() + 1 if header.end() < len(text) and _secret(header["section"].strip()) else -1
    if body >= 0:
        spans.append((body, len(text)))
    return [(start, start + len(text[start:end].rstrip())) for start, end in spans]


def _attribute_spans(text: str) -> list[tuple[int, int]]:
    """Return the attribute values of every element that is a secret's: its name is secret
    (``<password value="x"/>``) or its name or key attribute names one (``<add key="ApiKey"
    value="x"/>``). Every attribute but the naming ones and namespace declarations is the
    secret's. Linear: a tag's attributes are read in one match, and again only if it is a
    secret's; a quoted value spans at most one other tag's values (of the other quote), so no
    character is read more than a few times."""
    spans: list[tuple[int, int]] = []
    for tag in _ATTRIBUTED_TAG.finditer(text):
        start, end = tag.span("attributes")
        if not _secret(tag["tag"].rpartition(":")[2]) and not any(
            _secret(named["dq"] or named["sq"] or named["bare"]) for named in _NAMING_ATTRIBUTE.finditer(text, start, end)
        ):
            continue
        spans += [
            (first + 1, last - (last - first > 1 and text[last - 1] == text[first])) if text[first] in "\"'" else (first, last)
            for first, last in (a.span("value") for a in _ATTRIBUTE_RE.finditer(text, start, end) if a["value"] is not None
                                and not _kept_attribute(a["name"]))
        ]  # a quoted value: what it holds, its quotes kept
    return spans


@functools.lru_cache(maxsize=256)
def _kept_attribute(name: str) -> bool:
    """Say whether a secret element's attribute is no part of its secret: the one naming it, a
    namespace declaration."""
    return name == "xmlns" or name.startswith("xmlns:") or bool(_NAMING.fullmatch(name.rpartition(":")[2]))


class _Object:
    """What the sibling pass knows of a container it is in: whether a member names its secret,
    the values of its other members, where the member's value it is starts (-1: none) and where
    the member just read has its container value open."""

    __slots__ = ("named", "values", "owner", "opens")

    def __init__(self, owner: int) -> None:
        self.named = False
        self.values: list[tuple[int, int]] = []
        self.owner = owner
        self.opens = (-1, -1)  # the value's start, its bracket


def _sibling_spans(text: str) -> list[tuple[int, int]]:
    """Return the member values of every object a sibling names the secret of: a ``name`` or
    ``key`` member (``_NAMING``) whose value is a secret name (``{"name": "password", "value":
    "x"}``, ``{'Key': 'token', 'Value': 'x'}``, in any order): every other member's value in that
    object, a container whole. Linear: runs only when such a member is found, then steps on each
    bracket and string once; a member's value that is a string or bare is read once and skipped."""
    lowered = text.lower()
    if ("name" not in lowered and "key" not in lowered) or not any(
        _secret(m["named"]) for m in _NAMING_MEMBER.finditer(text)
    ):
        return []
    spans: list[tuple[int, int]] = []
    objects = [_Object(-1)]
    at = 0
    while (token := _OBJECT_TOKEN.search(text, at)) is not None:
        at = token.end()
        current = objects[-1]
        kind = text[token.start()]
        if token["sep"] is not None:  # a member's name
            value = _MEMBER_VALUE.match(text, at)
            if value is None:
                continue
            if value["open"] is not None:
                current.opens = (at, value.end())
                continue
            end = value.end() if value["bare"] is not None else _strings_end(text, at)
            name = token["string"].strip("\"'")
            if value["string"] is not None and _NAMING.fullmatch(name) and _secret(text[at:end][:102].strip("\"'")):
                current.named = True
            elif value["string"] is not None and end - at >= 2 and text[end - 1] == text[at] and not text[at].isalpha():
                current.values.append((at + 1, end - 1))  # a string: what it holds, its quotes kept
            else:
                current.values.append((at, end))
            at = end
        elif kind in "[{(":
            owner = current.opens[0] if current.opens[1] == token.start() else -1
            current.opens = (-1, -1)
            objects.append(_Object(owner))
        elif kind in "]})" and len(objects) > 1:
            objects.pop()
            if current.named:
                spans += current.values
            if current.owner >= 0:
                objects[-1].values.append((current.owner, token.end()))
    # Containers never closed run to the text's end.
    for inner, outer in zip(objects[:0:-1], objects[-2::-1], strict=True):
        if inner.named:
            spans += inner.values
        if inner.owner >= 0:
            outer.values.append((inner.owner, len(text)))
    return spans + objects[0].values if objects[0].named else spans


def _replace_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Replace each span of text with REDACTED, those that overlap or touch as one, and those
    that say there is no secret (empty, ``None``) left as they are."""
    out: list[str] = []
    done = first = last = 0
    for start, end in [*sorted(spans), (len(text) + 1, 0)]:
        if start <= last and last > first:  # overlaps or touches the span before it
            last = max(last, end)
            continue
        if last > first and _hidden(text[first:last].strip()):
            out += [text[done:first], REDACTED]
            done = last
        first, last = start, end
    return "".join(out) + text[done:] if out else text


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
    name no close tag has runs to the next tag if that is a close tag, else to the end (the pass
    stops there). Empty contents are left out."""
    spans: list[tuple[int, int]] = []
    opened: dict[tuple[int, str], list[int]] = {}
    closed = set(_CLOSE_TAG.findall(text))
    for scope, tag in _tags(text):
        close, name, empty = tag.group("close", "tag", "empty")
        if empty or not _secret(name.rpartition(":")[2]):
            continue
        if not close:
            if name not in closed:
                # Never closed: XML text holds no ``<``, so if the next tag closes another
                # element, the text ends there; if it opens a child, a CDATA section or a
                # comment, or no tag follows, it runs to the end and the pass stops.
                following = text.find("<", tag.end())
                if scope == 0 and text.startswith("</", following):
                    if following > tag.end():
                        spans.append((tag.end(), following))
                    continue
                opened.setdefault((scope, name), []).append(tag.end())
                break
            opened.setdefault((scope, name), []).append(tag.end())
        elif (starts := opened.get((scope, name))) and (start := starts.pop()) < tag.start():
            spans.append((start, tag.start()))
    # Each element never closed runs to the end: the first holds all the others.
    unclosed = [starts[0] for starts in opened.values() if starts]
    return spans + [(min(unclosed), len(text))] if unclosed else spans


def _elements(text: str) -> str:
    """Replace the content of every secret-named element, whatever it holds (children, CDATA,
    comments, mixed text); contents that overlap or touch, as nested or malformed markup makes
    them, are replaced as one."""
    return _replace_spans(text, _element_spans(text))


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
        quoted = '"' in text or "'" in text
        if "[" in text:
            text = _replace_spans(text, _section_spans(text))
        if "<" in text and "=" in text:
            text = _replace_spans(text, _attribute_spans(text))
        if quoted:  # before a member named ``key`` hides the name it gives its siblings
            text = _replace_spans(text, _sibling_spans(text))
        if "=" in text:
            text = _named(text, _PAIR, _PAIR_VALUE)
        if quoted and (":" in text or _MEMBER_EQ.search(text) is not None):
            text = _members(text)
        if ":" in text:
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
