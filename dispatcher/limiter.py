"""The limiter: policies per key, per-key locks and counters, the start log and bucket state.

Every check happens inside the caller's transaction after ``lock_keys`` has locked the
``KeyState`` rows of all the call's keys (sorted, so two lockers never deadlock), and reads
the database clock after that lock wait. What a policy admits is decided by its pure object
(``dispatcher.policies``); this module only reads and writes what those objects need: a
window's units (the key's running total less the total before the window's first start, two
index probes) and a bucket's one timestamp per key and policy.
"""
from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.db import connection, models
from django.db.models import Q

from dispatcher import arrivals, sql
from dispatcher.keys import is_pattern, pattern_matches
from dispatcher.policies import (
    DelayMemory,
    Reading,
    SlidingWindow,
    TokenBucket,
    arrival_guard,
    learnt_delay,
    make_policy,
    memory,
    remember_delay,
    validate,
)
from dispatcher.policies import Policy as PolicyShape

UNLIMITED = 10**9
# Marks learnt limits among the policy rows (no real policy has a negative concurrency).
LEARNT = -1
# The channel on which send(), finishes and policy edits wake long-running dispensers.
WAKE_CHANNEL = "dispatcher_wake"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION = models.DurationField()

# A sliding window built from keyword arguments, as other sources of policies (learnt limits)
# construct them: Policy(key=..., limit=..., period=...).
Policy = SlidingWindow


def to_us(moment: datetime) -> int:
    return (moment - EPOCH) // timedelta(microseconds=1)


def from_us(value: int) -> datetime:
    return EPOCH + timedelta(microseconds=value)


