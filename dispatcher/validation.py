"""Bounds on what callers may hand us: JSON shape (depth, items, NUL) and moments in time.

Pure functions, no database: ``send()``, ``send_many()``, the JSON API, the worker (a
handler's result) and the commands all call these, so every entry point refuses the same
input with the same words. Every walk here is iterative, so no input can exhaust the stack.
"""
from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

# Deeper than any real API payload; far below Python's recursion limit (1000), which the json
# module, Django's JSONField and the admin's pretty printer all recurse into.
MAX_JSON_DEPTH = 32
# Values (containers, keys and scalars) in one document; the byte limits bound size as text.
MAX_JSON_ITEMS = 100_000
# Rows stored before these bounds (or by raw SQL) deeper than this read as a note, not a value.
STORED_JSON_MAX_DEPTH = 200

# Moments a call may be given (run_at). Wide enough for any real schedule; narrow enough that
# adding any duration the dispatcher accepts (at most MAX_DURATION) stays within what Python's
# datetime (years 1-9999) and PostgreSQL's timestamptz can both read back.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)
# Longest duration accepted anywhere (settings, --for, --per, --older-than, admin forms).
MAX_DURATION = timedelta(days=3650)


_NOT_BRACKET = re.compile(r"[^\[\]{}]++")
_PARENS = str.maketrans("[]{}", "()()")


class OutOfBounds(ValueError):
    """A value outside the bounds above."""


def check_json(value: Any, *, what: str = "value", max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS) -> None:
    """Raise OutOfBounds if a JSON-like value nests deeper than ``max_depth``, holds too many items or a NUL."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    items = 0
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > max_items:
            raise OutOfBounds(f"{what} hold more than {max_items} values")
        if isinstance(node, str):
            if "\x00" in node:
                raise OutOfBounds(f"{what} cannot contain NUL characters")
            continue
        if isinstance(node, dict):
            children: Any = node.values()
            for key in node:
                if isinstance(key, str) and "\x00" in key:
                    raise OutOfBounds(f"{what} cannot contain NUL characters")
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > max_depth:
            raise OutOfBounds(f"{what} are nested too deeply (more than {max_depth} levels)")
        stack.extend((child, depth + 1) for child in children)


def json_text_depth(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """Return how deep a JSON text nests, ``limit`` + 1 for anything deeper, in time linear in the text.

    Run before ``json.loads``, whose recursive parser a deep enough text would overflow. Strings
    are removed whole first, so brackets inside them do not count; the brackets left are reduced
    by whole-text replacements (at most ``limit`` + 2 of them), all in C: 1 MiB of any shape takes
    milliseconds (bench/hostile.py). Exact for a well-formed text; an unmatched opening bracket
    counts as one level more, as the parser would recurse into it.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    if '"' in text:
        # Strings go whole: escaped backslashes, then escaped quotes, then every other run
        # between quotes (an unterminated string runs to the end). Whole-text operations in C,
        # never a scan started again inside a string (``"\"\"\"...`` once took an hour per MiB).
        text = "".join(text.replace("\\\\", "").replace('\\"', "").split('"')[::2])
    brackets = _NOT_BRACKET.sub("", text).translate(_PARENS)
    # Each round removes the innermost pairs, "()": a pair nested h deep goes in round h. With
    # none left, the rest is unmatched: closes, then opens, each open one level more.
    rounds = 0
    while "()" in brackets:
        if rounds > limit:
            return limit + 1
        brackets = brackets.replace("()", "")
        rounds += 1
    return min(rounds + brackets.count("("), limit + 1)


def check_moment(value: datetime, *, what: str = "run_at") -> datetime:
    """Return an aware datetime within EARLIEST..LATEST in UTC, else raise OutOfBounds."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise OutOfBounds(f"{what} must carry a timezone (a naive datetime is ambiguous)")
    # Compared without converting: turning 0001-01-01T00:00+01:00 into UTC would itself overflow.
    try:
        inside = EARLIEST <= value < LATEST
    except OverflowError:
        inside = False
    if not inside:
        raise OutOfBounds(f"{what} must be between {EARLIEST:%Y-%m-%d} and {LATEST:%Y-%m-%d} (UTC), not {value.isoformat()}")
    return value.astimezone(UTC)


def check_duration(value: timedelta, *, what: str = "duration") -> timedelta:
    """Return a duration no longer than MAX_DURATION either way, else raise OutOfBounds."""
    if abs(value) > MAX_DURATION:
        raise OutOfBounds(f"{what} out of range: longer than {MAX_DURATION.days} days")
    return value


def bounded_seconds(value: Any) -> float | None:
    """Return a number of seconds within 0..MAX_DURATION, or None for no usable number (NaN, text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return MAX_DURATION.total_seconds()
    if seconds != seconds:
        return None
    return min(max(seconds, 0.0), MAX_DURATION.total_seconds())


class StoredJSONDecoder(json.JSONDecoder):
    """Decode a JSON column; a value stored nested too deeply to parse reads as a note, not an error.

    ``send()`` refuses such params now, but a row stored before (or by raw SQL) would otherwise
    make every page and sweep that reads it raise RecursionError.
    """

    def decode(self, s: str, *args: Any, **kwargs: Any) -> Any:
        # The same bound on every Python: how deep json and the admin's pretty-printing can go
        # before recursing too far differs between versions (3.12 parses 950 levels, 3.11 not).
        # Counting brackets first keeps the scan off the usual, shallow values.
        if s.count("[") + s.count("{") > STORED_JSON_MAX_DEPTH and json_text_depth(s, STORED_JSON_MAX_DEPTH) > STORED_JSON_MAX_DEPTH:
            return _unreadable(s)
        try:
            return super().decode(s, *args, **kwargs)
        except RecursionError:
            return _unreadable(s)


def _unreadable(s: str) -> dict[str, str]:
    return {"unreadable": f"stored JSON nested too deeply to read ({len(s)} characters)"}
