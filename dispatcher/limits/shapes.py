"""Rate policy shapes as pure objects: a sliding window and a token bucket (GCRA).

Every module that needs to know whether a key has room, when room returns, what a start
changes or how to describe a policy asks one of these objects; none of them touches the
database. Times are ``datetime``; all arithmetic is done in whole microseconds (the database
clock's resolution), rounding towards the safe side, so no shape ever admits more than its
allowance.

A guard (``DISPATCHER_ARRIVAL_GUARD``) absorbs the spread between a recorded start and the
request's arrival at the API: a window counts over ``period + guard``; a bucket gives up
``ceil(guard / interval)`` of its burst (capped so one unit still fits) and lengthens its
interval by what the burst could not absorb. See ``effective`` of each shape for the proof
sketch and docs/policies.md for the cost in throughput. The guard applied to a key is the
start-to-send delay its workers measured lately, with that floor on top, capped
(``dispatcher.limits.guard``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from fractions import Fraction
from typing import ClassVar, overload

from dispatcher.durations import format_duration

US = timedelta(microseconds=1)


def _us(value: timedelta) -> int:
    return value // US


def _ceil_us(value: Fraction) -> timedelta:
    return timedelta(microseconds=math.ceil(value))


class PolicyError(ValueError):
    """A policy that cannot be stored: a bad limit, period, burst or concurrency."""


@dataclass(frozen=True)
class Reading:
    """What storage says about one policy of one key at one instant.

    ``used``: units counted against a window now; ``tat``: a bucket's theoretical arrival
    time (None: a full bucket); ``leaves_at(n)``: when the n-th oldest unit in a window leaves
    it (read lazily, only when a window is full).
    """

    used: int = 0
    tat: datetime | None = None
    leaves_at: Callable[[int], datetime | None] | None = None


@dataclass(frozen=True)
class Policy:
    """What every shape shares: the key it was set on, its rate and an optional concurrency cap."""

    shape: ClassVar[str] = ""
    key: str
    limit: int
    period: timedelta
    concurrency: int | None = None
    guard: timedelta = field(default=timedelta(0), compare=False)

    # --- the operations every shape answers ----------------------------------------------------

    def capacity(self) -> int:
        """Return the most units one call may cost and still fit some day."""
        raise NotImplementedError

    def room(self, reading: Reading, now: datetime, reserved: int = 0) -> int:
        """Return how many units may start at ``now``, ``reserved`` units being promised already."""
        raise NotImplementedError

    def alone(self, reading: Reading, now: datetime, reserved: int = 0) -> int:
        """Return the most units one call may cost and start at ``now`` (``room`` unless a bucket
        admits a single call beyond it)."""
        return self.room(reading, now, reserved)

    def frees_at(self, reading: Reading, now: datetime, need: int, reserved: int = 0) -> datetime | None:
        """Return when ``need`` more units fit (None: not known from the reading)."""
        raise NotImplementedError

    def charge(self, reading: Reading, now: datetime, cost: int) -> datetime | None:
        """Return the bucket state after a start of ``cost`` units at ``now`` (None for a window)."""
        return None

    def explain(self) -> str:
        """Describe the policy in one line."""
        raise NotImplementedError

    def drain(self, room_now: int, units: int) -> timedelta:
        """Estimate how long a backlog of ``units`` takes to start, ``room_now`` units fitting now."""
        raise NotImplementedError

    def queue_frees_at(self, reading: Reading, now: datetime, queued: int, need: int) -> datetime | None:
        """Return when a call of ``need`` units can start at the earliest, ``queued`` units starting
        before it, each as soon as the policy admits it (None: the reading cannot say)."""
        return self.frees_at(reading, now, queued + need)

    # --- shared helpers --------------------------------------------------------------------------

    @property
    def per_minute(self) -> float:
        """The policy's sustained rate in units per minute (the dashboard's limit line)."""
        return self.limit * 60 / self.period.total_seconds()

    def label(self) -> str:
        return f"{self.limit} per {format_duration(self.period)}"

    def with_guard(self, guard: timedelta) -> Policy:
        return type(self)(**{**self.__dict__, "guard": guard})

    def with_learnt_guard(self, guard: timedelta) -> Policy:
        """Return the policy under a guard learnt at run time (a bucket may hold less, see ``alone``)."""
        return self.with_guard(guard)

    @property
    def horizon(self) -> timedelta:
        """How far back a start still bears on what this policy admits (a window: its period)."""
        return self.period


@dataclass(frozen=True)
class SlidingWindow(Policy):
    """At most ``limit`` units start in any closed interval of length ``period`` (+ guard)."""

    shape: ClassVar[str] = "window"

    @property
    def span(self) -> timedelta:
        """The interval counted: arrivals spread by at most the guard then keep ``period``."""
        return self.period + self.guard

    def capacity(self) -> int:
        return self.limit

    def room(self, reading: Reading, now: datetime, reserved: int = 0) -> int:
        return self.limit - reading.used - reserved

    def frees_at(self, reading: Reading, now: datetime, need: int, reserved: int = 0) -> datetime | None:
        must_leave = reading.used + reserved + need - self.limit
        if must_leave <= 0:
            return now
        if must_leave > reading.used:
            # Units promised to calls not yet started hold the room: they start at the earliest
            # now, so their slots free one span from now at the earliest.
            return now + self.span
        if reading.leaves_at is None:
            return None
        oldest = reading.leaves_at(must_leave)
        return None if oldest is None else oldest + self.span + US

    def queue_frees_at(self, reading: Reading, now: datetime, queued: int, need: int) -> datetime | None:
        # Units in start order: the window's own (c <= used, started at a_c), then the queue's.
        # Unit c > used starts at S(c) = max(now, S(c - limit) + span): one span per whole
        # window of units before it, from the oldest start it waits for (or from now).
        last = reading.used + queued + need
        if last <= self.limit:
            return now
        steps = math.ceil((last - reading.used) / self.limit)
        base = last - steps * self.limit
        first = now  # the chain's first unit is within ``limit`` of the oldest: it fits now
        if base >= 1:
            oldest = reading.leaves_at(base) if reading.leaves_at is not None else None
            if oldest is None:
                return None
            first = max(now, oldest + self.span + US)
        return first + (steps - 1) * (self.span + US)

    def explain(self) -> str:
        return f"{self.label()} (sliding window: at most {self.limit} in any {self._period_text()})"

    def drain(self, room_now: int, units: int) -> timedelta:
        beyond = units - max(room_now, 0)
        return self.span * math.ceil(beyond / self.limit) if beyond > 0 else timedelta(0)

    def _period_text(self) -> str:
        return format_duration(self.period)


@dataclass(frozen=True)
class TokenBucket(Policy):
    """Tokens refill at ``limit`` per ``period`` up to ``burst``; a start takes its cost in tokens.

    Kept as GCRA: one timestamp ``tat`` (when the bucket is full again). A start of n units at
    t is admitted when ``max(tat, t) + n * interval - t <= burst * interval``; it moves ``tat``
    to ``max(tat, t) + n * interval``. Tokens at t are ``burst - max(tat - t, 0) / interval``.
    """

    shape: ClassVar[str] = "bucket"
    burst: int = 1
    # Send-time pacing: how long after its start a request is held before it goes out (the
    # worker holds it, ``dispatcher.arrivals``). The bucket judges and charges a start at
    # ``now + hold``, the moment its request leaves, so the guard covers only what follows:
    # the network's spread (``net``, the configured guard) and how late after its moment the
    # request may go out (``lateness``).
    hold: timedelta = field(default=timedelta(0), compare=False)
    net: timedelta = field(default=timedelta(0), compare=False)

    # The guard: arrivals a_i = s_i + d_i with 0 <= d_i <= g. Starts conforming to (B - k,
    # T + e) put n > B arrivals at least (n - B + k)(T + e) - g apart, which is at least
    # (n - B) T, what the API's bucket asks, once k T + (1 + k) e >= g. Whole intervals of the
    # guard come out of the burst (k, no cost in sustained rate); the rest slows the rate (e),
    # unless that would cost more than GUARD_RATE_SHARE of it and one more token can be held back.
    #
    # A call larger than the depth (B - k) still fits, alone (``alone``): the proof above needs
    # less than the depth. Write T' = T + e, I_j = c_j T' and X = B T + (B + 1) e - g. Admit
    # start j when tat_{j-1} + I_j - s_j <= X, tat *not* clamped to s_j (tat_{j-1} the state
    # after every earlier start, -inf for a bucket never charged; the update stays
    # tat_j = max(tat_{j-1}, s_j) + I_j). As tat_{j-1} = max_{i<j} (s_i + I_i + ... + I_{j-1}),
    # every run i < j of consecutive starts then has sum_{i..j} c_m T' <= s_j - s_i + X.
    # At the API, take the calls S arriving within [a, a + L] in total C > B units: C > B >= any
    # c, so S has two starts or more; its first start i and last start j lie within [a - g, a + L],
    # so C T' <= L + g + X, i.e. L >= C T' - X - g = (C - B) T + (C - B - 1) e >= (C - B) T:
    # what the API's bucket (B, T) asks of arrivals, for any costs and any order of delays.
    # The clamped rule of ``room`` is the same rule with X' = (B - k) T' <= X (that is k T +
    # (1 + k) e >= g again), so the two mix freely. Unclamped, a call of c <= B units waits at
    # most c T' - X <= g - e after the bucket is full: a learnt guard takes whole intervals
    # out of the burst (no rate lost while the burst holds it), and a call send() accepted under
    # the configured guard (c <= B - k_0 <= B) still starts, at the latest g after the bucket is
    # full again (when nothing else started meanwhile: ``frees_at`` says when).

    GUARD_RATE_SHARE: ClassVar[Fraction] = Fraction(1, 20)
    # A held bucket whose guard no token can hold back (a smooth rate) gives it at most this share
    # of its rate, the network's part cut to fit (docs/policies.md, send-time pacing): 2%, so
    # that what a smooth rate loses besides (late requests moving it on) stays under 5%...
    HELD_RATE_SHARE: ClassVar[Fraction] = Fraction(2, 100)
    # ...but never less than this for the network: an API on a busy host stamps a request a few
    # milliseconds late at times (nginx behind a loaded 2-core machine: up to 4-6 ms, 429s with
    # requests paced exactly 51.5 ms apart for 20 per second; docs/performance.md).
    HELD_NET_FLOOR: ClassVar[timedelta] = timedelta(milliseconds=5)
    # How late a held request of a bucket whose guard its burst holds back may go out: the
    # requests of a burst go out together from several workers, where a late one could move the
    # bucket on only as the last start charged on it (a few ms apart, they missed their sends).
    HELD_BURST_SLACK: ClassVar[timedelta] = timedelta(milliseconds=20)

    @property
    def reserve(self) -> int:
        """Tokens of the burst held back by the guard."""
        if self.guard <= timedelta(0):
            return 0
        g, t = Fraction(_us(self.guard)), self._interval_exact
        k = min(self.burst - 1, math.floor(g / t))
        if k + 1 <= self.burst - 1 and self._extra(k) > self.GUARD_RATE_SHARE * t:
            k += 1
        return k

    def _costs_rate(self) -> bool:
        """Whether the guard lengthens the interval (by a microsecond or more)."""
        return self._extra(self.reserve) >= 1

    def _extra(self, k: int) -> Fraction:
        return max(Fraction(0), (Fraction(_us(self.guard)) - k * self._interval_exact) / (1 + k))

    @property
    def _interval_exact(self) -> Fraction:
        return Fraction(_us(self.period), self.limit)

    @property
    def interval(self) -> Fraction:
        """Microseconds per unit as applied: the API's interval, lengthened by what the burst does not absorb."""
        return self._interval_exact + self._extra(self.reserve)

    @property
    def tolerance(self) -> Fraction:
        """Microseconds: the most ``tat + cost * interval`` may lie beyond a start's time (X above)."""
        return (
            self.burst * self._interval_exact + (self.burst + 1) * self._extra(self.reserve) - _us(self.guard)
        )

    @property
    def depth(self) -> int:
        """The burst as applied (the API's burst less the guard's reserve)."""
        return self.burst - self.reserve

    def capacity(self) -> int:
        return self.depth

    def with_hold(self, net: timedelta, hold: timedelta, slack: timedelta) -> TokenBucket:
        """Return the policy for starts whose requests are held ``hold`` after them: its guard
        covers the network (``net``) and the ``slack`` a request may go out after its moment.

        A guard the burst holds back in whole tokens costs no rate (one more token is held back
        where that covers it all): a request may then go out HELD_BURST_SLACK late, as far as the
        tokens held back cover, as a burst's requests go out together from several workers. A
        guard that slows the rate (a smooth rate: no token to hold back) costs at most
        HELD_RATE_SHARE of it: the network's part is cut to fit (never below HELD_NET_FLOOR).
        """
        held = type(self)(**{**self.__dict__, "guard": net + slack, "hold": hold, "net": net})
        k, budget = held.reserve, _floor_td(self.HELD_RATE_SHARE * self._interval_exact)
        if (
            held._extra(k) > Fraction(_us(budget)) and k + 1 <= self.burst - 1
            and (k + 1) * self._interval_exact >= _us(held.guard)
        ):
            # One more token held back covers the whole guard: no rate lost to it.
            held = type(self)(**{**held.__dict__, "guard": _ceil_us((k + 1) * self._interval_exact)})
        if held._costs_rate() and held._extra(held.reserve) > Fraction(_us(budget)) and net + slack > budget:
            net = min(net, max(budget - slack, self.HELD_NET_FLOOR))
            held = type(self)(**{**held.__dict__, "guard": net + slack, "net": net})
        if not held._costs_rate() and held.reserve > 0:
            covered = _floor_td(held.reserve * self._interval_exact)
            wider = type(self)(**{**held.__dict__, "guard": max(held.guard, min(net + self.HELD_BURST_SLACK, covered))})
            if wider.reserve == held.reserve and not wider._costs_rate():
                return wider
        return held

    @property
    def lateness(self) -> timedelta:
        """How late after its send moment a held request may go out: what the guard covers beyond
        the network's part (the slack)."""
        return max(self.guard - self.net, timedelta(0))

    def tokens(self, reading: Reading, now: datetime) -> Fraction:
        """Return the tokens in the bucket at ``now`` (negative while it owes units)."""
        now += self.hold
        owed = max(_us(reading.tat - now), 0) if reading.tat is not None else 0
        return self.depth - Fraction(owed) / self.interval

    def room(self, reading: Reading, now: datetime, reserved: int = 0) -> int:
        return math.floor(self.tokens(reading, now)) - reserved

    def alone(self, reading: Reading, now: datetime, reserved: int = 0) -> int:
        """Return the most units one call may cost and start at ``now``, ``reserved`` units being
        promised already: ``room``, or more on a bucket full for a while when nothing is promised
        (the unclamped rule: tat + cost * interval - now <= tolerance, at most the API's burst)."""
        room = self.room(reading, now, reserved)
        if reserved > 0:
            return room
        if reading.tat is None:
            return max(room, self.burst)
        fits = math.floor((self.tolerance - _us(reading.tat - now - self.hold)) / self.interval)
        return max(room, min(self.burst, fits))

    def frees_at(self, reading: Reading, now: datetime, need: int, reserved: int = 0) -> datetime | None:
        if self.alone(reading, now, reserved) >= need:
            return now
        # Judged at the send moment: a start ``hold`` earlier sends then.
        held = self._frees_at(reading, now + self.hold, need, reserved)
        return max(now, held - self.hold)

    def _frees_at(self, reading: Reading, now: datetime, need: int, reserved: int) -> datetime:
        base = max(reading.tat, now) if reading.tat is not None else now
        # The bucket holds ``need + reserved`` tokens once tat - t <= (depth - need - reserved) * interval.
        when = max(now, base - _floor_td((self.depth - need - reserved) * self.interval))
        if reserved == 0 and need <= self.burst and reading.tat is not None:
            # Alone, the call fits once tat + need * interval - t <= tolerance (sooner for a call
            # above the depth, which the clamped rule never admits).
            when = min(when, max(now, reading.tat + _ceil_us(need * self.interval - self.tolerance)))
        return when

    def promised(self, reading: Reading, since: datetime, units: int) -> Reading:
        """Return the reading once ``units`` promised to calls not started yet have started, in
        turn, each as soon as the bucket admits it from ``since`` on (GCRA charges them as one):
        a dispense judging ahead of ``since`` may then promise the calls whose turns come within
        its look-ahead, not only once the ones before have started (each start is judged again,
        on the clock of then)."""
        return Reading(tat=self.charge(reading, since, units))

    def charge(self, reading: Reading, now: datetime, cost: int) -> datetime:
        now += self.hold  # the send moment
        base = max(reading.tat, now) if reading.tat is not None else now
        # Rounded up: the bucket refills at most as fast as the policy says.
        return base + _ceil_us(cost * self.interval)

    def refund(
        self, tat: datetime | None, now: datetime, units: int, later: Sequence[tuple[datetime, int]] = ()
    ) -> datetime | None:
        """Return the bucket state after ``units`` of one start are given back (negative: charged more).

        ``later``: the (time, units) of every start charged after the refunded one, in order
        (starts at the same instant may be included: they only make the refund smaller). GCRA's
        state after starts s_1..s_n is max(tat_0 + T * sum(c), max_k(t_k + T * sum(c_k..c_n))),
        so without start j it is max(tat - c_j * T, the state the starts after j make alone):
        the part of c_j that had already refilled before a later start is not given back twice.
        """
        if tat is None:
            return None if units >= 0 else now + _ceil_us(-units * self.interval)
        if units < 0:
            return max(tat, now) + _ceil_us(-units * self.interval)
        back = tat - _floor_td(units * self.interval)
        alone = self.replay(later)
        if alone is not None:
            back = max(back, alone)
        # Never more than it was: a start the bucket did not charge gives nothing back.
        return min(tat, back)

    def replay(self, starts: Sequence[tuple[datetime, int]]) -> datetime | None:
        """Return the state an empty bucket reaches after ``starts`` ((time, units) in order)."""
        tat: datetime | None = None
        for at, units in starts:
            tat = self.charge(Reading(tat=tat), at, units)
        return tat

    @overload
    def rebase(self, tat: datetime, now: datetime, new: TokenBucket) -> datetime: ...
    @overload
    def rebase(self, tat: None, now: datetime, new: TokenBucket) -> None: ...

    def rebase(self, tat: datetime | None, now: datetime, new: TokenBucket) -> datetime | None:
        """Return the state under an edited policy, carrying the units still owed (not the time).

        What is carried is re-judged: this bucket never owes more than its depth plus one cost
        correction (``costs.bounded_charge``, at most its depth again). A stored state beyond that
        (written before corrections were bounded, or by hand) carries that bound, so an edit to a
        looser policy frees a key such a state froze rather than carrying its wait.
        """
        if tat is None or tat <= now:
            return tat
        owed: Fraction = min(Fraction(_us(tat - now)) / self.interval, Fraction(2 * self.depth))
        return now + _ceil_us(owed * new.interval)

    def explain(self) -> str:
        if self.burst == 1:
            return f"{self.label()} (smooth rate: one every {self._interval_text()})"
        return f"{self.label()} (token bucket)"

    def drain(self, room_now: int, units: int) -> timedelta:
        beyond = units - max(room_now, 0)
        return _ceil_us(beyond * self.interval) if beyond > 0 else timedelta(0)

    def label(self) -> str:
        return f"{super().label()}, burst {self.burst}"

    @property
    def horizon(self) -> timedelta:
        """The time an emptied bucket takes to fill again: older starts no longer bear on it."""
        return _ceil_us(self.burst * self._interval_exact)

    def _interval_text(self) -> str:
        return f"{float(self._interval_exact) / 1000:g}ms"


