"""The limiter: policies per key, per-key locks and counters, the start log and bucket state.

Every check happens inside the caller's transaction after ``lock_keys`` has locked the
``KeyState`` rows of all the call's keys (sorted, so two lockers never deadlock), and reads
the database clock after that lock wait. What a policy admits is decided by its pure object
(``dispatcher.policies``); this module only reads and writes what those objects need: a
window's units (the key's running total less the total before the window's first start, two
index probes) and a bucket's one timestamp per key and policy.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.db import connections, models, router, transaction
from django.db.models import Q
from django.db.models.functions import Now

from dispatcher import arrivals, sql, tables
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.folded import Folded, Unfoldable
from dispatcher.keys import is_pattern, parse_key_set, pattern_matches
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
)
from dispatcher.policies import Policy as PolicyShape
from dispatcher.states import CallStatus

if TYPE_CHECKING:
    from dispatcher.models import KeyState

UNLIMITED = 10**9
# Marks learnt limits among the policy rows (no real policy has a negative concurrency).
LEARNT = -1
# The channel on which send(), finishes and policy edits wake long-running dispensers.
WAKE_CHANNEL = "dispatcher_wake"
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DURATION: models.DurationField[timedelta, timedelta] = models.DurationField()

# A sliding window built from keyword arguments, as other sources of policies (learnt limits)
# construct them: Policy(key=..., limit=..., period=...).
Policy = SlidingWindow


def alias(using: str | None = None) -> str:
    """Return the database alias the limiter's statements run on: the caller's manager's, else the router's.

    The routing rule of the app: every statement runs on ``connections[alias]`` with the alias
    of the manager it serves (``self.db``), never on the default ``connection``.
    """
    return using or router.db_for_write(tables.KeyState)


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
    learnt: dict[str, list[PolicyShape]] = field(default_factory=dict)
    # When the first of the learnt limits expires (these policies are not current after it).
    learnt_until: datetime | None = None
    # Per key, the arrival guard learnt from its measured start-to-send delays (``apply_guards``),
    # the delay it was learnt from, how long the key's delays are remembered, and the key's
    # policies with the guard applied. A start's own: ``fresh`` gives each start a copy.
    guards: dict[str, timedelta] = field(default_factory=dict)
    learnt_delays: dict[str, timedelta] = field(default_factory=dict)
    spans: dict[str, timedelta] = field(default_factory=dict)
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
    def load(cls, using: str | None = None) -> Policies:
        """Read every policy and every pattern pause from the database, in one query."""
        db = alias(using)
        if sql.postgresql_path(db):
            # Runs at every start: the query is compiled once per process and alias (it has no
            # arguments), and PostgreSQL's rows need no conversion.
            policies_sql, params = _policies_sql(db)
            with connections[db].cursor() as cursor:
                cursor.execute(policies_sql, params)
                rows = cursor.fetchall()
        else:
            rows = list(_policies_query(db))
        return cls._from_db_rows(rows)

    @classmethod
    def load_with_clock(cls, using: str | None = None) -> tuple[Policies, datetime]:
        """Read the policies and the database's clock (``db_now``) in one round trip."""
        db = alias(using)
        if not sql.postgresql_path(db):
            policies = cls.load(db)
            arrivals.mark_clock()  # the start's clock: its worker measures the send against it
            return policies, db_now(db)
        # A start holds its keys' locks while it reads both: one round trip fewer under the lock.
        # The clock's subquery is evaluated once (PostgreSQL does not flatten a volatile one),
        # and the LEFT JOIN returns it even when no policy exists.
        policies_sql, params = _policies_sql(db)
        with connections[db].cursor() as cursor:
            arrivals.mark_clock()  # the start's clock: its worker measures the send against it
            cursor.execute(sql.policies_with_clock(policies_sql), params)
            rows = cursor.fetchall()
        policies = cls._from_db_rows([row[2:] for row in rows if row[2] is not None])
        _remember(db, rows[0][1], policies)
        return policies, rows[0][0]

    @classmethod
    def _from_db_rows(cls, rows: Iterable[tuple]) -> Policies:
        guard = dispatcher_settings.ARRIVAL_GUARD
        policies: list[PolicyShape] = []
        pattern_pauses: dict[str, datetime] = {}
        learnt: dict[str, list[PolicyShape]] = {}
        expiries: list[datetime] = []
        for key, limit, period, burst, concurrency, until in rows:
            if concurrency == LEARNT:
                # Learnt limits are windows that absorb the same arrival guard as configured ones.
                learnt.setdefault(key, []).append(SlidingWindow(key, limit, period, None, guard))
                if until is not None:
                    expiries.append(until)
            elif until is not None:
                pattern_pauses[key] = until
            else:
                policies.append(make_policy(key, limit, period, burst, concurrency, guard))
        loaded = cls.from_rows(policies, pattern_pauses)
        loaded.learnt = learnt
        loaded.learnt_until = min(expiries, default=None)
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

    def fresh(self) -> Policies:
        """Return these policies without any key's learnt guard: a start's own copy to guard.

        A process keeps its policies for later starts, on several threads at once; each start
        applies its keys' guards to a copy (the policy lists themselves are shared, never changed).
        """
        return dataclasses.replace(self, guards={}, learnt_delays={}, spans={}, _guarded={})

    def apply_guards(
        self, keys: Iterable[str], states: Mapping[str, KeyState], now: datetime | None
    ) -> dict[str, timedelta]:
        """Give each key's policies the guard its measured delays call for; return each key's memory span.

        ``now`` None: before the clock is read (``policies_for_start``), the largest delay the key
        remembers from its last two spans, which is never less than what ``now`` would find.
        """
        floor, cap = dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.ARRIVAL_GUARD_MAX
        spans = {}
        for key in keys:
            self._guarded.pop(key, None)
            self.guards.pop(key, None)
            governing = self.for_key(key)
            if not governing:
                continue
            span = spans[key] = self.spans[key] = memory(governing, max(floor, cap))
            kept = delay_memory(states.get(key))
            if now is None:
                learnt = max(kept.current, kept.previous) if kept.since is not None else timedelta(0)
            else:
                learnt = learnt_delay(kept, now, span)
            self.learnt_delays[key] = learnt
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


