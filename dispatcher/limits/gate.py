"""The check: each key's readings under its lock, its room for a call, why it holds one (``states.WaitKind``), and what a start writes."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, models

from dispatcher import arrivals, tables
from dispatcher.clock import from_us, to_us
from dispatcher.keys import parse_key_set
from dispatcher.limits.catalog import Policies, kept_policies, reread_unless_kept
from dispatcher.limits.guard import LateStart, delay_memory, late_in_window, late_starts, merged_leaves_at
from dispatcher.limits.locks import alias
from dispatcher.limits.shapes import Policy as PolicyShape
from dispatcher.limits.shapes import Reading, SlidingWindow, TokenBucket
from dispatcher.states import CallStatus, WaitKind
from dispatcher.store import call_sql, limit_sql, prepared, schema

if TYPE_CHECKING:
    from dispatcher.models import KeyState

_DURATION: models.DurationField[timedelta, timedelta] = models.DurationField()


UNLIMITED = 10**9


@dataclass
class Read:
    """What a start read in one statement: readings and running calls of its keys (see ``read_keys``)."""

    readings: dict[str, list[Reading]]
    running: dict[str, int]


def policies_for_start(
    keys: Sequence[str], states: Mapping[str, KeyState], using: str | None = None
) -> tuple[Policies, datetime, Read | None]:
    """Return the policies, the database clock and, when it could, what the keys' policies read;
    call after ``lock_keys``.

    On PostgreSQL a process keeps the policies it read last: one statement then reads the clock,
    the policies' version and the keys' probes (computed with the kept policies); only if the
    version moved or a kept learnt limit expired, a second reads the policies and the probes are
    not returned (``assess`` reads them with the policies of now). Exact as reading the policies
    at every start: the version is read after the lock wait, so an edit committed before it
    binds this start; the policies read after it are as new or newer (kept with the version
    read, a newer edit is read again at the next start).
    """
    db = alias(using)
    kept = kept_policies(db)
    if kept is None or not schema.postgresql_path(db):
        policies, now = Policies.load_with_clock(db)
        return policies, now, None
    policies = kept[1].fresh()
    # The start's clock: its worker measures the send against it, and holds a request from it.
    now, current, read = clock_and_read(keys, states, policies, db, start=True)
    reread = reread_unless_kept(db, kept, current, now)
    return (policies, now, read) if reread is None else (reread, now, None)


def clock_and_read(
    keys: Sequence[str], states: Mapping[str, KeyState], policies: Policies, db: str, *,
    ahead: timedelta = timedelta(0), unflushed: bool = False, start: bool = False,
) -> tuple[datetime, int | None, Read]:
    """Guard the keys' policies (the probes read each window over its guarded span; before the
    clock, with the largest delay a key remembers), then read the database clock, the policies'
    version and the keys' probes judged ``ahead`` of it, in one statement (PostgreSQL). ``start``:
    the clock is a start's, which its worker measures the send against (``arrivals``)."""
    policies.apply_guards(keys, states, None)
    governed = {key: governing for key in keys if (governing := policies.for_key(key))}
    kinds, params = _probes(governed, lambda span: span - ahead, db)
    with prepared.cursor(db) as cursor, (arrivals.reading_clock() if start else contextlib.nullcontext()):
        cursor.execute(limit_sql.clock_readings(kinds, unflushed), params)
        row = cursor.fetchone()
    readings, running = _from_probes(governed, states, iter(row[2:]), db, row[0] + ahead)
    return row[0], row[1], Read(readings, running)


@dataclass(frozen=True)
class Verdict:
    """How many more units a key set may take now, and if none, why and until when."""

    room: int
    until: datetime | None = None
    reason: str = ""
    key: str = ""
    kind: WaitKind | None = None
    # The most units one call may cost and start now with nothing else promised, where more
    # than ``room`` (a bucket full for a while admits one call beyond its depth: TokenBucket.alone).
    alone: int | None = None

    @property
    def blocked(self) -> bool:
        return self.room <= 0

    @property
    def largest(self) -> int:
        """The most units one call may cost and start now (``room`` unless ``alone`` says more)."""
        return self.room if self.alone is None else max(self.room, self.alone)


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """Return the tightest of several verdicts (the smallest room, the latest wait)."""
    if not verdicts:
        return Verdict(room=UNLIMITED)
    tightest = min(verdicts, key=lambda v: v.room)
    if tightest.room > 0:
        largest = min(v.largest for v in verdicts)
        return tightest if largest == tightest.largest else dataclasses.replace(tightest, alone=largest)
    blocked = [v for v in verdicts if v.room <= 0]
    known = [(v.until, v) for v in blocked if v.until is not None]
    if len(known) < len(blocked):
        return next(v for v in blocked if v.until is None)
    return max(known, key=lambda pair: pair[0])[1]


