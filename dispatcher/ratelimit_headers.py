"""Read an API's rate-limit signals from its answer's headers; pure, no database.

Understood, in this order of trust:

- ``Retry-After`` (on 429 and 503): delta-seconds or an HTTP date.
- The IETF draft (draft-ietf-httpapi-ratelimit-headers-09): ``RateLimit-Policy: "p";q=100;w=10``
  (quota q per window of w seconds) and ``RateLimit: "p";r=50;t=30`` (r remain, reset in t
  seconds); several policies may be listed; the older drafts' ``RateLimit-Limit``,
  ``-Remaining`` and ``-Reset`` (reset always in seconds) too.
- ``X-RateLimit-Limit``, ``-Remaining``, ``-Reset``: a reset above ``EPOCH_AFTER`` (2001-09-09,
  when epoch seconds passed 1e9) is an epoch timestamp, above ``EPOCH_MS_AFTER`` one in
  milliseconds; anything smaller is seconds from now.

A value that is not a finite, non-negative number within bounds is ignored, never guessed at;
durations are cut to ``MAX_SECONDS``.
"""
from __future__ import annotations

import email.utils
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

EPOCH_AFTER = 1e9
EPOCH_MS_AFTER = 1e12
MAX_SECONDS = 86400.0
MAX_COUNT = 10**9
# Longest header value looked at: a field bigger than this is not a rate-limit signal.
MAX_FIELD = 1024
_NUMBER = re.compile(r"^\s*\+?(\d{1,16}(?:\.\d{1,9})?)\s*$")
# Every header a signal is read from.
SIGNAL_HEADERS = frozenset({
    "retry-after", "ratelimit", "ratelimit-policy", "ratelimit-limit", "ratelimit-remaining", "ratelimit-reset",
    "x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset",
})


@dataclass(frozen=True)
class Window:
    """A limit the API announces: ``limit`` units per ``seconds``."""

    limit: int
    seconds: float


@dataclass(frozen=True)
class Signal:
    """What an answer says about the API's limits; ``None`` where it says nothing."""

    remaining: int | None = None
    reset: float | None = None
    retry_after: float | None = None
    windows: tuple[Window, ...] = ()
    source: str = ""
    text: str = ""

    @property
    def empty(self) -> bool:
        return self.remaining is None and self.reset is None and self.retry_after is None and not self.windows

    def wait(self) -> float | None:
        """Return how long nothing may start: Retry-After, else the reset when nothing remains."""
        if self.retry_after is not None:
            return self.retry_after
        if self.remaining == 0 and self.reset is not None:
            return self.reset
        return None


def _number(value: str | None) -> float | None:
    if value is None or len(value) > MAX_FIELD:
        return None
    match = _NUMBER.match(value.split(",")[0])
    if not match:
        return None
    number = float(match.group(1))
    return number if math.isfinite(number) else None


def _count(value: str | None) -> int | None:
    number = _number(value)
    if number is None or number != int(number) or number > MAX_COUNT:
        return None
    return int(number)