def _policies_query(db: str) -> models.QuerySet:
    """The policies, then the pattern pauses with the policy columns empty, then the unexpired
    learnt limits marked by a concurrency of ``LEARNT``: one round trip."""
    policies = tables.RateLimit.objects.using(db).order_by().annotate(until=models.Value(None, models.DateTimeField())).values_list(
        "key", "limit", "period", "burst", "concurrency", "until"
    )
    pauses = tables.KeyState.objects.using(db).order_by().filter(key__endswith="*", paused_until__isnull=False).annotate(
        no_limit=models.Value(None, models.IntegerField()),
        no_period=models.Value(None, models.DurationField()),
        no_burst=models.Value(None, models.IntegerField()),
        no_concurrency=models.Value(None, models.IntegerField()),
    ).values_list("key", "no_limit", "no_period", "no_burst", "no_concurrency", "paused_until")
    learnt = tables.LearntLimit.objects.using(db).order_by().filter(expires_at__gt=Now()).annotate(
        no_burst=models.Value(None, models.IntegerField()),
        marker=models.Value(LEARNT, models.IntegerField()),
    ).values_list("key", "limit", "period", "no_burst", "marker", "expires_at")
    return policies.union(pauses, learnt, all=True)


@functools.cache
def _policies_sql(db: str) -> tuple[str, tuple]:
    query = _policies_query(db).query
    return query.get_compiler(using=db).as_sql()


# The policies each database's last reading in this process found, and their version (see
# ``sql.POLICY_VERSION``), shared by the process's threads.
_kept: dict[str, tuple[int, Policies]] = {}


def _remember(db: str, version: int | None, policies: Policies) -> None:
    if version is None:
        _kept.pop(db, None)
    else:
        _kept[db] = (version, policies.fresh())


def kept_policies(using: str | None = None) -> tuple[int, Policies] | None:
    """Return the version and policies this process keeps for a database, if any."""
    return _kept.get(alias(using))


def forget_policies(*, setting: str = "DISPATCHER_", **kwargs: object) -> None:
    """Drop the kept policies (Django's setting_changed: the arrival guard shapes them)."""
    if setting.startswith("DISPATCHER_"):
        _kept.clear()


