"""Durations and moments as text: parse and format ``500ms``, ``2s``, ``5m``, ``1h``, ``1d``; write them for people."""
from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from dispatcher.validation import MAX_DURATION

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str | int | float | timedelta) -> timedelta:
    """Return the timedelta written as ``1h30m``, ``500ms`` or a number of seconds."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, timedelta):
        seconds = text.total_seconds()
    elif isinstance(text, (int, float)):
        try:
            seconds = float(text)
        except OverflowError:  # an int past float's range
            raise ValueError(f"duration out of range: {_shown(text)}") from None
    else:
        raw = str(text).strip().lower().replace(" ", "")
        if not raw:
            raise ValueError("empty duration; write it like 500ms, 2s, 5m, 1h or 1d")
        if re.fullmatch(r"\d+(?:\.\d+)?", raw):
            seconds = float(raw)
        else:
            pos, seconds = 0, 0.0
            for match in _PART.finditer(raw):
                if match.start() != pos:
                    break
                seconds += float(match.group(1)) * _UNITS[match.group(2)]
                pos = match.end()
            if pos != len(raw) or pos == 0:
                raise ValueError(
                    f"not a duration: {_shown(text)}; write it like 500ms, 2s, 5m, 1h or 1d"
                )
    # Bounded both ways (dispatcher.validation.MAX_DURATION, about 10 years): a moment plus or
    # minus any accepted duration stays a moment Python and PostgreSQL can both read.
    if seconds != seconds or abs(seconds) > MAX_DURATION.total_seconds():
        raise ValueError(f"duration out of range: {_shown(text)} (at most {MAX_DURATION.days} days)")
    if seconds < 0:
        raise ValueError(f"duration cannot be negative: {_shown(text)}")
    return text if isinstance(text, timedelta) else timedelta(seconds=seconds)


def parse_positive_duration(text: str | int | float | timedelta) -> timedelta:
    """Return the duration, refusing zero and negative ones."""
    value = parse_duration(text)
    if value <= timedelta(0):
        raise ValueError(f"duration must be greater than zero: {text!r}")
    return value


def format_duration(value: timedelta | float | None) -> str:
    """Write a duration compactly (``1h``, ``2s``, ``500ms``, ``1m30s``)."""
    if value is None:
        return "-"
    total = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if total < 0:
        return "-" + format_duration(-total)
    if total < 1 and total != 0:
        return f"{round(total * 1000)}ms"
    parts = []
    rest = total
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if rest >= size:
            count = int(rest // size)
            parts.append(f"{count}{unit}")
            rest -= count * size
    if rest or not parts:
        parts.append(f"{rest:g}s")
    return "".join(parts)


def _shown(text: object) -> str:
    """Quote a refused input for a message, cut short (it may be megabytes long)."""
    shown = repr(text)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def humanize(moment: datetime | None, now: datetime) -> str:
    """Write a moment relative to now: "in 3 min", "12 s ago", "now"."""
    if moment is None:
        return "-"
    seconds = (moment - now).total_seconds()
    text = _span(abs(seconds))
    if text == "now":
        return text
    return f"in {text}" if seconds > 0 else f"{text} ago"


def format_moment(moment: datetime | None, now: datetime) -> str:
    """Write a moment the one way every screen does: "2026-11-21 15:02:11 UTC (in 3 min)"."""
    if moment is None:
        return "-"
    return f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC ({humanize(moment, now)})"


def humanize_duration(value: timedelta | None) -> str:
    """Write a duration for people: "3 min", "1 h 5 min", "-"."""
    if value is None:
        return "-"
    text = _span(value.total_seconds())
    return "0 s" if text == "now" else text


def _span(seconds: float) -> str:
    if seconds < 0.5:
        return "now"
    if round(seconds) < 60:
        return f"{round(seconds)} s"
    if round(seconds / 60) < 60:
        return f"{round(seconds / 60)} min"
    if round(seconds / 3600) < 24:
        hours, rest = divmod(round(seconds / 60), 60)
        return f"{hours} h {rest} min" if rest else f"{hours} h"
    days, rest = divmod(round(seconds / 3600), 24)
    return f"{days} d {rest} h" if rest else f"{days} d"