@dataclass
class Policies:
    """All policies and pattern pauses, loaded once per dispense pass or start."""

    exact: dict[str, list[PolicyShape]] = field(default_factory=dict)
    patterns: list[tuple[str, list[PolicyShape]]] = field(default_factory=list)
    pattern_pauses: dict[str, datetime] = field(default_factory=dict)
    # Limits an API announced (dispatcher.learning), applied on top of the key's own policies.
    learnt: dict[str, list[Policy]] = field(default_factory=dict)
    # Per key, the arrival guard learnt from its measured start-to-send delays (``apply_guards``),
    # and the key's policies with it applied.
    guards: dict[str, timedelta] = field(default_factory=dict)
    learnt_delays: dict[str, timedelta] = field(default_factory=dict)
    _guarded: dict[str, list[PolicyShape]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: Iterable[PolicyShape], pattern_pauses: dict[str, datetime] | None = None) -> Policies:
        exact: dict[str, list[PolicyShape]] = {}
        grouped: dict[str, list[PolicyShape]] = {}
        for policy in rows:
            target = grouped if is_pattern(policy.key) else exact
            target.setdefault(policy.key, []).append(policy)
        # The longest (most specific) pattern wins when several match a key.
        patterns = sorted(grouped.items(), key=lambda item: len(item[0]), reverse=True)
        return cls(exact=exact, patterns=patterns, pattern_pauses=dict(pattern_pauses or {}))

    @classmethod
    def load(cls) -> Policies:
        """Read every policy and every pattern pause from the database, in one query."""
        if connection.vendor == "postgresql":
            # Runs at every start: the query is compiled once per process (it has no
            # arguments), and PostgreSQL's rows need no conversion.
            policies_sql, params = _policies_sql()
            with connection.cursor() as cursor:
                cursor.execute(policies_sql, params)
                rows = cursor.fetchall()
        else:
            rows = list(_policies_query())
        return cls._from_db_rows(rows)

    @classmethod
    def load_with_clock(cls) -> tuple[Policies, datetime]:
        """Read the policies and the database's clock (``db_now``) in one round trip."""
        if connection.vendor != "postgresql":
            from dispatcher.clock import db_now

            return cls.load(), db_now()
        # A start holds its keys' locks while it reads both: one round trip fewer under the lock.
        # The clock's subquery is evaluated once (PostgreSQL does not flatten a volatile one),
        # and the LEFT JOIN returns it even when no policy exists.
        policies_sql, params = _policies_sql()
        with connection.cursor() as cursor:
            arrivals.mark_clock()  # the start's recorded time: its worker measures the send against it
            cursor.execute(sql.policies_with_clock(policies_sql), params)
            rows = cursor.fetchall()
        return cls._from_db_rows([row[1:] for row in rows if row[1] is not None]), rows[0][0]

    @classmethod
    def _from_db_rows(cls, rows: Iterable[tuple]) -> Policies:
        from dispatcher.conf import dispatcher_settings

        guard = dispatcher_settings.ARRIVAL_GUARD
        policies: list[PolicyShape] = []
        pattern_pauses: dict[str, datetime] = {}
        learnt: dict[str, list[PolicyShape]] = {}
        for key, limit, period, burst, concurrency, until in rows:
            if concurrency == LEARNT:
                # Learnt limits are windows that absorb the same arrival guard as configured ones.
                learnt.setdefault(key, []).append(SlidingWindow(key, limit, period, None, guard))
            elif until is not None:
                pattern_pauses[key] = until
            else:
                policies.append(make_policy(key, limit, period, burst, concurrency, guard))
        loaded = cls.from_rows(policies, pattern_pauses)
        loaded.learnt = learnt
        return loaded

    def configured_for_key(self, key: str) -> list[PolicyShape]:
        """Return the policies set for a key: its exact ones, else the most specific pattern's."""
        if key in self.exact:
            return self.exact[key]
        for pattern, policies in self.patterns:
            if pattern_matches(pattern, key):
                return policies
        return []

    def for_key(self, key: str) -> list[PolicyShape]:
        """Return the policies governing a key: the ones set for it and the limits learnt for it,
        with the key's learnt arrival guard once ``apply_guards`` has set one."""
        if key in self._guarded:
            return self._guarded[key]
        learnt = self.learnt.get(key, []) if self.learnt else []
        governing = self.configured_for_key(key) + learnt
        guard = self.guards.get(key)
        if guard is None:
            return governing
        guarded = self._guarded[key] = [p if p.guard == guard else p.with_learnt_guard(guard) for p in governing]
        return guarded

    def apply_guards(self, keys: Iterable[str], states: Mapping[str, models.Model], now: datetime) -> dict[str, timedelta]:
        """Give each key's policies the guard its measured delays call for; return each key's memory span."""
        from dispatcher.conf import dispatcher_settings

        floor, cap = dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.ARRIVAL_GUARD_MAX
        spans = {}
        for key in keys:
            self._guarded.pop(key, None)
            self.guards.pop(key, None)
            governing = self.for_key(key)
            if not governing:
                continue
            span = spans[key] = memory(governing, max(floor, cap))
            learnt = self.learnt_delays[key] = learnt_delay(delay_memory(states.get(key)), now, span)
            self.guards[key] = arrival_guard(floor, cap, learnt)
        return spans

    def pattern_pause(self, key: str) -> datetime | None:
        latest = None
        for pattern, until in self.pattern_pauses.items():
            if pattern_matches(pattern, key) and (latest is None or until > latest):
                latest = until
        return latest

    def never_fits(self, costs: Mapping[str, int]) -> str | None:
        """Say which configured policy a call of these costs per key could never fit, if one.

        Learnt limits are left out: they last only until they expire.
        """
        for key, cost in costs.items():
            for policy in self.configured_for_key(key):
                if cost > policy.capacity():
                    return f"cost {cost} on key {key!r} can never fit its policy {policy.explain()}" + (
                        f" (holds {policy.capacity()} units with DISPATCHER_ARRIVAL_GUARD)"
                        if policy.capacity() < getattr(policy, "burst", policy.limit) else ""
                    )
        return None