setting_changed.connect(forget_policies, dispatch_uid="dispatcher.limiter.forget_policies")


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
    the policies' version and the keys' probes (computed with the kept policies), and the
    policies themselves only if the version moved or a kept learnt limit expired; then the probes
    are not returned (``assess`` reads them with the policies of now). Exact as reading the
    policies at every start: the version is read after the lock wait, in the same snapshot as
    the policies, so an edit committed before it binds this start.
    """
    db = alias(using)
    kept = _kept.get(db)
    if kept is None or not sql.postgresql_path(db):
        policies, now = Policies.load_with_clock(db)
        return policies, now, None
    version, policies = kept
    # The keys' guards before their probes: the probes read each window over its guarded span.
    policies = policies.fresh()
    policies.apply_guards(keys, states, None)
    governed = {key: governing for key in keys if (governing := policies.for_key(key))}
    kinds, params = _probes(governed, lambda span: span, db)
    policies_sql, policy_params = _policies_sql(db)
    with connections[db].cursor() as cursor:
        arrivals.mark_clock()  # the start's clock: its worker measures the send against it
        cursor.execute(
            sql.policies_for_start(kinds, policies_sql), [*params, *policy_params, version, policies.learnt_until]
        )
        rows = cursor.fetchall()
    now, current = rows[0][0], rows[0][1]
    if current != version or (policies.learnt_until is not None and policies.learnt_until <= now):
        skip = 2 + len(kinds)
        policies = Policies._from_db_rows([row[skip:] for row in rows if row[skip] is not None])
        _remember(db, current, policies)
        return policies, now, None
    readings, running = _from_probes(governed, states, iter(rows[0][2:]), db)
    return policies, now, Read(readings, running)


class Hold(enum.StrEnum):
    """Why a key has no room."""

    PAUSED = "paused"
    CONCURRENCY = "concurrency"
    # A configured policy (window or bucket) has no room for the call.
    RATE = "rate"
    # A limit the API announced (dispatcher.learning) has no room for the call.
    LEARNT = "learnt"


@dataclass(frozen=True)
class Verdict:
    """How many more units a key set may take now, and if none, why and until when."""

    room: int
    until: datetime | None = None
    reason: str = ""
    key: str = ""
    kind: Hold | None = None
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


def lock_keys(keys: Sequence[str], using: str | None = None, folded: Folded | None = None) -> dict[str, KeyState]:
    """Lock the KeyState rows of the keys, creating missing ones; call inside a transaction.

    In a folded start (``dispatcher.folded``) the lock opens the transaction, and missing rows
    raise ``Unfoldable``: creating them needs Django's transaction.
    """
    if not keys:
        return {}
    db = alias(using)
    ordered = sorted(set(keys))
    states = _select_for_update(ordered, db, folded)
    if len(states) < len(ordered):
        if folded is not None:
            raise Unfoldable(f"no key row for {sorted(set(ordered) - set(states))}")
        tables.KeyState.objects.using(db).bulk_create(
            [tables.KeyState(key=k) for k in ordered if k not in states], ignore_conflicts=True
        )
        states = _select_for_update(ordered, db)
    return states


def _select_for_update(ordered: list[str], db: str, folded: Folded | None = None) -> dict[str, KeyState]:
    if not sql.postgresql_path(db):
        return {s.key: s for s in tables.KeyState.objects.using(db).select_for_update().filter(key__in=ordered).order_by("key")}
    # Hand-written on PostgreSQL: this runs at every claim, start and finish, and compiling
    # the ORM's locking query costs more than running it.
    with connections[db].cursor() as cursor:
        if folded is not None and not folded.begun:
            cursor.execute(folded.begin(sql.lock_key_states()), [ordered])
            cursor.nextset()  # past BEGIN's result, to the rows
        else:
            cursor.execute(sql.lock_key_states(), [ordered])
        rows = cursor.fetchall()
    names = [f.attname for f in tables.KeyState._meta.concrete_fields]
    return {row[0]: tables.KeyState.from_db(db, names, row) for row in rows}


def read_policies(
    governed: Mapping[str, Sequence[PolicyShape]],
    states: Mapping[str, KeyState],
    now: datetime,
    using: str | None = None,
) -> dict[str, list[Reading]]:
    """Return, per key, what storage says about each of its policies at ``now``; one query."""
    return read_keys(governed, states, now, using)[0]


def read_keys(
    governed: Mapping[str, Sequence[PolicyShape]],
    states: Mapping[str, KeyState],
    now: datetime,
    using: str | None = None,
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
    with connections[db].cursor() as cursor:
        cursor.execute(sql.policy_readings(kinds, connections[db].vendor == "postgresql"), params)
        row = iter(cursor.fetchone())
    return _from_probes(governed, states, row, db)


def _probes(
    governed: Mapping[str, Sequence[PolicyShape]], window_start: Callable[[timedelta], object], db: str
) -> tuple[tuple[str, ...], list[Any]]:
    """Return the kinds of the probes ``read_keys`` reads (``sql.PROBES``) and their parameters;
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
    governed: Mapping[str, Sequence[PolicyShape]], states: Mapping[str, KeyState], row: Iterator[Any], db: str
) -> tuple[dict[str, list[Reading]], dict[str, int]]:
    readings: dict[str, list[Reading]] = {}
    for key, policies in governed.items():
        total = getattr(states.get(key), "total", 0) or 0
        readings[key] = [_reading(key, policy, next(row), total, db) for policy in policies]
    running = {key: next(row) for key, policies in governed.items() if any(p.concurrency for p in policies)}
    return readings, running


