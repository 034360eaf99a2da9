"""The learnt arrival guard: start-to-send delays remembered per key, and the guard they call for."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from dispatcher.clock import from_us, to_us
from dispatcher.limits.shapes import Policy

if TYPE_CHECKING:
    from dispatcher.models import KeyState

# The largest guard a key's measured start-to-send delays may raise it to: a quarter second
# covers a loaded worker's scheduling, and caps what one slow moment costs a smooth rate.
GUARD_MAX = timedelta(milliseconds=250)

# Delays are remembered at least this long whatever the policies, so a key sends at most a few
# measurements per second, and at most this long, so one slow moment does not tax a day window
# for a day (older delays fall back to the configured floor).
MEMORY_MIN = timedelta(seconds=1)
MEMORY_MAX = timedelta(minutes=10)


def memory(policies: Sequence[Policy], guard: timedelta = timedelta(0)) -> timedelta:
    """Return how long a key's measured delays must be remembered, bounded: its policies' longest
    horizon and the largest guard (a start that bears on what a policy admits now began at most
    that long ago, and its delay was measured later still)."""
    longest = max((p.horizon for p in policies), default=MEMORY_MIN) + guard
    return min(max(longest, MEMORY_MIN), MEMORY_MAX)


@dataclass(frozen=True)
class DelayMemory:
    """The largest start-to-send delay measured on a key in its current span of ``memory`` and the one before.

    ``current`` holds the delays measured since ``since``; ``previous`` those of the span before.
    """

    current: timedelta = timedelta(0)
    previous: timedelta = timedelta(0)
    since: datetime | None = None


def learnt_delay(kept: DelayMemory, now: datetime, span: timedelta) -> timedelta:
    """Return the largest delay measured within the last ``span`` before ``now`` (or more, never less).

    Every measurement made a ``span`` or more after ``since`` rolls the memory over
    (``remember_delay``), so if none did, none was made since ``since + span``: ``current``
    covers what the last span measured, and after two spans nothing was measured at all.
    """
    if kept.since is None:
        return timedelta(0)
    age = now - kept.since
    if age < span:
        return max(kept.current, kept.previous)
    if age < 2 * span:
        return kept.current
    return timedelta(0)


def remember_delay(kept: DelayMemory, now: datetime, span: timedelta, measured: timedelta) -> DelayMemory | None:
    """Return the memory after a delay measured at ``now`` (None: nothing changes, nothing to write)."""
    measured = max(measured, timedelta(0))
    if kept.since is None or now - kept.since >= 2 * span:
        return DelayMemory(measured, timedelta(0), now)
    if now - kept.since >= span:
        return DelayMemory(measured, kept.current, now)
    if measured > kept.current:
        return DelayMemory(measured, kept.previous, kept.since)
    return None


def arrival_guard(floor: timedelta, cap: timedelta, learnt: timedelta) -> timedelta:
    """Return the guard a key's policies absorb: the configured guard on top of the measured delay,
    at most the cap (and never less than the configured guard).

    The measured delay ends when the request leaves the worker; what follows (the network, the
    API reading the request) varies too and is not measured: the configured guard covers it.
    """
    return max(floor, min(cap, floor + learnt))


# Send-time pacing (a key whose policies are all buckets): its requests are held until their
# start plus the start-to-send delay it measured lately, and its buckets judge each start at that
# moment (the send moment). A held request may go out this much after its moment: a loaded
# machine's usual wake-up after a hold (p50 0.1 ms, p90 1-2 ms measured on the pacing benchmark's
# workers). Later than what its buckets allow, a request moves them on before it goes, or, once a
# later start was judged on them, does not go (``arrivals.release``).
SEND_SLACK = timedelta(milliseconds=1)


def held_hold(floor: timedelta, cap: timedelta, learnt: timedelta) -> timedelta:
    """Return the hold of a key whose requests are held: the delay measured, within what the cap
    lets a measured delay add to the configured guard (learning off, the cap the floor: none)."""
    return min(max(cap - floor, timedelta(0)), learnt)


def delay_memory(state: KeyState | None) -> DelayMemory:
    """Return the start-to-send delays a key's state row remembers."""
    if state is None:
        return DelayMemory()
    return DelayMemory(
        timedelta(microseconds=state.send_delay_us or 0),
        timedelta(microseconds=state.send_delay_prev_us or 0),
        state.send_delay_since,
    )