def _policies_query() -> models.QuerySet:
    """The policies, then the pattern pauses with the policy columns empty, then the unexpired
    learnt limits marked by a concurrency of ``LEARNT``: one round trip."""
    from django.db.models.functions import Now

    from dispatcher.models import KeyState, LearntLimit, RateLimit

    policies = RateLimit.objects.order_by().annotate(until=models.Value(None, models.DateTimeField())).values_list(
        "key", "limit", "period", "burst", "concurrency", "until"
    )
    pauses = KeyState.objects.order_by().filter(key__endswith="*", paused_until__isnull=False).annotate(
        no_limit=models.Value(None, models.IntegerField()),
        no_period=models.Value(None, models.DurationField()),
        no_burst=models.Value(None, models.IntegerField()),
        no_concurrency=models.Value(None, models.IntegerField()),
    ).values_list("key", "no_limit", "no_period", "no_burst", "no_concurrency", "paused_until")
    learnt = LearntLimit.objects.order_by().filter(expires_at__gt=Now()).annotate(
        no_burst=models.Value(None, models.IntegerField()),
        marker=models.Value(LEARNT, models.IntegerField()), no_until=models.Value(None, models.DateTimeField()),
    ).values_list("key", "limit", "period", "no_burst", "marker", "no_until")
    return policies.union(pauses, learnt, all=True)


@functools.cache
def _policies_sql() -> tuple[str, tuple]:
    query = _policies_query().query
    return query.get_compiler(connection=connection).as_sql()


class Hold(enum.StrEnum):
    """Why a key has no room."""

    PAUSED = "paused"
    CONCURRENCY = "concurrency"
    RATE = "rate"


@dataclass(frozen=True)
class Verdict:
    """How many more units a key set may take now, and if none, why and until when."""

    room: int
    until: datetime | None = None
    reason: str = ""
    key: str = ""
    kind: Hold | None = None

    @property
    def blocked(self) -> bool:
        return self.room <= 0


def combine(verdicts: Sequence[Verdict]) -> Verdict:
    """Return the tightest of several verdicts (the smallest room, the latest wait)."""
    if not verdicts:
        return Verdict(room=UNLIMITED)
    tightest = min(verdicts, key=lambda v: v.room)
    if tightest.room > 0:
        return tightest
    blocked = [v for v in verdicts if v.room <= 0]
    known = [v for v in blocked if v.until is not None]
    if len(known) < len(blocked):
        return next(v for v in blocked if v.until is None)
    return max(known, key=lambda v: v.until)


def lock_keys(keys: Sequence[str]) -> dict[str, models.Model]:
    """Lock the KeyState rows of the keys, creating missing ones; call inside a transaction."""
    from dispatcher.models import KeyState

    if not keys:
        return {}
    ordered = sorted(set(keys))
    states = _select_for_update(ordered)
    if len(states) < len(ordered):
        KeyState.objects.bulk_create(
            [KeyState(key=k) for k in ordered if k not in states], ignore_conflicts=True
        )
        states = _select_for_update(ordered)
    return states


def _select_for_update(ordered: list[str]) -> dict[str, models.Model]:
    from dispatcher.models import KeyState

    if connection.vendor != "postgresql":
        return {s.key: s for s in KeyState.objects.select_for_update().filter(key__in=ordered).order_by("key")}
    # Hand-written on PostgreSQL: this runs at every claim, start and finish, and compiling
    # the ORM's locking query costs more than running it.
    with connection.cursor() as cursor:
        cursor.execute(sql.lock_key_states(), [ordered])
        rows = cursor.fetchall()
    names = [f.attname for f in KeyState._meta.concrete_fields]
    return {row[0]: KeyState.from_db(connection.alias, names, row) for row in rows}