def running_by_key(keys: Iterable[str] | None = None, using: str | None = None) -> dict[str, int]:
    """Return how many calls are running per key (of ``keys`` if given); for display and signals."""
    wanted = set(keys) if keys is not None else None
    counts: dict[str, int] = {}
    running = tables.CallQueue.objects.using(alias(using)).filter(status=CallStatus.RUNNING)
    for text in running.values_list("key_set", flat=True).iterator():
        for key in parse_key_set(text):
            if wanted is None or key in wanted:
                counts[key] = counts.get(key, 0) + 1
    return counts


def _reading(key: str, policy: PolicyShape, value: int | None, total: int, db: str) -> Reading:
    if isinstance(policy, TokenBucket):
        return Reading(tat=from_us(value) if value is not None else None)
    base = total if value is None else value
    return Reading(used=total - base, leaves_at=functools.partial(_unit_leaves_at, db, key, base))


def _unit_leaves_at(db: str, key: str, base: int, n: int) -> datetime | None:
    """Return the start time of the start that holds the n-th unit after ``base``: one index probe."""
    return (
        tables.KeyStart.objects.using(db).filter(key=key, cum__gte=base + n).order_by("cum").values_list("started_at", flat=True).first()
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
) -> Verdict:
    """Return the room (in units) a key has now for a call of ``cost`` units.

    For a dispense (``for_start=False``) calls already dispatched but not started count as
    if they had started; at the start itself only real starts and running calls count.
    ``readings`` are the key's policy readings and ``running`` its running calls if already read
    (see ``read_keys``).
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
    if caps and (readings is None or running is None):
        found, counts = read_keys({key: governing}, {key: state}, now, using)
        readings, running = found[key], counts[key]
    if caps:
        cap = min(caps)
        busy = (running or 0) + reserved
        verdicts.append(Verdict(
            room=cap - busy, until=None, reason=f"concurrency {busy}/{cap}", key=key,
            kind=Hold.CONCURRENCY if cap - busy <= 0 else None,
        ))
    if readings is None:
        readings = read_policies({key: governing}, {key: state}, now, using)[key]
    for policy, reading in zip(governing, readings, strict=True):
        room = policy.room(reading, now, reserved_units)
        alone = policy.alone(reading, now, reserved_units)
        if room >= cost:
            verdicts.append(Verdict(room=room, key=key, alone=alone if alone > room else None))
            continue
        if alone >= cost:
            # A call beyond the bucket's depth, alone on a bucket full long enough.
            verdicts.append(Verdict(room=cost, key=key, alone=alone))
            continue
        until = policy.frees_at(reading, now, cost, reserved_units)
        learnt = any(policy is p for p in policies.learnt.get(key, ()))
        verdicts.append(Verdict(
            room=0, until=until, reason=f"{policy.label()} used", key=key, kind=Hold.LEARNT if learnt else Hold.RATE,
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
) -> Assessment:
    """Judge every key, reading all their policies in one query (none if ``read`` has them).

    Each key's policies take the arrival guard its measured delays call for first; with ``read``,
    ``policies_for_start`` applied them before it read the keys' probes.
    """
    if read is None:
        spans = policies.apply_guards(keys, states, now)
    else:
        spans = {k: policies.spans[k] for k in keys if k in policies.spans}
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
    readings, running = (read.readings, read.running) if read is not None else read_keys(to_read, states, now, using)
    costs = costs or {}
    verdicts = {
        k: check_key(
            k, states[k], now, policies, for_start=for_start, readings=readings.get(k, []), cost=costs.get(k, 1),
            running=running.get(k, 0),
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
) -> dict[str, Verdict]:
    """Return the room of each key, reading all their policies in one query."""
    return assess(keys, states, now, policies, for_start=for_start, using=using).verdicts


def _paused_until(key: str, state: KeyState, now: datetime, policies: Policies) -> datetime | None:
    """Return when the key's own pause or its pattern's ends, if one lasts beyond now."""
    paused = [t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now]
    return max(paused, default=None)


@dataclass
class StartRecord:
    """What one start writes: log rows (key, units, running total) and bucket states (key, period, tat)."""

    log: list[tuple[str, int, int]] = field(default_factory=list)
    buckets: list[tuple[str, timedelta, int]] = field(default_factory=list)
    # Per bucket, the microseconds the start charged beyond max(tat, now): a start recorded at a
    # later clock carries the same charge from there (sql.mark_running).
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
                base = max(reading.tat, now) if reading.tat is not None else now
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


def record_starts(at: datetime, record: StartRecord, call_id: int | None = None, using: str | None = None) -> None:
    """Append a start's rows to the log and write its buckets (the ORM's path; totals move in ``adjust``)."""
    db = alias(using)
    tables.KeyStart.objects.using(db).bulk_create(
        [tables.KeyStart(key=k, started_at=at, units=u, cum=c, call_id=call_id) for k, u, c in record.log]
    )
    if record.buckets:
        tables.KeyBucket.objects.using(db).bulk_create(
            [tables.KeyBucket(key=k, period=p, tat_us=t, since=at) for k, p, t in record.buckets],
            update_conflicts=True, unique_fields=["key", "period"], update_fields=["tat_us"],
        )


def adjust_reserved(by_key: dict[str, int], units: Mapping[str, int] | None = None, using: str | None = None) -> None:
    """Add to the reserved counters (calls and units) of locked keys, each its own amount, in one statement."""
    units = units or by_key
    by_key = {key: n for key, n in by_key.items() if n}
    if not by_key:
        return
    params = [value for pair in by_key.items() for value in pair]
    params += [value for key in by_key for value in (key, units.get(key, by_key[key]))]
    params += list(by_key)
    with connections[alias(using)].cursor() as cursor:
        cursor.execute(sql.adjust_reserved(len(by_key)), params)


def adjust(
    keys: Sequence[str],
    *,
    reserved: int = 0,
    units: Mapping[str, int] | None = None,
    totals: Mapping[str, int] | None = None,
    using: str | None = None,
) -> None:
    """Move the reserved counters of locked keys; ``units`` per key go with ``reserved`` (default 1 per call).

    ``totals`` sets the keys' running totals of units started (a start's new totals). Running
    calls have no counter: a capped key counts them from the calls at its check (``read_keys``).
    """
    if not keys or reserved == 0:
        return
    states = tables.KeyState.objects.using(alias(using))
    if units is None and not totals:
        states.filter(key__in=list(keys)).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + reserved,
        )
        return
    # Per key: each moves by its own units, and a start sets each key's own running total.
    sign = 1 if reserved > 0 else -1
    for key in keys:
        states.filter(key=key).update(
            reserved=models.F("reserved") + reserved,
            reserved_units=models.F("reserved_units") + sign * (units or {}).get(key, abs(reserved)),
            **({"total": totals[key]} if totals else {}),
        )


def delay_memory(state: KeyState | None) -> DelayMemory:
    """Return the start-to-send delays a key's state row remembers."""
    if state is None:
        return DelayMemory()
    return DelayMemory(
        timedelta(microseconds=getattr(state, "send_delay_us", 0) or 0),
        timedelta(microseconds=getattr(state, "send_delay_prev_us", 0) or 0),
        getattr(state, "send_delay_since", None),
    )


