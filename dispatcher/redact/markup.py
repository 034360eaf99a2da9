"""The passes that hide what markup and structure say is a secret's: XML elements and their
attributes, INI and TOML sections, objects a sibling member names, form fields a sibling field
names (``dispatcher.redact``)."""
from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterator

from dispatcher.redact.extents import replace_spans, strings_end
from dispatcher.redact.names import NAMED, REDACTED, is_secret
from dispatcher.redact.pairs import MEMBER_VALUE

# An element's tag, or the start of a CDATA section or a comment (what the element pass steps
# on). Only tags whose name holds a part of a secret name match, so the regex engine, not
# Python, skips every other tag; an attribute's quoted value is skipped whole, so a ``>`` or
# ``/>`` in it ends nothing.
_TAG = re.compile(
    r"<(?P<opaque>!\[CDATA\[|!--)"
    rf"|<(?P<close>/?)(?=[\w.\-:]{{0,100}}?(?i:{'|'.join(NAMED)}))"
    r"(?P<tag>[A-Za-z_][\w.\-:]{0,100}+)(?:\s(?:[^<>\"'/]++|/(?!>)|\"[^\"<]*+\"|'[^'<]*+')*+)?(?P<empty>/?)>"
)
# The name of every close tag ``_TAG`` may pair (whose name holds a part of a secret name).
_CLOSE_TAG = re.compile(rf"</(?=[\w.\-:]{{0,100}}?(?i:{'|'.join(NAMED)}))([A-Za-z_][\w.\-:]{{0,100}}+)")
# HTML's void elements: never closed, never holding anything.
_VOID = frozenset({"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"})
# Every tag, as ``_TAG`` reads one, with its attributes (what the pass over elements an
# attribute names steps on: any element may be one), and the name of every close tag.
_ANY_TAG = re.compile(
    r"<(?P<opaque>!\[CDATA\[|!--)"
    r"|<(?P<close>/?)(?P<tag>[A-Za-z_][\w.\-:]{0,100}+)"
    r"(?P<attributes>(?:\s(?:[^<>\"'/]++|/(?!>)|\"[^\"<]*+\"|'[^'<]*+')*+)?)(?P<empty>/?)>"
)
_ANY_CLOSE_TAG = re.compile(r"</([A-Za-z_][\w.\-:]{0,100}+)")
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
    rf"<(?=[^<>]*?(?i:{'|'.join(NAMED)}))(?P<tag>[A-Za-z_][\w.\-:]{{0,100}}+)(?P<attributes>\s(?:{_ATTRIBUTE.replace('?P<name>', '').replace('?P<value>', '')})++)"
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
# A run of form fields joined by ``&`` (a query string, a form body): from a whitespace, a
# quote or the text's start (the look-behind refuses a start inside a run) to the next
# whitespace or quote; only a run holding an ``&`` matches.
_FORM_RUN = re.compile(r"(?<![^\s\"'])(?:[^\s\"'&]*+&)++[^\s\"'&]*+")
# A field that may name its siblings' secret (``name=password``, ``key=api_key``), after a
# whitespace, a quote, ``?`` or ``&`` (the character is consumed: the engine then finds a
# candidate fast; a text or run is searched with a space before it).
_NAMING_FIELD = re.compile(rf"[\s\"'?&]{_NAMING_WORD}=(?P<named>[^&\s\"']{{1,100}})")
# A field of a run, its value not empty, unless it is a naming one: what ``forms`` replaces.
_FORM_VALUE = re.compile(rf"(?<![^&])(?P<name>(?:[^&=?]*+\?)*+(?!{_NAMING_WORD}=)[^&=]*+=)[^&]++")
# An INI or TOML section's header line (``[password]``, ``[[servers.auth]]``), maybe with a
# comment; a line's start is found as the ``\n`` before it (a literal the engine searches fast).
_SECTION = r"[ \t]*+\[{1,2}+(?P<section>[^\[\]\r\n]{1,200}+)\]{1,2}+[ \t]*+(?:[#;][^\r\n]*+)?\r?(?=\n|\Z)"
_FIRST_SECTION = re.compile(_SECTION)
_SECTION_LINE = re.compile(rf"\n{_SECTION}")


def section_spans(text: str) -> list[tuple[int, int]]:
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
        body = header.end() + 1 if header.end() < len(text) and is_secret(header["section"].strip()) else -1
    if body >= 0:
        spans.append((body, len(text)))
    return [(start, start + len(text[start:end].rstrip())) for start, end in spans]


