"""Which policies govern a key: configured policies, pattern pauses and learnt limits, loaded per pass or start and _kept per process by version."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.db import connections, models
from django.db.models.functions import Now

from dispatcher import arrivals, tables
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.keys import is_pattern, pattern_matches
from dispatcher.limits.guard import (
    GUARD_MAX,
    SEND_SLACK,
    arrival_guard,
    delay_memory,
    held_hold,
    memory,
    remembered,
)
from dispatcher.limits.locks import alias
from dispatcher.limits.shapes import Policy as PolicyShape
from dispatcher.limits.shapes import SlidingWindow, TokenBucket, make_policy
from dispatcher.store import limit_sql, prepared, schema

if TYPE_CHECKING:
    from dispatcher.models import KeyState


# Marks learnt limits among the policy rows (no real policy has a negative concurrency).
LEARNT = -1




# A sliding window built from keyword arguments, as other sources of policies (learnt limits)
# construct them: Policy(key=..., limit=..., period=...).
Policy = SlidingWindow


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
    # A key whose policies are all buckets has its requests held (``holds``): its guard is then
    # the configured one (the network's), and its ``learnt_delays`` what its buckets allow a
    # request after its start: the hold and the lateness they absorb (``TokenBucket.lateness``).
    guards: dict[str, timedelta] = field(default_factory=dict)
    learnt_delays: dict[str, timedelta] = field(default_factory=dict)
    holds: dict[str, timedelta] = field(default_factory=dict)
    # Per held key, how late after its start its buckets let a request arrive: the hold and the
    # whole guard (``arrivals.answered``).
    reach: dict[str, timedelta] = field(default_factory=dict)
    spans: dict[str, timedelta] = field(default_factory=dict)
    # Per key whose buckets hold no token back (a smooth rate) going out unheld (``release``), how
    # late after its start they let a request arrive (its whole guard): its request is settled as
    # it goes out all the same (``arrivals.release``), held for no time (``send_holds``).
    settled: dict[str, timedelta] = field(default_factory=dict)
    _guarded: dict[str, list[PolicyShape]] = field(default_factory=dict)
    # Per held key, its guard and delay were it not held (``release``).
    _unheld: dict[str, tuple[timedelta, timedelta]] = field(default_factory=dict)

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
        if schema.postgresql_path(db):
            # Runs at every start: the query is compiled once per process and alias (it has no
            # arguments), and PostgreSQL's rows need no conversion.
            policies_sql, params = policies_statement(db)
            with prepared.cursor(db) as cursor:
                cursor.execute(policies_sql, params)
                rows = cursor.fetchall()
        else:
            rows = list(_policies_query(db))
        return cls._from_db_rows(rows)

    @classmethod
    def load_with_clock(cls, using: str | None = None) -> tuple[Policies, datetime]:
        """Read the policies and the database's clock (``db_now``) in one round trip."""
        db = alias(using)
        if not schema.postgresql_path(db):
            policies = cls.load(db)
            with arrivals.reading_clock():  # the start's clock: its worker measures the send against it
                return policies, db_now(db)
        # A start holds its keys' locks while it reads both: one round trip fewer under the lock.
        # The clock's subquery is evaluated once (PostgreSQL does not flatten a volatile one),
        # and the LEFT JOIN returns it even when no policy exists.
        policies_sql, params = policies_statement(db)
        # The start's clock: its worker measures the send against it, and holds a request from it.
        with connections[db].cursor() as cursor, arrivals.reading_clock():
            cursor.execute(limit_sql.policies_with_clock(policies_sql), params)
            rows = cursor.fetchall()
        policies = cls._from_db_rows([row[2:] for row in rows if row[2] is not None])
        remember_policies(db, rows[0][1], policies)
        return policies, rows[0][0]

    @classmethod
    def _from_db_rows(cls, rows: Iterable[tuple[Any, ...]]) -> Policies:
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
        hold = self.holds.get(key)
        guarded: list[PolicyShape]
        if hold is not None:
            guarded = [p.with_hold(guard, hold, SEND_SLACK) for p in governing if isinstance(p, TokenBucket)]
        else:
            guarded = [p if p.guard == guard else p.with_learnt_guard(guard) for p in governing]
        self._guarded[key] = guarded
        return guarded

    def fresh(self) -> Policies:
        """Return these policies without any key's learnt guard: a start's own copy to guard.

        A process keeps its policies for later starts, on several threads at once; each start
        applies its keys' guards to a copy (the policy lists themselves are shared, never changed).
        """
        return dataclasses.replace(
            self, guards={}, learnt_delays={}, holds={}, reach={}, spans={}, settled={}, _guarded={}, _unheld={}
        )

    def apply_guards(
        self, keys: Iterable[str], states: Mapping[str, KeyState], now: datetime | None
    ) -> dict[str, timedelta]:
        """Give each key's policies the guard its measured delays call for; return each key's memory span.

        ``now`` None: before the clock is read (``policies_for_start``), the largest delay the key
        remembers from its last two spans, which is never less than what ``now`` would find.
        """
        floor, cap = dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX)
        spans = {}
        for key in keys:
            self._guarded.pop(key, None)
            self.guards.pop(key, None)
            self.holds.pop(key, None)
            self.reach.pop(key, None)
            self.settled.pop(key, None)
            self._unheld.pop(key, None)
            governing = self.for_key(key)
            if not governing:
                continue
            span = spans[key] = self.spans[key] = memory(governing, max(floor, cap))
            learnt = remembered(delay_memory(states.get(key)), now, span)
            hold = held_hold(floor, cap, learnt)
            if hold > timedelta(0) and all(isinstance(p, TokenBucket) for p in governing):
                # Its requests are held to their start plus the delay measured (send-time pacing).
                self.guards[key], self.holds[key] = floor, hold
                held = [p for p in self.for_key(key) if isinstance(p, TokenBucket)]
                self.learnt_delays[key] = hold + min(p.lateness for p in held)
                self.reach[key] = hold + min(p.guard for p in held)
                self._unheld[key] = arrival_guard(floor, cap, learnt), learnt
                continue
            self.learnt_delays[key] = learnt
            self.guards[key] = arrival_guard(floor, cap, learnt)
            self._settle(key)
        return spans

    def release(self, key: str) -> None:
        """Let a held key's starts go out unheld, under the guard with the whole delay measured
        (``gate.assess``: its buckets are full, so that guard admits a call at once, and a hold
        would cost latency for nothing).

        A key whose buckets hold no token back (a smooth rate: a start finds them full whenever
        it is admitted at all; before a delay is measured it is not held either) has its request
        settled as it goes out all the same: later than that guard allows, it moves the buckets
        on first, or does not go once a later start was charged on them. Settled after its
        answer instead, a request that went out late (a new process's first start and
        connection: 10-30 ms where later ones take 5) left the next start to go out on the
        buckets as they were, too close behind it: a 429 behind a smooth rate. A bucket with a
        burst has tokens to cover such a lateness, and is not settled."""
        self.guards[key], self.learnt_delays[key] = self._unheld.pop(key)
        del self.holds[key]
        self.reach.pop(key, None)
        self._guarded.pop(key, None)
        self._settle(key)

    def _settle(self, key: str) -> None:
        """Have an unheld key's request settled as it goes out if its policies are all buckets
        that hold no token back (``release``): before its workers measured a delay (its first
        calls), or its buckets full."""
        governing = self.for_key(key)
        if governing and all(isinstance(p, TokenBucket) and p.burst <= 1 for p in governing):
            self.settled[key] = min(p.guard for p in governing)

    def learning_windows(self, keys: Iterable[str]) -> dict[str, timedelta]:
        """Return, for those of the guarded keys a sliding window governs under a guard their
        measured delays raise (learning on: the cap above the configured guard), their shortest
        window period. Such a window counts a start under the delay its key remembers then, so a
        request later than that is remembered as it goes out (``delaywriter.remember_ahead``)."""
        floor, cap = dispatcher_settings.ARRIVAL_GUARD, dispatcher_settings.tuned("ARRIVAL_GUARD_MAX", GUARD_MAX)
        if cap <= floor:
            return {}
        periods = {
            key: [p.period for p in self.for_key(key) if isinstance(p, SlidingWindow)]
            for key in keys if key in self.guards and key not in self.holds
        }
        return {key: min(found) for key, found in periods.items() if found}

    def send_holds(self) -> tuple[dict[str, timedelta], dict[str, timedelta]]:
        """Return, per key whose requests are settled as they go out, how long after its start
        its request is held (0 for a released key's) and how late its buckets let it arrive."""
        return {**self.holds, **dict.fromkeys(self.settled, timedelta(0))}, {**self.reach, **self.settled}

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


