"""Where a value ends: a quoted string (escaped, joined, triple-quoted), a container, a YAML block;
and the replacing of what the passes found (``dispatcher.redact``). Each extent is found in one pass."""
from __future__ import annotations

import re
from collections.abc import Callable

from dispatcher.redact.names import REDACTED, hidden

# Where a value that is a container opens: a bracket, maybe after a constructor's name
# (``OrderedDict([...])``, ``SecretStr('x')``). It ends at the bracket, where ``container_end``
# starts.
OPENS = r"(?:[A-Za-z_][\w.]{0,100}+)?(?=[\[{(])"
# Where a value that is a quoted string opens (``strings_end`` reads it): maybe prefixed
# (``b'x'``), maybe escaped inside another string, at one of the levels ``LEVELS`` knows
# (``\"x\"``: JSON inside a JSON string; ``\'x\'``: a repr inside a repr).
ESCAPES = r"(?:\\{15}|\\{7}|\\{3}|\\)?+"
STRING_AHEAD = rf"(?=[bBrRuUfF]{{0,2}}+{ESCAPES}[\"'])"
STRING = re.compile(rf"(?P<prefix>[bBrRuUfF]{{0,2}}+)(?P<q>\"\"\"|'''|{ESCAPES}[\"'])")
# The escape level of a quote with this many backslashes before it: each level escapes the one
# inside it once, so a string's quote at level n has 2**n - 1.
LEVELS = {0: 0, 1: 1, 3: 2, 7: 3, 15: 4}
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
_ADJACENT = re.compile(rf"\s*+{STRING_AHEAD}")
# After a string: it is the next member's (or pair's) name, no part of the value before it.
_NAME_SEP = re.compile(r"[ \t]*+[:=]")
# What a container's scan steps on: a bracket, or a quoted string skipped whole (triple-quoted
# too; escapes honoured; one never closed runs to the text's end).
_CONTAINER_TOKEN = re.compile(
    r"[\[\]{}()]|\"\"\"(?:[^\"\\]++|\\[\s\S]?|\"(?!\"\"))*+(?:\"\"\"|\Z)|'''(?:[^'\\]++|\\[\s\S]?|'(?!''))*+(?:'''|\Z)"
    r"|\"(?:[^\"\\]++|\\[\s\S]?)*+\"?|'(?:[^'\\]++|\\[\s\S]?)*+'?"
)
# A line of such a block: its indentation, and whether it is a YAML item (``- x``) or blank.
_LINE = re.compile(r"\n(?P<indent>[ \t]*+)(?:(?P<item>-)(?=[ \t\r\n]|\Z)|(?P<blank>(?=\r?\n|\r?\Z)))?")


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
    level = LEVELS[len(q) - 1]
    return next((run.end() for run in _QUOTE_RUN.finditer(text, opened.end())
                 if run.group()[-1] == q[-1] and _delimits(run.group(), level)), len(text))


def strings_end(text: str, at: int) -> int:
    """Return where the quoted string at ``at`` ends, with the strings of its escape level
    adjacent to it that Python joins to it (``'ab' 'cd'``, across lines as pprint wraps them); a
    string followed by ``:`` or ``=`` is the next name, no part of this value."""
    first = STRING.match(text, at)
    if first is None:
        return at
    end = _string_end(text, first)
    while (gap := _ADJACENT.match(text, end)) is not None:
        part = STRING.match(text, gap.end())
        if part is None or part["q"].count("\\") != first["q"].count("\\"):
            break  # a quote of another escape level: another string's
        after = _string_end(text, part)
        if _NAME_SEP.match(text, after):
            break
        end = after
    return end


def container_end(text: str, at: int, level: int = 0) -> int:
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
    ``container_end`` does: a bracket counts outside its strings only."""
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


def value_end(text: str, at: int, value: re.Pattern[str], level: int = 0) -> int | None:
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
        end = strings_end(text, end) if string else container_end(text, end, level)
        found = value.match(text, end)
        if string and found is not None and found["string"] is not None:
            break  # a quote right after a string's, of another escape level (an outer string's close)
        if found is not None and found["bare"] is not None:
            end = found.end()
    return end if hidden(text[at:end]) else None


def replace_values(text: str, head: re.Pattern[str], replaced: Callable[[re.Match[str]], tuple[str, int] | None]) -> str:
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


def block_end(text: str, at: int, column: int) -> int:
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


def replace_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Replace each span of text with REDACTED, those that overlap or touch as one, and those
    that say there is no secret (empty, ``None``) left as they are."""
    out: list[str] = []
    done = first = last = 0
    for start, end in [*sorted(spans), (len(text) + 1, 0)]:
        if start <= last and last > first:  # overlaps or touches the span before it
            last = max(last, end)
            continue
        if last > first and hidden(text[first:last].strip()):
            out += [text[done:first], REDACTED]
            done = last
        first, last = start, end
    return "".join(out) + text[done:] if out else text