def _floor_td(value: Fraction) -> timedelta:
    return timedelta(microseconds=math.floor(value))


def make_policy(
    key: str,
    limit: int,
    period: timedelta,
    burst: int | None = None,
    concurrency: int | None = None,
    guard: timedelta = timedelta(0),
) -> Policy:
    """Return the policy object for a stored row: a bucket with a burst, else a sliding window."""
    if burst is None:
        return SlidingWindow(key, limit, period, concurrency, guard)
    return TokenBucket(key, limit, period, concurrency, guard, burst)


MAX_INT = 2**31 - 1


def validate(limit: object, period: object, burst: object = None, concurrency: object = None) -> None:
    """Raise a PolicyError if the numbers cannot make a policy."""

    def whole(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INT:
            raise PolicyError(f"{name} must be a whole number between 1 and {MAX_INT}, not {value!r}")
        return value

    units = whole("limit", limit)
    if not isinstance(period, timedelta) or period <= timedelta(0):
        raise PolicyError(f"period must be a duration greater than zero, not {period!r}")
    if period < timedelta(milliseconds=1):
        raise PolicyError(f"period must be at least 1ms, not {period!r}")
    if concurrency is not None:
        whole("concurrency", concurrency)
    if burst is not None:
        whole("burst", burst)
        if _us(period) < units:
            # A bucket's interval (period / limit) below a microsecond cannot be kept on the clock.
            raise PolicyError(
                f"a burst needs a period of at least one microsecond per unit: {limit} per {period} is too fast"
            )
