"""Parse and format durations such as ``500ms``, ``2s``, ``5m``, ``1h``, ``1d``."""
from __future__ import annotations

import re
from datetime import timedelta

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")


def parse_duration(text: str | int | float | timedelta) -> timedelta:
    """Return the timedelta written as ``1h30m``, ``500ms`` or a number of seconds."""
    if isinstance(text, timedelta):
        return text
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
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
                    f"not a duration: {text!r}; write it like 500ms, 2s, 5m, 1h or 1d"
                )
    if seconds != seconds or seconds in (float("inf"), float("-inf")) or seconds > 10 * 365 * 86400:
        raise ValueError(f"duration out of range: {text!r}")
    return timedelta(seconds=seconds)


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