def read_policies(
    governed: Mapping[str, Sequence[PolicyShape]], states: Mapping[str, models.Model], now: datetime
) -> dict[str, list[Reading]]:
    """Return, per key, what storage says about each of its policies at ``now``; one query.

    A window: the units in it, its key's running total less the running total before the
    window's first start (an index probe, whatever the window holds). A bucket: its timestamp.
    """
    if not governed:
        return {}
    # All probes in one row; hand-written because the ORM compiles many filtered subqueries
    # more slowly than the database runs them.
    adapt = connection.ops.adapt_datetimefield_value
    buckets, params = [], []
    for key, policies in governed.items():
        for policy in policies:
            if isinstance(policy, TokenBucket):
                buckets.append(True)
                params += [key, _DURATION.get_db_prep_value(policy.period, connection)]
            else:
                buckets.append(False)
                params += [key, adapt(now - policy.span)]
    with connection.cursor() as cursor:
        cursor.execute(sql.policy_readings(tuple(buckets)), params)
        row = iter(cursor.fetchone())
    readings: dict[str, list[Reading]] = {}
    for key, policies in governed.items():
        total = getattr(states.get(key), "total", 0) or 0
        readings[key] = [_reading(key, policy, next(row), total) for policy in policies]
    return readings


def _reading(key: str, policy: PolicyShape, value: int | None, total: int) -> Reading:
    if isinstance(policy, TokenBucket):
        return Reading(tat=from_us(value) if value is not None else None)
    base = total if value is None else value
    return Reading(used=total - base, leaves_at=functools.partial(_unit_leaves_at, key, base))


def _unit_leaves_at(key: str, base: int, n: int) -> datetime | None:
    """Return the start time of the start that holds the n-th unit after ``base``: one index probe."""
    from dispatcher.models import KeyStart

    return (
        KeyStart.objects.filter(key=key, cum__gte=base + n).order_by("cum").values_list("started_at", flat=True).first()
    )


def check_key(
    key: str,
    state: models.Model,
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    readings: Sequence[Reading] | None = None,
    cost: int = 1,
) -> Verdict:
    """Return the room (in units) a key has now for a call of ``cost`` units.

    For a dispense (``for_start=False``) calls already dispatched but not started count as
    if they had started; at the start itself only real starts and running calls count.
    ``readings`` are the key's policy readings if already read (see ``read_policies``).
    """
    paused_until = _paused_until(key, state, now, policies)
    if paused_until is not None:
        return Verdict(room=0, until=paused_until, reason="paused", key=key, kind=Hold.PAUSED)
    governing = policies.for_key(key)
    if not governing:
        return Verdict(room=UNLIMITED)
    reserved = 0 if for_start else max(state.reserved, 0)
    reserved_units = 0 if for_start else max(getattr(state, "reserved_units", 0) or 0, 0)
    verdicts: list[Verdict] = []
    caps = [p.concurrency for p in governing if p.concurrency]
    if caps:
        cap = min(caps)
        busy = max(state.running, 0) + reserved
        verdicts.append(Verdict(
            room=cap - busy, until=None, reason=f"concurrency {busy}/{cap}", key=key,
            kind=Hold.CONCURRENCY if cap - busy <= 0 else None,
        ))
    if readings is None:
        readings = read_policies({key: governing}, {key: state}, now)[key]
    for policy, reading in zip(governing, readings, strict=True):
        room = policy.room(reading, now, reserved_units)
        if room >= cost:
            verdicts.append(Verdict(room=room, key=key))
            continue
        until = policy.frees_at(reading, now, cost, reserved_units)
        verdicts.append(Verdict(room=0, until=until, reason=f"{policy.label()} used", key=key, kind=Hold.RATE))
    return combine(verdicts)


@dataclass
class Assessment:
    """Each key's verdict, and the readings it was judged on (a start writes from them)."""

    verdicts: dict[str, Verdict]
    readings: dict[str, list[Reading]]