def remember_send_delay(spans: Mapping[str, timedelta], delay: timedelta, using: str | None = None) -> int:
    """Keep a start-to-send delay measured on these keys (each with its memory span); return rows written.

    On PostgreSQL one statement (``sql.remember_send_delay``) that writes only rows whose memory
    changes (a new largest delay, or a span gone by: at most a few per key and second); a worker
    calls it only when its start's reading says the memory changes. Several keys are locked
    first, in key order as every locker does: an UPDATE locks the rows it writes in the order it
    finds them (their place in the table), and a start holding one of them while waiting for the
    other would deadlock with it (the soak test met one a second).
    """
    if not spans:
        return 0
    db = alias(using)
    if sql.postgresql_path(db):
        us = delay // timedelta(microseconds=1)
        several = len(spans) > 1
        with transaction.atomic(using=db) if several else contextlib.nullcontext():
            if several:
                lock_keys(list(spans), using=db)
            with connections[db].cursor() as cursor:
                cursor.execute(sql.remember_send_delay(), {"keys": list(spans), "spans": list(spans.values()), "us": us})
                return cursor.rowcount
    written = 0
    states = tables.KeyState.objects.using(db)
    with transaction.atomic(using=db):
        now = db_now(db)
        for state in states.select_for_update().filter(key__in=list(spans)).order_by("key"):
            kept = remember_delay(delay_memory(state), now, spans[state.key], delay)
            if kept is not None:
                written += states.filter(key=state.key).update(
                    send_delay_us=kept.current // timedelta(microseconds=1),
                    send_delay_prev_us=kept.previous // timedelta(microseconds=1),
                    send_delay_since=kept.since,
                )
    return written