def remembered(kept: DelayMemory, now: datetime | None, span: timedelta) -> timedelta:
    """Return what a memory says at ``now`` (``learnt_delay``), or, before the clock is read
    (None), the largest it holds, which is never less."""
    if now is None:
        return max(kept.current, kept.previous) if kept.since is not None else timedelta(0)
    return learnt_delay(kept, now, span)


# A start whose request arrived later than the guard its windows counted it under (a worker
# process's first request to an API, which opens its connection: ``arrivals.Sent.opened``) is
# kept on its key's state as a late start: when it started, how late after that its request may
# have arrived (its send delay, the pad for the rest of its way out and the configured guard for
# the network), and its units. A window counts it, once its span no longer does, until a period
# after that arrival, exactly as long as the API's window holds it (``late_in_window``). At most
# LATE_MAX per key: a key with more keeps the delay in its memory instead, as any other.
LATE_MAX = 16


@dataclass(frozen=True)
class LateStart:
    """A start whose request arrived up to ``reach`` after it."""

    at: datetime
    reach: timedelta
    units: int

    def arrives_by(self) -> datetime:
        return self.at + self.reach


def late_starts(state: KeyState | None) -> list[LateStart]:
    """Return the late starts a key's state row keeps (``"start_us:reach_us:units;..."``)."""
    text = getattr(state, "late_starts", "") or ""
    if not text:
        return []  # most keys, at every start: nothing to parse
    found = []
    for item in text.split(";"):
        parts = item.split(":")
        if len(parts) == 3 and all(p.lstrip("-").isdigit() for p in parts):
            start, reach, units = (int(p) for p in parts)
            found.append(LateStart(from_us(start), timedelta(microseconds=reach), units))
    return found


def late_text(starts: Sequence[LateStart]) -> str:
    """Return late starts as the key's state row keeps them."""
    return ";".join(f"{to_us(s.at)}:{s.reach // timedelta(microseconds=1)}:{s.units}" for s in starts)


def late_in_window(starts: Sequence[LateStart], now: datetime, period: timedelta, span: timedelta) -> list[LateStart]:
    """Return the late starts a window of ``period``, counting the starts of its ``span`` back from
    ``now`` from its log, must count besides: those before the span whose request may have arrived
    within a period of a request sent now (the API's window holds it until a period after its arrival)."""
    return [s for s in starts if s.at < now - span and s.arrives_by() + period >= now]


def merged_leaves_at(
    late: Sequence[tuple[datetime, int]], logged: Callable[[int], datetime | None], n: int
) -> datetime | None:
    """Return when the n-th unit of a window leaves it, of its late starts' units (``late``: when
    each late start's units leave, as a start of the log's, and how many, in order) and its
    log's: the least, over how many of the late units come first, of the later of the last late
    one and the log's unit that makes n.

    Only the late starts' ends are tried: within one late start its units leave together, and
    taking more of them leaves fewer of the log's to wait for. So a late start of thousands of
    units (a token budget) costs one probe of the log (``logged``), not one per unit."""
    found: list[datetime] = []
    tries: list[tuple[int, datetime | None]] = [(0, None)]
    first = 0
    for moment, units in late:
        if first >= n:
            break
        first = min(first + units, n)
        tries.append((first, moment))
    for first, last in tries:
        rest = logged(n - first) if n > first else None
        if n > first and rest is None:
            continue  # the log has fewer units than that
        found.append(max(moment for moment in (last, rest) if moment is not None))
    return min(found, default=None)