def assess(
    keys: Sequence[str],
    states: Mapping[str, models.Model],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    costs: Mapping[str, int] | None = None,
) -> Assessment:
    """Judge every key, reading all their policies in one query."""
    spans = policies.apply_guards(keys, states, now)
    if for_start:
        arrivals.note_start(
            spans, {k: delay_memory(states.get(k)) for k in spans}, now, dict(policies.learnt_delays),
            {k: [p.period for p in policies.for_key(k) if isinstance(p, TokenBucket)] for k in spans},
        )
    governed = {k: policies.for_key(k) for k in keys}
    # A paused key needs no reading: nothing is admitted until the pause ends.
    to_read = {
        k: governing for k, governing in governed.items()
        if governing and _paused_until(k, states[k], now, policies) is None
    }
    readings = read_policies(to_read, states, now)
    costs = costs or {}
    verdicts = {
        k: check_key(
            k, states[k], now, policies, for_start=for_start, readings=readings.get(k, []), cost=costs.get(k, 1)
        )
        for k in keys
    }
    return Assessment(verdicts, readings)


def check_each_key(
    keys: Sequence[str],
    states: Mapping[str, models.Model],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
) -> dict[str, Verdict]:
    """Return the room of each key, reading all their policies in one query."""
    return assess(keys, states, now, policies, for_start=for_start).verdicts


def _paused_until(key: str, state: models.Model, now: datetime, policies: Policies) -> datetime | None:
    """Return when the key's own pause or its pattern's ends, if one lasts beyond now."""
    paused = [t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now]
    return max(paused, default=None)


def check_keys(
    keys: Sequence[str],
    states: Mapping[str, models.Model],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
) -> Verdict:
    """Return the room of a set of keys: a call is admitted only if every key has room."""
    return combine(list(check_each_key(keys, states, now, policies, for_start=for_start).values()))


@dataclass
class StartRecord:
    """What one start writes: log rows (key, units, running total) and bucket states (key, period, tat)."""

    log: list[tuple[str, int, int]] = field(default_factory=list)
    buckets: list[tuple[str, timedelta, int]] = field(default_factory=list)


def start_record(
    keys: Sequence[str],
    states: Mapping[str, models.Model],
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
    return record


def record_starts(at: datetime, record: StartRecord, call_id: int | None = None) -> None:
    """Append a start's rows to the log and write its buckets (the ORM's path; totals move in ``adjust``)."""
    from dispatcher.models import KeyBucket, KeyStart

    KeyStart.objects.bulk_create(
        [KeyStart(key=k, started_at=at, units=u, cum=c, call_id=call_id) for k, u, c in record.log]
    )
    if record.buckets:
        KeyBucket.objects.bulk_create(
            [KeyBucket(key=k, period=p, tat_us=t, since=at) for k, p, t in record.buckets],
            update_conflicts=True, unique_fields=["key", "period"], update_fields=["tat_us"],
        )


def adjust_reserved(by_key: dict[str, int], units: Mapping[str, int] | None = None) -> None:
    """Add to the reserved counters (calls and units) of locked keys, each its own amount, in one statement."""
    units = units or by_key
    by_key = {key: n for key, n in by_key.items() if n}
    if not by_key:
        return
    params = [value for pair in by_key.items() for value in pair]
    params += [value for key in by_key for value in (key, units.get(key, by_key[key]))]
    params += list(by_key)
    with connection.cursor() as cursor:
        cursor.execute(sql.adjust_reserved(len(by_key)), params)


def adjust(
    keys: Sequence[str],
    *,
    reserved: int = 0,
    running: int = 0,
    units: Mapping[str, int] | None = None,
    totals: Mapping[str, int] | None = None,
) -> None:
    """Move the in-flight counters of locked keys; ``units`` per key go with ``reserved`` (default 1 per call).

    ``totals`` sets the keys' running totals of units started (a start's new totals).
    """
    from dispatcher.models import KeyState

    if not keys or (reserved == 0 and running == 0):
        return
    if reserved == 0 and not totals:
        KeyState.objects.filter(key__in=list(keys)).update(running=models.F("running") + running)
        return
    if units is None and not totals:
        KeyState.objects.filter(key__in=list(keys)).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + reserved,
            running=models.F("running") + running,
        )
        return
    # Per key: each moves by its own units, and a start sets each key's own running total.
    sign = 1 if reserved > 0 else -1
    for key in keys:
        KeyState.objects.filter(key=key).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + sign * (units or {}).get(key, abs(reserved)),
            running=models.F("running") + running,
            **({"total": totals[key]} if totals else {}),
        )


