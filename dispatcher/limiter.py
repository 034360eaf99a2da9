"""The limiter: policies per key, per-key locks and counters, and the sliding-window log.

Every check happens inside the caller's transaction after ``lock_keys`` has locked the
``KeyState`` rows of all the call's keys (sorted, so two lockers never deadlock), and reads
the database clock after that lock wait. A policy (L per P) admits a start at time t only if
fewer than L starts of the key lie in [t - P, t]; so no closed interval of length P ever holds
more than L starts.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.db import connection, models
from django.db.models import Q

from dispatcher.durations import format_duration
from dispatcher.keys import is_pattern, pattern_matches

UNLIMITED = 10**9
# Marks learnt limits among the policy rows (no real policy has a negative concurrency).
LEARNT = -1
# The channel on which send(), finishes and policy edits wake long-running dispensers.
WAKE_CHANNEL = "dispatcher_wake"


@dataclass(frozen=True)
class Policy:
    """One rate policy as the limiter applies it."""

    key: str
    limit: int
    period: timedelta
    concurrency: int | None = None


@dataclass
class Policies:
    """All policies and pattern pauses, loaded once per dispense pass or start."""

    exact: dict[str, list[Policy]] = field(default_factory=dict)
    patterns: list[tuple[str, list[Policy]]] = field(default_factory=list)
    pattern_pauses: dict[str, datetime] = field(default_factory=dict)
    # Limits an API announced (dispatcher.learning), applied on top of the key's own policies.
    learnt: dict[str, list[Policy]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: Iterable[Policy], pattern_pauses: dict[str, datetime] | None = None) -> Policies:
        exact: dict[str, list[Policy]] = {}
        grouped: dict[str, list[Policy]] = {}
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
            sql, params = _policies_sql()
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                rows = cursor.fetchall()
        else:
            rows = list(_policies_query())
        policies: list[Policy] = []
        pattern_pauses: dict[str, datetime] = {}
        learnt: dict[str, list[Policy]] = {}
        for key, limit, period, concurrency, until in rows:
            if concurrency == LEARNT:
                learnt.setdefault(key, []).append(Policy(key=key, limit=limit, period=period))
            elif until is not None:
                pattern_pauses[key] = until
            else:
                policies.append(Policy(key=key, limit=limit, period=period, concurrency=concurrency))
        loaded = cls.from_rows(policies, pattern_pauses)
        loaded.learnt = learnt
        return loaded

    def for_key(self, key: str) -> list[Policy]:
        """Return the policies governing a key: its exact ones, else the most specific pattern's;
        and the limits learnt for it."""
        learnt = self.learnt.get(key, []) if self.learnt else []
        if key in self.exact:
            return self.exact[key] + learnt
        for pattern, policies in self.patterns:
            if pattern_matches(pattern, key):
                return policies + learnt
        return learnt

    def pattern_pause(self, key: str) -> datetime | None:
        latest = None
        for pattern, until in self.pattern_pauses.items():
            if pattern_matches(pattern, key) and (latest is None or until > latest):
                latest = until
        return latest


def _policies_query() -> models.QuerySet:
    """The policies, then the pattern pauses with the policy columns empty, then the unexpired
    learnt limits marked by a concurrency of ``LEARNT``: one round trip."""
    from django.db.models.functions import Now

    from dispatcher.models import KeyState, LearntLimit, RateLimit

    policies = RateLimit.objects.order_by().annotate(until=models.Value(None, models.DateTimeField())).values_list(
        "key", "limit", "period", "concurrency", "until"
    )
    pauses = KeyState.objects.order_by().filter(key__endswith="*", paused_until__isnull=False).annotate(
        no_limit=models.Value(None, models.IntegerField()),
        no_period=models.Value(None, models.DurationField()),
        no_concurrency=models.Value(None, models.IntegerField()),
    ).values_list("key", "no_limit", "no_period", "no_concurrency", "paused_until")
    learnt = LearntLimit.objects.order_by().filter(expires_at__gt=Now()).annotate(
        marker=models.Value(LEARNT, models.IntegerField()), no_until=models.Value(None, models.DateTimeField()),
    ).values_list("key", "limit", "period", "marker", "no_until")
    return policies.union(pauses, learnt, all=True)


@functools.cache
def _policies_sql() -> tuple[str, tuple]:
    query = _policies_query().query
    return query.get_compiler(connection=connection).as_sql()


@dataclass(frozen=True)
class Verdict:
    """How many more calls a key set may take now, and if none, why and until when."""

    room: int
    until: datetime | None = None
    reason: str = ""
    key: str = ""

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
    fields = KeyState._meta.concrete_fields
    columns = ", ".join(connection.ops.quote_name(f.column) for f in fields)
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {columns} FROM {KeyState._meta.db_table} WHERE key = ANY(%s) ORDER BY key FOR UPDATE",
            [ordered],
        )
        rows = cursor.fetchall()
    names = [f.attname for f in fields]
    return {row[0]: KeyState.from_db(connection.alias, names, row) for row in rows}


def window_counts(governed: dict[str, Sequence[Policy]], now: datetime) -> dict[str, list[int]]:
    """Return, per key, how many of its starts lie in each of its policies' windows; one query."""
    from dispatcher.models import KeyStart

    if not governed:
        return {}
    table = KeyStart._meta.db_table
    # One index range count per (key, period), all in one row; hand-written because the ORM
    # compiles an aggregate over many filtered counts more slowly than the database runs it.
    adapt = connection.ops.adapt_datetimefield_value
    columns, params = [], []
    for key, policies in governed.items():
        for policy in policies:
            columns.append(f"(SELECT COUNT(*) FROM {table} WHERE key = %s AND started_at >= %s)")
            params += [key, adapt(now - policy.period)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(columns), params)
        row = iter(cursor.fetchone())
    return {key: [next(row) for _ in policies] for key, policies in governed.items()}