def _seconds(value: float | None) -> float | None:
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return min(value, MAX_SECONDS)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Return the seconds a Retry-After value asks for (delta-seconds or an HTTP date)."""
    if not value or len(value) > MAX_FIELD:
        return None
    seconds = _number(value)
    if seconds is None:
        try:
            when = email.utils.parsedate_to_datetime(value.strip())
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None or when.tzinfo is None:
            return None
        try:
            seconds = max(when.timestamp() - now, 0.0)
        except (OverflowError, ValueError, OSError):
            return None
    return _seconds(seconds)


def parse_reset(value: str | None, now: float) -> float | None:
    """Return the seconds until a reset given as seconds, epoch seconds or epoch milliseconds."""
    number = _number(value)
    if number is None:
        return None
    if number > EPOCH_MS_AFTER:
        number = number / 1000 - now
    elif number > EPOCH_AFTER:
        number = number - now
    return _seconds(max(number, 0.0))


def _members(value: str) -> list[tuple[str, dict[str, str]]]:
    """Split a structured-field list into (item, params), tolerating what does not parse."""
    members = []
    for raw in re.findall(r'(?:"[^"]*"|[^,])+', value)[:16]:
        parts = [p.strip() for p in raw.split(";")]
        item, params = parts[0].strip('"'), {}
        for part in parts[1:]:
            name, _, val = part.partition("=")
            params[name.strip().lower()] = val.strip().strip('"')
        members.append((item, params))
    return members


def _ietf(headers: Mapping[str, str], now: float) -> Signal | None:
    policy_field = headers.get("ratelimit-policy") or ""
    state_field = headers.get("ratelimit") or ""
    if len(policy_field) > MAX_FIELD or len(state_field) > MAX_FIELD:
        return None
    windows = []
    for _, params in _members(policy_field):
        limit, window = _count(params.get("q")), _seconds(_number(params.get("w")))
        if limit is not None and window:
            windows.append(Window(limit, window))
    remaining = reset = None
    for _, params in _members(state_field):
        r, t = _count(params.get("r")), _seconds(_number(params.get("t")))
        if r is not None and (remaining is None or r < remaining):
            remaining, reset = r, t
        elif r is None and t is not None and reset is None:
            reset = t
    if not windows and remaining is None and reset is None:
        return None
    return Signal(remaining=remaining, reset=reset, windows=tuple(windows), source="ietf")


def _family(headers: Mapping[str, str], prefix: str, now: float, epochs: bool) -> Signal | None:
    limit = _count(headers.get(f"{prefix}limit"))
    remaining = _count(headers.get(f"{prefix}remaining"))
    reset_text = headers.get(f"{prefix}reset")
    reset = parse_reset(reset_text, now) if epochs else _seconds(_number(reset_text))
    if limit is None and remaining is None and reset is None:
        return None
    windows: tuple[Window, ...] = ()
    # The window is not announced; the reset seen when the most remain is the best estimate
    # of it (the learner keeps the longest it has seen).
    if limit and reset:
        windows = (Window(limit, reset),)
    return Signal(remaining=remaining, reset=reset, windows=windows, source=prefix.rstrip("-") or "ratelimit")


def parse(headers: Mapping[str, str], status: int, now: float) -> Signal:
    """Return the signal of one answer; ``headers`` is case-insensitive (as httpx's are)."""
    # Most answers carry none of them: one pass over the names instead of a lookup of each.
    if SIGNAL_HEADERS.isdisjoint(name.lower() for name in headers):
        return Signal()
    found = (
        _ietf(headers, now)
        or _family(headers, "ratelimit-", now, epochs=False)
        or _family(headers, "x-ratelimit-", now, epochs=True)
        or Signal()
    )
    retry_after = parse_retry_after(headers.get("retry-after"), now) if status in (429, 503) else None
    text = describe(found, retry_after)
    return Signal(found.remaining, found.reset, retry_after, found.windows, found.source or ("retry-after" if retry_after is not None else ""), text)


def describe(signal: Signal, retry_after: float | None = None) -> str:
    """Return a short line for the admin and the status: what the API said."""
    parts = []
    if retry_after is not None:
        parts.append(f"Retry-After {retry_after:g}s")
    for window in signal.windows:
        parts.append(f"limit {window.limit} per {window.seconds:g}s")
    if signal.remaining is not None:
        parts.append(f"{signal.remaining} remaining")
    if signal.reset is not None:
        parts.append(f"reset in {signal.reset:g}s")
    return ", ".join(parts)


def _ok_count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else None


def _ok_seconds(value: object) -> float | None:
    return _seconds(float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def signal(
    *, limit: int | None = None, window: float | None = None, remaining: int | None = None,
    reset: float | None = None, retry_after: float | None = None, source: str = "handler",
) -> Signal:
    """Build a signal from a handler's own reading of an API (e.g. a ``used/limit`` header)."""
    limit, remaining = _ok_count(limit), _ok_count(remaining)
    window_s, reset_s, retry_s = _ok_seconds(window), _ok_seconds(reset), _ok_seconds(retry_after)
    windows: Iterable[Window] = (Window(limit, window_s),) if limit and window_s else ()
    found = Signal(remaining=remaining, reset=reset_s, windows=tuple(windows), source=source)
    return Signal(remaining, reset_s, retry_s, tuple(windows), source, describe(found, retry_s))