def delay_memory(state: models.Model | None) -> DelayMemory:
    """Return the start-to-send delays a key's state row remembers."""
    if state is None:
        return DelayMemory()
    return DelayMemory(
        timedelta(microseconds=getattr(state, "send_delay_us", 0) or 0),
        timedelta(microseconds=getattr(state, "send_delay_prev_us", 0) or 0),
        getattr(state, "send_delay_since", None),
    )


def remember_send_delay(spans: Mapping[str, timedelta], delay: timedelta) -> int:
    """Keep a start-to-send delay measured on these keys (each with its memory span); return rows written.

    On PostgreSQL one statement that writes only rows whose memory changes (a new largest delay,
    or a span gone by: at most a few per key and second), so it waits on no key lock otherwise.
    """
    from django.db import transaction

    from dispatcher.clock import db_now
    from dispatcher.models import KeyState

    if not spans:
        return 0
    if connection.vendor == "postgresql":
        us = delay // timedelta(microseconds=1)
        with connection.cursor() as cursor:
            cursor.execute(sql.remember_send_delay(), {"keys": list(spans), "spans": list(spans.values()), "us": us})
            return cursor.rowcount
    written = 0
    with transaction.atomic():
        now = db_now()
        for state in KeyState.objects.select_for_update().filter(key__in=list(spans)).order_by("key"):
            kept = remember_delay(delay_memory(state), now, spans[state.key], delay)
            if kept is not None:
                written += KeyState.objects.filter(key=state.key).update(
                    send_delay_us=kept.current // timedelta(microseconds=1),
                    send_delay_prev_us=kept.previous // timedelta(microseconds=1),
                    send_delay_since=kept.since,
                )
    return written


def push_buckets(overdue: Mapping[str, tuple[Sequence[timedelta], timedelta]]) -> None:
    """Move the buckets of keys on by how much later than their guard allowed a request went out.

    A bucket's state is charged at the start with the guard known then; a request sent later
    arrives later, and GCRA's state moves at most as much as an arrival does, so moving it on by
    the difference keeps it at or past the API's. Under the key locks: a start reads and writes
    the bucket under them.
    """
    from django.db import transaction

    from dispatcher.models import KeyBucket

    with transaction.atomic():
        lock_keys(list(overdue))
        for key, (periods, late) in overdue.items():
            KeyBucket.objects.filter(key=key, period__in=list(periods)).update(
                tat_us=models.F("tat_us") + late // timedelta(microseconds=1)
            )


def pause(keys: Sequence[str], until: datetime, reason: str = "") -> None:
    """Pause keys until the given time, never shortening a longer pause already set."""
    from dispatcher.models import KeyState

    for key in keys:
        KeyState.objects.bulk_create([KeyState(key=key)], ignore_conflicts=True)
        KeyState.objects.filter(Q(key=key) & (Q(paused_until__isnull=True) | Q(paused_until__lt=until))).update(
            paused_until=until, pause_reason=reason[:200]
        )


def prune_starts(batch: int = 5000) -> int:
    """Delete window-log rows older than the longest policy period (at least an hour)."""
    from django.db import transaction

    from dispatcher.clock import db_now
    from dispatcher.conf import dispatcher_settings
    from dispatcher.models import KeyStart, RateLimit

    # Kept as long as the longest window counts (its period and the largest arrival guard).
    longest = max([timedelta(hours=1), *RateLimit.objects.values_list("period", flat=True)])
    cutoff = db_now() - longest - max(dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.ARRIVAL_GUARD_MAX)
    deleted = 0
    while True:
        with transaction.atomic():
            ids = list(KeyStart.objects.filter(started_at__lt=cutoff).values_list("id", flat=True)[:batch])
            if not ids:
                return deleted
            deleted += KeyStart.objects.filter(id__in=ids)._raw_delete(KeyStart.objects.db)