def read_policies(
    governed: Mapping[str, Sequence[PolicyShape]], states: Mapping[str, KeyState], now: datetime, using: str | None = None,
) -> dict[str, list[Reading]]:
    """Return, per key, what storage says about each of its policies at ``now``; one query."""
    return read_keys(governed, states, now, using)[0]


def read_keys(
    governed: Mapping[str, Sequence[PolicyShape]], states: Mapping[str, KeyState], now: datetime, using: str | None = None,
) -> tuple[dict[str, list[Reading]], dict[str, int]]:
    """Return, per key, what storage says about each of its policies at ``now``, and, for the keys
    with a concurrency cap, how many of their calls are running; one query.

    A window: the units in it, its key's running total less the running total before the
    window's first start (an index probe, whatever the window holds). A bucket: its timestamp.
    Running calls are counted from the calls themselves (no counter: a finish locks no key).
    """
    if not governed:
        return {}, {}
    # All probes in one row; hand-written because the ORM compiles many filtered subqueries
    # more slowly than the database runs them.
    db = alias(using)
    adapt = connections[db].ops.adapt_datetimefield_value
    kinds, params = _probes(governed, lambda span: adapt(now - span), db)
    with prepared.cursor(db) as cursor:
        cursor.execute(limit_sql.policy_readings(kinds, connections[db].vendor == "postgresql"), params)
        row = iter(cursor.fetchone())
    return _from_probes(governed, states, row, db, now)


def _probes(
    governed: Mapping[str, Sequence[PolicyShape]], window_start: Callable[[timedelta], object], db: str
) -> tuple[tuple[str, ...], list[Any]]:
    """Return the kinds of the probes ``read_keys`` reads (``limit_sql.policy_readings``) and their parameters;
    ``window_start`` gives the parameter of a window of a given span."""
    connection = connections[db]
    kinds: list[str] = []
    params: list[Any] = []
    for key, policies in governed.items():
        for policy in policies:
            if isinstance(policy, TokenBucket):
                kinds.append("bucket")
                params += [key, _DURATION.get_db_prep_value(policy.period, connection)]
            elif isinstance(policy, SlidingWindow):
                kinds.append("window")
                params += [key, window_start(policy.span)]
            else:
                raise TypeError(f"no reading for a {type(policy).__name__}")
    for key, policies in governed.items():
        if any(p.concurrency for p in policies):
            kinds.append("running")
            params.append(key)
    return tuple(kinds), params


def _from_probes(
    governed: Mapping[str, Sequence[PolicyShape]], states: Mapping[str, KeyState], row: Iterator[Any], db: str,
    now: datetime,
) -> tuple[dict[str, list[Reading]], dict[str, int]]:
    readings: dict[str, list[Reading]] = {}
    for key, policies in governed.items():
        state = states.get(key)
        total, late = getattr(state, "total", 0) or 0, late_starts(state)
        readings[key] = [reading(key, policy, next(row), total, db, late, now) for policy in policies]
    running = {key: next(row) for key, policies in governed.items() if any(p.concurrency for p in policies)}
    return readings, running


def running_by_key(keys: Iterable[str] | None = None, using: str | None = None) -> dict[str, int]:
    """Return how many calls are running per key (of ``keys`` if given); for display and signals."""
    wanted = set(keys) if keys is not None else None
    counts: dict[str, int] = {}
    with connections[alias(using)].cursor() as cursor:
        cursor.execute(call_sql.running_calls("key_set"), [CallStatus.RUNNING])
        key_sets = [row[0] for row in cursor.fetchall()]
    for text in key_sets:
        for key in parse_key_set(text):
            if wanted is None or key in wanted:
                counts[key] = counts.get(key, 0) + 1
    return counts