def push_buckets(overdue: Mapping[str, tuple[Sequence[timedelta], timedelta]], using: str | None = None) -> None:
    """Move the buckets of keys on by how much later than their guard allowed a request went out.

    A bucket's state is charged at the start with the guard known then; a request sent later
    arrives later, and GCRA's state moves at most as much as an arrival does, so moving it on by
    the difference keeps it at or past the API's. Under the key locks: a start reads and writes
    the bucket under them.
    """
    db = alias(using)
    with transaction.atomic(using=db):
        lock_keys(list(overdue), using=db)
        for key, (periods, late) in overdue.items():
            tables.KeyBucket.objects.using(db).filter(key=key, period__in=list(periods)).update(
                tat_us=models.F("tat_us") + late // timedelta(microseconds=1)
            )


def pause(keys: Sequence[str], until: datetime, reason: str = "", using: str | None = None) -> None:
    """Pause keys until the given time, never shortening a longer pause already set."""
    states = tables.KeyState.objects.using(alias(using))
    for key in keys:
        states.bulk_create([tables.KeyState(key=key)], ignore_conflicts=True)
        states.filter(Q(key=key) & (Q(paused_until__isnull=True) | Q(paused_until__lt=until))).update(
            paused_until=until, pause_reason=reason[:200]
        )


def prune_starts(batch: int = 5000, using: str | None = None) -> int:
    """Delete window-log rows older than the longest policy period (at least an hour)."""
    # Kept as long as the longest window counts (its period and the largest arrival guard).
    db = alias(using)
    longest = max([timedelta(hours=1), *tables.RateLimit.objects.using(db).values_list("period", flat=True)])
    cutoff = db_now(db) - longest - max(dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.ARRIVAL_GUARD_MAX)
    deleted = 0
    while True:
        with transaction.atomic(using=db):
            starts = tables.KeyStart.objects.using(db)
            ids = list(starts.filter(started_at__lt=cutoff).values_list("id", flat=True)[:batch])
            if not ids:
                return deleted
            deleted += starts.filter(id__in=ids)._raw_delete(db)


def wake_dispensers(using: str | None = None) -> None:
    """Wake long-running dispensers (on PostgreSQL, delivered when the transaction commits)."""
    connection = connections[alias(using)]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(sql.NOTIFY, [WAKE_CHANNEL])