def _window_counts(key: str, policies: Sequence[Policy], now: datetime) -> list[int]:
    return window_counts({key: policies}, now)[key]


def _slot_frees_at(key: str, policy: Policy, now: datetime, nth_oldest: int) -> datetime | None:
    """Return when the nth oldest start in the window leaves it."""
    from dispatcher.models import KeyStart

    if nth_oldest < 1:
        return None
    starts = list(
        KeyStart.objects.filter(key=key, started_at__gte=now - policy.period)
        .order_by("started_at")
        .values_list("started_at", flat=True)[nth_oldest - 1 : nth_oldest]
    )
    if not starts:
        return None
    return starts[0] + policy.period + timedelta(microseconds=1)


def check_key(
    key: str,
    state: models.Model,
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
    counts: Sequence[int] | None = None,
) -> Verdict:
    """Return the room a key has now.

    For a dispense (``for_start=False``) calls already dispatched but not started count as
    if they had started; at the start itself only real starts and running calls count.
    ``counts`` are the key's window counts if already read (see ``window_counts``).
    """
    paused_until = _paused_until(key, state, now, policies)
    if paused_until is not None:
        return Verdict(room=0, until=paused_until, reason="paused", key=key)
    governing = policies.for_key(key)
    if not governing:
        return Verdict(room=UNLIMITED)
    reserved = 0 if for_start else max(state.reserved, 0)
    verdicts: list[Verdict] = []
    caps = [p.concurrency for p in governing if p.concurrency]
    if caps:
        cap = min(caps)
        busy = max(state.running, 0) + (0 if for_start else reserved)
        free = cap - busy
        verdicts.append(Verdict(room=free, until=None, reason=f"concurrency {busy}/{cap}", key=key))
    if counts is None:
        counts = _window_counts(key, governing, now)
    for policy, used in zip(governing, counts, strict=True):
        free = policy.limit - used - reserved
        if free > 0:
            verdicts.append(Verdict(room=free, key=key))
            continue
        # Room returns when enough of the starts in the window have aged out of it. When calls
        # dispatched but not yet started hold the room, they start at the earliest now, so
        # their slots free one period from now at the earliest: look again then.
        must_expire = used + reserved - policy.limit + 1
        until = _slot_frees_at(key, policy, now, must_expire) if must_expire <= used else now + policy.period
        reason = f"{policy.limit} per {format_duration(policy.period)} used"
        verdicts.append(Verdict(room=0, until=until, reason=reason, key=key))
    return combine(verdicts)