def wake_dispensers() -> None:
    """Wake long-running dispensers (on PostgreSQL, delivered when the transaction commits)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql.NOTIFY, [WAKE_CHANNEL])


class RateLimitManager(models.Manager):
    """Edits of rate policies and pauses, shared by the command, the admin and settings."""

    def set_policy(
        self,
        key: str,
        limit: int,
        period: timedelta,
        concurrency: int | None = None,
        *,
        burst: int | None = None,
    ):
        """Create or update the policy of ``key`` for ``period``: a window, or a bucket with ``burst``."""
        from django.db import transaction

        from dispatcher.clock import db_now
        from dispatcher.keys import validate_policy_key

        validate_policy_key(key)
        validate(limit, period, burst, concurrency)
        with transaction.atomic():
            if not is_pattern(key):
                # Serialise with starts of the key, which read the policies under this lock.
                lock_keys([key])
            old = self.filter(key=key, period=period).first()
            policy, _ = self.update_or_create(
                key=key, period=period, defaults={"limit": limit, "concurrency": concurrency, "burst": burst}
            )
            self._carry_buckets(old, policy, db_now())
            wake_dispensers()
        return policy

    def _carry_buckets(self, old: models.Model | None, new: models.Model, now: datetime) -> None:
        """Carry the units a key's bucket still owes into the edited policy (a new shape starts afresh)."""
        from dispatcher.conf import dispatcher_settings
        from dispatcher.models import KeyBucket

        buckets = KeyBucket.objects.filter(period=new.period)
        if is_pattern(new.key):
            buckets = buckets.filter(key__startswith=new.key[:-1])
        else:
            buckets = buckets.filter(key=new.key)
        guard = dispatcher_settings.ARRIVAL_GUARD
        before = old.as_policy().with_guard(guard) if old is not None else None
        after = new.as_policy().with_guard(guard)
        if not (isinstance(before, TokenBucket) and isinstance(after, TokenBucket)):
            buckets.delete()
            return
        for bucket in buckets.filter(tat_us__gt=to_us(now)):
            tat = before.rebase(from_us(bucket.tat_us), now, after)
            KeyBucket.objects.filter(id=bucket.id).update(tat_us=to_us(tat))

    def pause_key(self, key: str, duration: timedelta, reason: str = "paused by operator") -> datetime:
        """Pause a key (or every key a pattern matches) for a duration from now."""
        from django.db import transaction

        from dispatcher.clock import db_now
        from dispatcher.keys import validate_policy_key

        validate_policy_key(key)
        if duration <= timedelta(0):
            raise ValueError("a pause must last longer than zero")
        with transaction.atomic():
            until = db_now() + duration
            pause([key], until, reason)
        return until

    def resume_key(self, key: str) -> int:
        """Lift the pause of a key (or pattern); return how many pauses were lifted."""
        from dispatcher.models import KeyState

        with_pause = KeyState.objects.filter(key=key, paused_until__isnull=False)
        lifted = with_pause.update(paused_until=None, pause_reason="")
        wake_dispensers()
        return lifted

    def seed_from_settings(self) -> int:
        """Upsert the policies listed in DISPATCHER_RATE_LIMITS; return how many."""
        from django.core.exceptions import ImproperlyConfigured

        from dispatcher.conf import dispatcher_settings
        from dispatcher.durations import parse_positive_duration

        count = 0
        for entry in dispatcher_settings.RATE_LIMITS:
            try:
                self.set_policy(
                    entry["key"],
                    int(entry["limit"]),
                    parse_positive_duration(entry["period"]),
                    int(entry["concurrency"]) if entry.get("concurrency") else None,
                    burst=int(entry["burst"]) if entry.get("burst") is not None else None,
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ImproperlyConfigured(f"DISPATCHER_RATE_LIMITS entry {entry!r}: {exc}") from exc
            count += 1
        return count