def reading(
    key: str, policy: PolicyShape, value: int | None, total: int, db: str, late: Sequence[LateStart], now: datetime
) -> Reading:
    """A policy's reading from what storage holds: a bucket's state (``value``, its TAT in us), or
    a window's running total before its span (``value``; None: no start in it) against the key's
    ``total``, with the key's ``late`` starts its span no longer counts from the log. Which unit
    leaves next is read only when asked (``leaves_at``)."""
    if isinstance(policy, TokenBucket):
        return Reading(tat=from_us(value) if value is not None else None)
    base = total if value is None else value
    logged = functools.partial(_unit_leaves_at, db, key, base)
    counted = late_in_window(late, now, policy.period, policy.span) if late and isinstance(policy, SlidingWindow) else []
    if not counted:
        return Reading(used=total - base, leaves_at=logged)
    # A late start leaves the window a period after its arrival: as a start of the log would
    # that started ``reach`` less the window's guard after it (all its units together).
    leaving = sorted((s.arrives_by() - policy.guard, s.units) for s in counted)
    used = total - base + sum(units for _, units in leaving)
    return Reading(used=used, leaves_at=functools.partial(merged_leaves_at, leaving, logged))


def _unit_leaves_at(db: str, key: str, base: int, n: int) -> datetime | None:
    """Return the start time of the start that holds the n-th unit after ``base``: one index probe."""
    return (
        tables.StartLog.objects.using(db).filter(key=key, cum__gte=base + n).order_by("cum", "id").values_list("started_at", flat=True).first()
    )


def check_key(
    key: str,
    state: KeyState,
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    readings: Sequence[Reading] | None = None,
    cost: int = 1,
    using: str | None = None,
    running: int | None = None,
    since: datetime | None = None,
) -> Verdict:
    """Return the room (in units) a key has now for a call of ``cost`` units.

    For a dispense (``for_start=False``) calls already dispatched but not started count as
    if they had started; at the start itself only real starts and running calls count.
    ``readings`` are the key's policy readings and ``running`` its running calls if already read
    (see ``read_keys``). ``since``: a dispense judging ahead of its clock (``now`` is ahead of
    ``since``) counts the units it promised a bucket as starting in turn from ``since`` on
    (``TokenBucket.promised``), so a smooth rate has its next calls claimed as far ahead as
    the pass looks, not only once the one before has started.
    """
    paused_until = _paused_until(key, state, now, policies)
    if paused_until is not None:
        return Verdict(room=0, until=paused_until, reason="paused", key=key, kind=WaitKind.PAUSED)
    governing = policies.for_key(key)
    if not governing:
        return Verdict(room=UNLIMITED)
    reserved = 0 if for_start else max(state.reserved, 0)
    reserved_units = 0 if for_start else max(getattr(state, "reserved_units", 0) or 0, 0)
    verdicts: list[Verdict] = []
    caps = [p.concurrency for p in governing if p.concurrency]
    if caps and (readings is None or running is None):
        found, counts = read_keys({key: governing}, {key: state}, now, using)
        readings, running = found[key], counts[key]
    if caps:
        cap = min(caps)
        busy = (running or 0) + reserved
        verdicts.append(Verdict(
            room=cap - busy, until=None, reason=f"concurrency {busy}/{cap}", key=key,
            kind=WaitKind.CONCURRENCY if cap - busy <= 0 else None,
        ))
    if readings is None:
        readings = read_policies({key: governing}, {key: state}, now, using)[key]
    for policy, reading in zip(governing, readings, strict=True):
        promised = reserved_units
        if since is not None and promised and isinstance(policy, TokenBucket):
            reading, promised = policy.promised(reading, since, promised), 0
        room = policy.room(reading, now, promised)
        alone = policy.alone(reading, now, promised) if promised == reserved_units else room
        learnt = any(policy is p for p in policies.learnt.get(key, ()))
        if learnt and room >= policy.capacity():
            # An API may announce less than one call costs: in a window empty of others, one call
            # of any cost goes alone (refusing it until the lesson expires would hold it an hour
            # under a reason that says it frees sooner).
            alone = UNLIMITED
        if learnt and cost > policy.capacity():
            if room >= policy.capacity():
                verdicts.append(Verdict(room=cost, key=key, alone=UNLIMITED))
                continue
            verdicts.append(Verdict(
                room=0, until=policy.frees_at(reading, now, policy.capacity(), promised),
                reason=f"{policy.label()} used", key=key, kind=WaitKind.LEARNT,
            ))
            continue
        if room >= cost:
            verdicts.append(Verdict(room=room, key=key, alone=alone if alone > room else None))
            continue
        if alone >= cost:
            # A call beyond the bucket's depth, alone on a bucket full long enough.
            verdicts.append(Verdict(room=cost, key=key, alone=alone))
            continue
        until = policy.frees_at(reading, now, cost, promised)
        verdicts.append(Verdict(
            room=0, until=until, reason=f"{policy.label()} used", key=key, kind=WaitKind.LEARNT if learnt else WaitKind.RATE,
        ))
    return combine(verdicts)