def attribute_spans(text: str) -> list[tuple[int, int]]:
    """Return the attribute values of every element that is a secret's: its name is secret
    (``<password value="x"/>``) or its name or key attribute names one (``<add key="ApiKey"
    value="x"/>``). Every attribute but the naming ones and namespace declarations is the
    secret's. Linear: a tag's attributes are read in one match, and again only if it is a
    secret's; a quoted value spans at most one other tag's values (of the other quote), so no
    character is read more than a few times."""
    spans: list[tuple[int, int]] = []
    for tag in _ATTRIBUTED_TAG.finditer(text):
        start, end = tag.span("attributes")
        if not is_secret(tag["tag"].rpartition(":")[2]) and not _names_secret(text, start, end):
            continue
        spans += [
            (first + 1, last - (last - first > 1 and text[last - 1] == text[first])) if text[first] in "\"'" else (first, last)
            for first, last in (a.span("value") for a in _ATTRIBUTE_RE.finditer(text, start, end) if a["value"] is not None
                                and not _kept_attribute(a["name"]))
        ]  # a quoted value: what it holds, its quotes kept
    return spans


def _names_secret(text: str, start: int, end: int) -> bool:
    """Say whether the attributes between ``start`` and ``end`` name their element's secret
    (``key="ApiKey"``)."""
    return any(is_secret(named["dq"] or named["sq"] or named["bare"]) for named in _NAMING_ATTRIBUTE.finditer(text, start, end))


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