def _policies_query(db: str) -> models.QuerySet[Any, Any]:
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
def policies_statement(db: str) -> tuple[str, tuple[Any, ...]]:
    query = _policies_query(db).query
    text, params = query.get_compiler(using=db).as_sql()
    return str(text), tuple(params)


# The policies each database's last reading in this process found, and their version (see
# ``limit_sql.POLICY_VERSION``), shared by the process's threads.
_kept: dict[str, tuple[int, Policies]] = {}


def remember_policies(db: str, version: int | None, policies: Policies) -> None:
    if version is None:
        _kept.pop(db, None)
    else:
        _kept[db] = (version, policies.fresh())


def kept_policies(using: str | None = None) -> tuple[int, Policies] | None:
    """Return the version and policies this process keeps for a database, if any."""
    return _kept.get(alias(using))


def reread_unless_kept(db: str, kept: tuple[int, Policies] | None, version: int | None, now: datetime) -> Policies | None:
    """None if the ``kept`` policies still stand at the ``version`` just read and at ``now`` (no kept
    learnt limit expired); else read the policies, keep them with that version and return them."""
    if kept is not None and kept[0] == version and (kept[1].learnt_until is None or now < kept[1].learnt_until):
        return None
    policies = Policies.load(db)
    remember_policies(db, version, policies)
    return policies


def forget_policies(*, setting: str = "DISPATCHER_", **kwargs: object) -> None:
    """Drop the _kept policies (Django's setting_changed: the arrival guard shapes them)."""
    if setting.startswith("DISPATCHER_"):
        _kept.clear()


setting_changed.connect(forget_policies, dispatch_uid="dispatcher.limiter.forget_policies")