@dataclass
class Assessment:
    """Each key's verdict, and the readings and running calls it was judged on (a start writes from them)."""

    verdicts: dict[str, Verdict]
    readings: dict[str, list[Reading]]
    running: dict[str, int] = field(default_factory=dict)


def assess(
    keys: Sequence[str],
    states: Mapping[str, KeyState],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    costs: Mapping[str, int] | None = None,
    using: str | None = None,
    read: Read | None = None,
    since: datetime | None = None,
) -> Assessment:
    """Judge every key, reading all their policies in one query (none if ``read`` has them).

    Each key's policies take the arrival guard its measured delays call for first; with ``read``,
    ``policies_for_start`` applied them before it read the keys' probes. A held key whose
    buckets are all full goes unheld (``Policies.release``): a bucket's reading does not depend
    on the guard, and the guard with the whole delay admits a call at once.
    """
    if read is None:
        spans = policies.apply_guards(keys, states, now)
    else:
        spans = {k: policies.spans[k] for k in keys if k in policies.spans}
    governed = {k: policies.for_key(k) for k in keys}
    # A paused key needs no reading: nothing is admitted until the pause ends.
    to_read = {
        k: governing for k, governing in governed.items()
        if governing and _paused_until(k, states[k], now, policies) is None
    }
    readings, running = (read.readings, read.running) if read is not None else read_keys(to_read, states, now, using)
    for key in [k for k in keys if k in policies.holds and readings.get(k)]:
        if all(r.tat is None or r.tat <= now for r in readings[key]):
            policies.release(key)
    if for_start:
        holds, reach = policies.send_holds()
        arrivals.note_start(arrivals.Noted(
            spans, {k: delay_memory(states.get(k)) for k in spans}, now, dict(policies.learnt_delays),
            {k: [p.period for p in policies.for_key(k) if isinstance(p, TokenBucket)] for k in spans},
            holds, reach, policies.learning_windows(spans), {},
        ))
    costs = costs or {}
    verdicts = {
        k: check_key(
            k, states[k], now, policies, for_start=for_start, readings=readings.get(k, []), cost=costs.get(k, 1),
            running=running.get(k, 0), since=since,
        )
        for k in keys
    }
    return Assessment(verdicts, readings, running)


def check_each_key(
    keys: Sequence[str],
    states: Mapping[str, KeyState],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    using: str | None = None,
    since: datetime | None = None,
) -> dict[str, Verdict]:
    """Return the room of each key, reading all their policies in one query."""
    return assess(keys, states, now, policies, for_start=for_start, using=using, since=since).verdicts


def _paused_until(key: str, state: KeyState, now: datetime, policies: Policies) -> datetime | None:
    """Return when the key's own pause or its pattern's ends, if one lasts beyond now."""
    paused = [t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now]
    return max(paused, default=None)