def sibling_spans(text: str) -> list[tuple[int, int]]:
    """Return the member values of every object a sibling names the secret of: a ``name`` or
    ``key`` member (``_NAMING``) whose value is a secret name (``{"name": "password", "value":
    "x"}``, ``{'Key': 'token', 'Value': 'x'}``, in any order): every other member's value in that
    object, a container whole. Linear: runs only when such a member is found, then steps on each
    bracket and string once; a member's value that is a string or bare is read once and skipped."""
    lowered = text.lower()
    if ("name" not in lowered and "key" not in lowered) or not any(
        is_secret(m["named"]) for m in _NAMING_MEMBER.finditer(text)
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
            value = MEMBER_VALUE.match(text, at)
            if value is None:
                continue
            if value["open"] is not None:
                current.opens = (at, value.end())
                continue
            end = value.end() if value["bare"] is not None else strings_end(text, at)
            name = token["string"].strip("\"'")
            if value["string"] is not None and _NAMING.fullmatch(name) and is_secret(text[at:end][:102].strip("\"'")):
                current.named = True
            elif value["string"] is not None and end - at >= 2 and text[end - 1] == text[at] and not text[at].isalpha():
                current.values.append((at + 1, end - 1))  # a string: what it holds, its quotes kept
            else:
                current.values.append((at, end))
            # A string value runs to its closing quote, which may be lines away (or nowhere: a
            # stray quote); the scan goes on from its line's end at the latest, so no object on a
            # later line is skipped unread (its brackets and strings count again, on the safe side).
            line_end = -1 if value["bare"] is not None else text.find("\n", at, end)
            at = end if line_end < 0 else line_end
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


def forms(text: str) -> str:
    """Replace the field values of every run of ``&``-joined form fields (a query string, a form
    body) in which a ``name`` or ``key`` field (``_NAMING``) has a secret name as its value
    (``name=password&value=x``, ``key=api_key&val=x``, in any order): every other field's value,
    to the next ``&`` or the run's end, naming fields kept; the backslashes that escape a
    closing quote are left to it. Linear: runs only when such a field is found; each run is
    matched once, and searched and replaced once if it holds one."""
    if not any(is_secret(m["named"]) for m in _NAMING_FIELD.finditer(f" {text}")):
        return text
    out: list[str] = []
    done = 0
    for run in _FORM_RUN.finditer(text):
        fields = run.group()
        if not any(is_secret(m["named"]) for m in _NAMING_FIELD.finditer(f" {fields}")):
            continue
        escapes = len(fields) - len(fields.rstrip("\\")) if text[run.end():run.end() + 1] in ("\"", "'") else 0
        kept = len(fields) - escapes
        out += [text[done:run.start()], _FORM_VALUE.sub(rf"\g<name>{REDACTED}", fields[:kept]), fields[kept:]]
        done = run.end()
    return "".join(out) + text[done:] if out else text


def _tags(text: str, pattern: re.Pattern[str] = _TAG) -> Iterator[tuple[int, re.Match[str]]]:
    """Yield every tag ``pattern`` finds with its scope: 0, or the number of the CDATA section or
    comment it is in (inside one, another's start is text). Linear: each section's end is
    searched for once, and the tags are found in one pass."""
    at = scopes = 0
    while True:
        for m in pattern.finditer(text, at):
            if m["opaque"]:
                break
            yield 0, m
        else:
            return
        scopes += 1
        close = _OPAQUE_END[m["opaque"]]
        stop = text.find(close, m.end())
        stop = len(text) if stop < 0 else stop
        yield from ((scopes, tag) for tag in pattern.finditer(text, m.end(), stop) if not tag["opaque"])
        at = stop + len(close)


def _paired_spans(
    text: str, pattern: re.Pattern[str], closed: set[str], secret: Callable[[re.Match[str]], bool]
) -> list[tuple[int, int]]:
    """Return the content (start, end) of every element whose open tag is ``secret``'s (of those
    ``pattern`` finds): from its open tag to the close tag of the same name that pairs with it as
    nesting pairs them, or to the text's end if none does. A CDATA section or a comment is a
    scope of its own (its tags pair only with each other), so
    ``<password><![CDATA[</password>x]]></password>`` hides ``x``. An open tag whose name no
    close tag has (``closed``) runs to the next tag if that is a close tag, else to the end (the
    pass stops there). Empty contents are left out. Linear: one pass over the tags, each open
    tag paired by a stack per name, never by a search from it."""
    spans: list[tuple[int, int]] = []
    # Per scope and name, the open elements (their content's start, whether secret); an element
    # that is not secret is kept only inside a secret one of its name, to pair its close tag.
    opened: dict[tuple[int, str], list[tuple[int, bool]]] = {}
    for scope, tag in _tags(text, pattern):
        close, name, empty = tag.group("close", "tag", "empty")
        if empty:
            continue
        starts = opened.get((scope, name))
        if close:
            if starts and (popped := starts.pop())[1] and popped[0] < tag.start():
                spans.append((popped[0], tag.start()))
            continue
        if not secret(tag):
            if starts:
                starts.append((tag.end(), False))
            continue
        if name not in closed:
            # Never closed: XML text holds no ``<``, so if the next tag closes another element,
            # the text ends there; if it opens a child, a CDATA section or a comment, or no tag
            # follows, it runs to the end and the pass stops.
            following = text.find("<", tag.end())
            if scope == 0 and text.startswith("</", following):
                if following > tag.end():
                    spans.append((tag.end(), following))
                continue
            opened.setdefault((scope, name), []).append((tag.end(), True))
            break
        opened.setdefault((scope, name), []).append((tag.end(), True))
    # Each element never closed runs to the end: the first holds all the others (the first
    # open of a name's stack is a secret one: no other is kept without one below it).
    unclosed = [starts[0][0] for starts in opened.values() if starts]
    return spans + [(min(unclosed), len(text))] if unclosed else spans


def _element_spans(text: str) -> list[tuple[int, int]]:
    """Return the content of every secret-named element (``<password><v>x</v></password>``)."""
    return _paired_spans(text, _TAG, set(_CLOSE_TAG.findall(text)), lambda tag: is_secret(tag["tag"].rpartition(":")[2]))


def named_element_spans(text: str) -> list[tuple[int, int]]:
    """Return the content of every element whose ``name`` or ``key`` attribute names a secret
    (``<setting name="ApiKey"><value>x</value></setting>``, ``<entry key="token">x</entry>``), as
    ``_paired_spans`` finds it. Runs only when an attribute names one; then steps on every tag,
    since any element may be such a one."""
    if not any(is_secret(named["dq"] or named["sq"] or named["bare"]) for named in _NAMING_ATTRIBUTE.finditer(text)):
        return []

    def secret(tag: re.Match[str]) -> bool:
        # HTML's void elements hold nothing (``<input name="password">`` in a login page): their
        # attributes are hidden (``attribute_spans``), and what follows them is the page's.
        return (
            bool(tag["attributes"]) and tag["tag"].lower() not in _VOID
            and _names_secret(text, *tag.span("attributes"))
        )

    return _paired_spans(text, _ANY_TAG, set(_ANY_CLOSE_TAG.findall(text)), secret)


def elements(text: str) -> str:
    """Replace the content of every secret-named element, whatever it holds (children, CDATA,
    comments, mixed text); contents that overlap or touch, as nested or malformed markup makes
    them, are replaced as one."""
    return replace_spans(text, _element_spans(text))