def check_each_key(
    keys: Sequence[str],
    states: dict[str, models.Model],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
) -> dict[str, Verdict]:
    """Return the room of each key, counting all their windows in one query."""
    governed = {k: policies.for_key(k) for k in keys}
    # A paused key needs no count: nothing is admitted until the pause ends.
    to_count = {
        k: governing for k, governing in governed.items()
        if governing and _paused_until(k, states[k], now, policies) is None
    }
    counts = window_counts(to_count, now)
    return {
        k: check_key(k, states[k], now, policies, for_start=for_start, counts=counts.get(k, []))
        for k in keys
    }


def _paused_until(key: str, state: models.Model, now: datetime, policies: Policies) -> datetime | None:
    """Return when the key's own pause or its pattern's ends, if one lasts beyond now."""
    paused = [t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now]
    return max(paused, default=None)


def check_keys(
    keys: Sequence[str],
    states: dict[str, models.Model],
    now: datetime,
    policies: Policies,
    *,
    for_start: bool,
) -> Verdict:
    """Return the room of a set of keys: a call is admitted only if every key has room."""
    return combine(list(check_each_key(keys, states, now, policies, for_start=for_start).values()))


def record_starts(keys: Sequence[str], at: datetime) -> None:
    """Append one start per key to the sliding-window log."""
    from dispatcher.models import KeyStart

    if keys:
        KeyStart.objects.bulk_create([KeyStart(key=k, started_at=at) for k in keys])


def adjust_reserved(by_key: dict[str, int]) -> None:
    """Add to the reserved counters of locked keys, each its own amount, in one statement."""
    from dispatcher.models import KeyState

    by_key = {key: n for key, n in by_key.items() if n}
    if not by_key:
        return
    table = KeyState._meta.db_table
    cases = " ".join("WHEN %s THEN %s" for _ in by_key)
    marks = ", ".join("%s" for _ in by_key)
    params = [value for pair in by_key.items() for value in pair] + list(by_key)
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET reserved = reserved + CASE key {cases} END WHERE key IN ({marks})", params
        )


def adjust(keys: Sequence[str], *, reserved: int = 0, running: int = 0) -> None:
    """Move the in-flight counters of locked keys."""
    from dispatcher.models import KeyState

    if not keys or (reserved == 0 and running == 0):
        return
    KeyState.objects.filter(key__in=list(keys)).update(
        reserved=models.F("reserved") + reserved, running=models.F("running") + running
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
    from dispatcher.models import KeyStart, RateLimit

    longest = max([timedelta(hours=1), *RateLimit.objects.values_list("period", flat=True)])
    cutoff = db_now() - longest
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
            cursor.execute("SELECT pg_notify(%s, '')", [WAKE_CHANNEL])


class RateLimitManager(models.Manager):
    """Edits of rate policies and pauses, shared by the command, the admin and settings."""

    def set_policy(self, key: str, limit: int, period: timedelta, concurrency: int | None = None):
        """Create or update the policy of ``key`` for ``period``."""
        from dispatcher.keys import validate_policy_key

        validate_policy_key(key)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a whole number of at least 1, not {limit!r}")
        if not isinstance(period, timedelta) or period <= timedelta(0):
            raise ValueError(f"period must be a duration greater than zero, not {period!r}")
        if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1):
            raise ValueError(f"concurrency must be a whole number of at least 1, not {concurrency!r}")
        from django.db import transaction

        with transaction.atomic():
            if not is_pattern(key):
                # Serialise with starts of the key, which read the policies under this lock.
                lock_keys([key])
            policy, _ = self.update_or_create(
                key=key, period=period, defaults={"limit": limit, "concurrency": concurrency}
            )
            wake_dispensers()
        return policy

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
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ImproperlyConfigured(f"DISPATCHER_RATE_LIMITS entry {entry!r}: {exc}") from exc
            count += 1
        return count