@dataclass
class StartRecord:
    """What one start writes: log rows (key, units, running total) and bucket states (key, period, tat)."""

    log: list[tuple[str, int, int]] = field(default_factory=list)
    buckets: list[tuple[str, timedelta, int]] = field(default_factory=list)
    # Per bucket, the microseconds the start charged beyond max(tat, now + hold): a start recorded
    # at a later clock carries the same charge from there (call_sql.mark_running_group). Not from
    # there plus the hold: the worker holds the request from the clock it was judged on, so a
    # later mark sends it no later than the mark (what the carry bounds), and a request that goes
    # out later than its moment allows is settled before it goes (``arrivals.release``).
    charged: list[int] = field(default_factory=list)


def start_record(
    keys: Sequence[str],
    states: Mapping[str, KeyState],
    assessment: Assessment,
    policies: Policies,
    now: datetime,
    costs: Mapping[str, int],
) -> StartRecord:
    """Return what a start of the given costs at ``now`` changes, from the readings it was admitted on."""
    record = StartRecord()
    for key in keys:
        units = costs.get(key, 1)
        record.log.append((key, units, (states[key].total or 0) + units))
        for policy, reading in zip(policies.for_key(key), assessment.readings.get(key, []), strict=False):
            tat = policy.charge(reading, now, units)
            if tat is not None:
                record.buckets.append((key, policy.period, to_us(tat)))
                # A held start is charged from its send moment, ``hold`` after the start.
                held = getattr(policy, "hold", timedelta(0))
                base = max(reading.tat, now + held) if reading.tat is not None else now + held
                record.charged.append(to_us(tat) - to_us(base))
    return record


class Group:
    """Calls started together (one message): each admitted call counts against the next.

    Built on the keys' readings under their locks at ``now``; ``admit`` moves the readings, the
    running totals and the running calls as the call's start will, so ``check`` judges the next
    call as a start after it would be judged.
    """

    def __init__(self, states: Mapping[str, KeyState], policies: Policies, now: datetime, assessment: Assessment):
        self.states, self.policies, self.now = states, policies, now
        self.readings = {key: list(found) for key, found in assessment.readings.items()}
        self.running = dict(assessment.running)
        # What storage said of each window: its units and where they start (the group's own
        # starts come after them, all at ``now``).
        self.stored = {key: [(r.used, r.leaves_at) for r in found] for key, found in self.readings.items()}
        # What storage said of each bucket (µs, None: none stored): a late request may move it on
        # before the group's start writes it (``call_sql._start_writes`` carries the move).
        self.read_tats = {
            (key, policy.period): None if reading.tat is None else to_us(reading.tat)
            for key, found in self.readings.items()
            for policy, reading in zip(policies.for_key(key), found, strict=False) if isinstance(policy, TokenBucket)
        }

    def check(self, keys: Sequence[str], costs: Mapping[str, int]) -> Verdict:
        return combine([
            check_key(
                key, self.states[key], self.now, self.policies, for_start=True, readings=self.readings.get(key, []),
                cost=costs.get(key, 1), running=self.running.get(key, 0),
            )
            for key in keys
        ])

    def admit(self, keys: Sequence[str], costs: Mapping[str, int]) -> StartRecord:
        """Return what the call's start writes, and count it."""
        record = start_record(
            keys, self.states, Assessment({}, self.readings, self.running), self.policies, self.now, costs
        )
        for key in keys:
            units = costs.get(key, 1)
            self.states[key].total = (self.states[key].total or 0) + units
            governing = self.policies.for_key(key)
            self.readings[key] = [
                Reading(tat=policy.charge(reading, self.now, units)) if isinstance(policy, TokenBucket)
                else Reading(
                    used=reading.used + units, leaves_at=functools.partial(_leaves_at_in_group, *stored, self.now)
                )
                for policy, reading, stored in zip(governing, self.readings.get(key, []), self.stored.get(key, []), strict=False)
            ]
            if any(p.concurrency for p in governing):
                self.running[key] = self.running.get(key, 0) + 1
        return record


def _leaves_at_in_group(
    stored_used: int, stored_leaves_at: Callable[[int], datetime | None] | None, now: datetime, n: int
) -> datetime | None:
    """When the n-th unit of a window leaves it, counting a group's own starts (at ``now``) after the stored ones."""
    if n > stored_used:
        return now
    return stored_leaves_at(n) if stored_leaves_at is not None else None
