"""The passes that hide a value after its secret name: ``name=value``, ``"name": value`` members,
``name: value`` header lines and YAML blocks (``dispatcher.redact``)."""
from __future__ import annotations

import re

from dispatcher.redact.extents import (
    ESCAPES,
    LEVELS,
    OPENS,
    STRING,
    STRING_AHEAD,
    block_end,
    container_end,
    replace_values,
    strings_end,
    value_end,
)
from dispatcher.redact.names import NAME_CHARS, REDACTED, hidden, is_secret

# name=value (query strings, form bodies, prose ``password = x``, Ruby's and PHP's
# ``password => x``); the value ends at &, ;, #, a comma, whitespace or a quote, or is a quoted
# string (to its closing quote, escapes honoured, with the strings adjacent to it), or holds
# containers (``open``: each to its matching close).
# Only ``name=`` is consumed (``named``): the value is read for a secret name alone, so the
# value of another name (``note="retry password=x"``, ``note=password=x``) is scanned too.
PAIR = re.compile(rf"(?<![{NAME_CHARS}])(?P<name>[{NAME_CHARS}]{{1,200}})(?P<eq>[ \t]*+=>?[ \t]*+)")
PAIR_VALUE = re.compile(rf"(?P<open>{OPENS})|(?P<string>{STRING_AHEAD})|(?P<bare>[^&;#\s'\",]++)")
# "name": "value", 'name': 'value' (JSON quoted in an error, a Python repr; escaped inside
# another string too: ``{\"password\": \"x\"}``), also with ``=>`` or ``=`` (PHP, Ruby, TOML):
# a string, a container or a bare value. What the value is, is seen in a look-ahead: a member
# reads its value only when it is replaced (``members``), so a quote in another member's value
# may open the next name.
_PLAIN = r"\"(?:[^\"\\]++|\\[\s\S])*+\"|'(?:[^'\\]++|\\[\s\S])*+'"
_MEMBER = re.compile(
    rf"(?<!\\)(?P<q>{ESCAPES}[\"'])(?P<name>[^\"'\\\n]{{1,100}})(?P=q)(?P<sep>[ \t]*+(?::|=>?)[ \t]*+)"
    # A plain string (most values) is read here, in one step, when no string follows it but the
    # next member's name (``strings_end`` joins any other).
    rf"(?=(?P<plain>{_PLAIN})(?=\s*+(?:{_PLAIN})[ \t]*+[:=]|(?!\s*+[bBrRuUfF]{{0,2}}+\\*+[\"']))"
    rf"|(?P<string>{STRING_AHEAD})|(?P<open>{OPENS})|(?P<bare>[^\s,}}\]\"']++))"
)
# What a member with ``=`` or ``=>`` needs: a quote before it (the members pass runs only then).
MEMBER_EQ = re.compile(r"[\"'][ \t]*+=")
# A member's value that holds containers, read from its start.
MEMBER_VALUE = re.compile(rf"(?P<open>{OPENS})|(?P<string>{STRING_AHEAD})|(?P<bare>[^\s,}}\]\"']++)")
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
_HEADER_OPENS = re.compile(rf"(?P<open>{OPENS})|(?P<string>{STRING_AHEAD})")
INLINE_HEADER = re.compile(r"(?<![A-Za-z0-9_%\-])(?P<name>[A-Za-z0-9_%\-]{1,100})(?P<eq>:[ \t]*+)")
INLINE_VALUE = re.compile(rf"(?P<open>{OPENS})|(?P<string>{STRING_AHEAD})|(?P<bare>[^\s'\",;]++)")


def named(text: str, head: re.Pattern[str], value: re.Pattern[str], sep: str | None = None) -> str:
    """Replace the value after every secret name ``head`` finds (``name=``, ``name:``) with
    REDACTED (the name and ``sep``, else what separated them, kept); a container is replaced
    whole. ``head`` consumes only the name and its separator: a value is read (``value`` at its
    start) for a secret name alone, and skipped once replaced, so whatever another name's value
    holds is scanned as any text. Linear: each head is matched once, and each character is in at
    most one value read."""

    def replaced(m: re.Match[str]) -> tuple[str, int] | None:
        if not is_secret(m["name"]) or (end := value_end(text, m.end(), value)) is None:
            return None
        return f"{m['name']}{m['eq'] if sep is None else sep}{REDACTED}", end

    return replace_values(text, head, replaced)


def _member(m: re.Match[str]) -> tuple[str, int] | None:
    """Return a secret member's replacement and where its value ends (None: leave it): a string
    stays quoted as it was (``"password": "********"``), anything else is replaced bare."""
    if not is_secret(m["name"]):
        return None
    text, q, plain = m.string, m["q"], m["plain"]
    if plain is not None:
        return f"{q}{m['name']}{q}{m['sep']}{plain[0]}{REDACTED}{plain[0]}", m.end("plain")
    head = f"{q}{m['name']}{q}{m['sep']}"
    if m["bare"] is not None:
        return (f"{head}{REDACTED}", m.end("bare")) if hidden(m["bare"]) else None
    string = STRING.match(text, m.end())
    if string is not None and not string["prefix"]:
        # Kept quoted, so what follows its closing quote (maybe the next name) is read as text.
        last = strings_end(text, m.end())
        return (f"{head}{string['q']}{REDACTED}{string['q']}", last) if hidden(text[m.end():last]) else None
    end = value_end(text, m.end(), MEMBER_VALUE, LEVELS[len(q) - 1])
    return None if end is None else (f"{head}{REDACTED}", end)


def members(text: str) -> str:
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


def _header_end(text: str, m: re.Match[str]) -> int | None:
    """Return where a secret header's value ends (None: leave it): the block below it when its
    line holds none, a container's extent when it opens one, else the line's end."""
    if not is_secret(m["name"]):
        return None
    value = m["value"]
    if not value or (value[0] in "|>#!&" and _BLOCK_OPENER.fullmatch(value)):
        end = block_end(text, m.end(), len(m["lead"]))
        return end if hidden(text[m.start("value"):end].strip()) else None
    if m["q"]:  # "name": value on a line is a member's (``members``)
        return None
    if not hidden(value):
        return None
    opens = _HEADER_OPENS.match(text, m.start("value"))
    if opens is None:
        return m.end()
    # As a value on one line, it runs on to the end of the line its container or string closes on.
    close = container_end(text, opens.end()) if opens["open"] is not None else strings_end(text, opens.end())
    line_end = text.find("\n", close)
    return len(text) if line_end < 0 else line_end - (text[line_end - 1] == "\r")


def headers(text: str) -> str:
    """Replace the value of every secret-named header line: the rest of the line, and the lines a
    container or a YAML block below it runs on to. Linear: each line is matched once, and a
    replaced block is skipped."""

    def replaced(m: re.Match[str]) -> tuple[str, int] | None:
        end = _header_end(text, m)
        return None if end is None else (f"{m['lead']}{m['q']}{m['name']}{m['q']}: {REDACTED}", end)

    return replace_values(text, _HEADER, replaced)
