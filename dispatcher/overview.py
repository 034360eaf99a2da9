"""The dashboard's overview: what an operator reads first, in a bounded number of queries.

Calls per state, attempts' outcomes per minute over the last hour, failures in the last hour,
the oldest wait, the processes alive (``liveness``), then one row per key: its policies, their
use, its backlog and oldest wait, its errors in the last hour, its pause and when it drains.
Every figure is aggregated in SQL (a GROUP BY per question, and every window of every key read in
one statement, ``limit_sql.window_bases``), whatever the number of keys: the per-key panels, which
read a key's history minute by minute, are on each key's own page (``dashboard.key_view``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Max, Min, Q
from django.db.models.functions import TruncMinute

from dispatcher import liveness
from dispatcher import status as live
from dispatcher.keys import is_pattern, parse_key_set
from dispatcher.limits import catalog, gate
from dispatcher.limits.guard import late_starts
from dispatcher.limits.shapes import Reading, SlidingWindow
from dispatcher.models import Attempt, CallQueue, KeyBucket, KeyState, RateLimit, StartLog
from dispatcher.states import AttemptOutcome, CallStatus
from dispatcher.store import limit_sql, schema

MINUTES = 60
ERROR_OUTCOMES = (AttemptOutcome.ERROR, AttemptOutcome.FAILED, AttemptOutcome.LOST)
# What each outcome counts as on the overview's chart.
OUTCOME_KIND = {
    AttemptOutcome.DONE: "done", AttemptOutcome.RATE_LIMITED: "429", AttemptOutcome.MISSED: "missed",
    **{o: "error" for o in ERROR_OUTCOMES},
}
KINDS = (("done", "done"), ("error", "error"), ("429", "429"), ("missed", "missed its send moment"))
# A key set of a shared key is called starved when its oldest call has waited at least this long
# and at least STARVED_RATIO times as long as the next longest waiting key set of the key.
STARVED_AFTER = timedelta(minutes=5)
STARVED_RATIO = 3


@dataclass
class KeyRow:
    """One key of the overview: live figures read at one instant, errors over the last hour."""

    status: live.KeyStatus
    errors: int = 0
    failed: int = 0
    latest_error: str = ""
    # Key sets with waiting calls that carry the key, longest waiting first: (its other keys, wait).
    sets: list[tuple[str, timedelta]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.status.key

    @property
    def use(self) -> float | None:
        """The fullest policy's committed units over its capacity (None: no policy)."""
        shares = [p.committed / p.policy.capacity() for p in self.status.policies if p.policy.capacity()]
        return max(shares) if shares else None

    @property
    def starved(self) -> tuple[str, timedelta] | None:
        """The key set of a shared key whose oldest call waits far longer than the others', if any."""
        if len(self.sets) < 2:
            return None
        (keys, wait), (_, second) = self.sets[0], self.sets[1]
        if wait >= STARVED_AFTER and wait >= second * STARVED_RATIO:
            return keys, wait
        return None

    @property
    def paused(self) -> bool:
        return self.status.paused_until is not None


@dataclass
class Overview:
    """The overview's figures: totals, the last hour per minute, failures, processes and the key rows."""

    now: datetime
    totals: dict[str, int]
    minutes: list[tuple[datetime, dict[str, int]]]
    rows: list[KeyRow]
    processes: liveness.Liveness
    # Calls that failed for good in the last hour (calls without a key included).
    gave_up: int = 0

    @property
    def errors(self) -> int:
        """Attempts that ended in error (retried, failed or lost) in the last hour."""
        return sum(counts.get("error", 0) for _, counts in self.minutes)

    @property
    def oldest(self) -> KeyRow | None:
        waiting = [row for row in self.rows if row.status.oldest_waiting_since is not None]
        return max(waiting, key=lambda row: row.status.oldest_wait or timedelta(0)) if waiting else None

    def silent(self) -> list[Any]:
        """Processes that neither reported within the timeout nor stopped cleanly: dead or hung."""
        return [b for b in self.processes.heartbeats if b.stopped_at is None and not self.processes.is_alive(b)]

    def hour_totals(self) -> dict[str, int]:
        return {kind: sum(counts.get(kind, 0) for _, counts in self.minutes) for kind, _ in KINDS}


def read(now: datetime) -> Overview:
    """Read the overview at ``now`` (the database's clock)."""
    return Overview(
        now=now, totals=live.call_totals(), minutes=outcomes_per_minute(now), rows=key_rows(now),
        processes=liveness.read(now),
        gave_up=CallQueue.objects.filter(status=CallStatus.FAILED, finished_at__gte=now - timedelta(hours=1)).count(),
    )


def outcomes_per_minute(now: datetime) -> list[tuple[datetime, dict[str, int]]]:
    """Return, for each of the last 60 minutes, the attempts finished by kind (done, error, 429, missed)."""
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=MINUTES - 1)
    found: dict[datetime, dict[str, int]] = {}
    rows = (
        Attempt.objects.filter(finished_at__gte=start).exclude(outcome=AttemptOutcome.RUNNING)
        .annotate(minute=TruncMinute("finished_at")).values("minute", "outcome").annotate(n=Count("id")).order_by()
    )
    for row in rows:
        kind = OUTCOME_KIND.get(row["outcome"], "error")
        counts = found.setdefault(row["minute"], {})
        counts[kind] = counts.get(kind, 0) + row["n"]
    return [(m, found.get(m, {})) for m in (start + timedelta(minutes=i) for i in range(MINUTES))]


def key_rows(now: datetime) -> list[KeyRow]:
    """Return a row for every key worth showing (as ``status.key_statuses``), in a fixed number of queries.

    Unlike ``key_statuses`` nothing asks when a blocked key frees (a probe per key): the row says
    that it is blocked and why, its page says until when.
    """
    policies = catalog.Policies.load()
    waiting_sets = list(
        CallQueue.objects.pending().values("key_set")
        .annotate(n=Count("id"), due=Count("id", filter=Q(run_at__lte=now)), oldest=Min("created_at"), first=Min("run_at"))
        .order_by()
    )
    waiting = live.waiting_by_key(now, waiting_sets)
    running = _running_by_key()
    failures = _failures(now)
    wanted = set(waiting) | set(running) | {key for key in failures if key}
    wanted.update(k for k in RateLimit.objects.values_list("key", flat=True) if not is_pattern(k))
    wanted.update(
        KeyState.objects.filter(Q(reserved__gt=0) | Q(paused_until__gt=now)).exclude(key__endswith="*").values_list("key", flat=True)
    )
    wanted.update(StartLog.objects.filter(started_at__gte=now - timedelta(hours=1)).values_list("key", flat=True).distinct())
    states = {s.key: s for s in KeyState.objects.filter(key__in=wanted)}
    governed = {key: policies.for_key(key) for key in wanted if policies.for_key(key)}
    readings = _readings(governed, states, now)
    sets = _sets_by_key(waiting_sets, now)
    rows = []
    for key in sorted(wanted):
        state = states.get(key) or KeyState(key=key)
        status = _status(key, state, now, policies, governed.get(key, []), readings.get(key, []), running.get(key, 0))
        status.waiting, status.due, status.oldest_waiting_since = waiting.get(key, (0, 0, None))
        status.competing = len(sets.get(key, ()))
        failure = failures.get(key)
        rows.append(KeyRow(
            status, errors=failure.errors if failure else 0, failed=failure.failed if failure else 0,
            latest_error=failure.latest_error if failure else "", sets=sets.get(key, []),
        ))
    return rows


# Calls looked up by id at a time for their keys (a statement's parameters stay few).
CHUNK = 5_000


def _failures(now: datetime) -> dict[str, live.KeyFailures]:
    """Per key, the attempts that ended in error and the calls that gave up in the last hour, with the latest error.

    What ``status.recent_failures`` says, read without joining every call: the attempts of the hour
    by the index on their finish, grouped by call, then those calls' keys by id.
    """
    since = now - timedelta(hours=1)
    per_call = list(
        Attempt.objects.filter(finished_at__gte=since, outcome__in=ERROR_OUTCOMES)
        .values_list("call_id").annotate(n=Count("id"), last=Max("id")).order_by()
    )
    sets: dict[int, str] = {}
    for start in range(0, len(per_call), CHUNK):
        ids = [call_id for call_id, _, _ in per_call[start:start + CHUNK]]
        sets.update(CallQueue.objects.filter(id__in=ids).values_list("id", "key_set"))
    found: dict[str, live.KeyFailures] = {}
    for call_id, n, last in per_call:
        for key in parse_key_set(sets.get(call_id, "[]")) or [""]:
            item = found.setdefault(key, live.KeyFailures(key))
            item.errors += n
            item.latest_id = max(item.latest_id, last)
    failed = CallQueue.objects.filter(status=CallStatus.FAILED, finished_at__gte=since).values_list("key_set").annotate(n=Count("id")).order_by()
    for text, n in failed:
        for key in parse_key_set(text) or [""]:
            found.setdefault(key, live.KeyFailures(key)).failed += n
    texts = dict(Attempt.objects.filter(id__in={f.latest_id for f in found.values() if f.latest_id}).values_list("id", "error"))
    for item in found.values():
        item.latest_error = (texts.get(item.latest_id, "").strip().splitlines() or [""])[0][:200]
    return found


def _running_by_key() -> dict[str, int]:
    """Running calls per key, counted per key set in SQL (a few key sets, not every running call, are parsed)."""
    running: dict[str, int] = {}
    rows = CallQueue.objects.filter(status=CallStatus.RUNNING).values_list("key_set").annotate(n=Count("id")).order_by()
    for text, n in rows:
        for key in parse_key_set(text):
            running[key] = running.get(key, 0) + n
    return running


def _readings(governed: dict[str, list[Any]], states: dict[str, Any], now: datetime) -> dict[str, list[Reading]]:
    """What storage says about every policy of every key at ``now``, in two statements on PostgreSQL
    (a window's total before its first start, ``limit_sql.window_bases``; the buckets' states).

    Each reading is admission's own (``gate.reading``): a window counts its key's late starts past
    its span as a start does; when its units leave is read only if asked, which the overview never does.
    """
    db = StartLog.objects.db
    if not schema.postgresql_path(db):
        return gate.read_policies(governed, {k: states.get(k) or KeyState(key=k) for k in governed}, now, db)
    windows = [(key, p) for key, found in governed.items() for p in found if isinstance(p, SlidingWindow)]
    with connections[db].cursor() as cursor:
        cursor.execute(limit_sql.window_bases(), {"keys": [k for k, _ in windows], "since": [now - p.span for _, p in windows]})
        bases = {(windows[n - 1][0], windows[n - 1][1]): base for n, base in cursor.fetchall()}
    buckets = {
        (key, period): tat
        for key, period, tat in KeyBucket.objects.using(db).filter(key__in=list(governed)).values_list("key", "period", "tat_us")
    }
    readings: dict[str, list[Reading]] = {}
    for key, found in governed.items():
        total, late = getattr(states.get(key), "total", 0) or 0, late_starts(states.get(key))
        readings[key] = [
            gate.reading(
                key, p, bases.get((key, p)) if isinstance(p, SlidingWindow) else buckets.get((key, p.period)),
                total, db, late, now,
            )
            for p in found
        ]
    return readings


def _status(
    key: str, state: Any, now: datetime, policies: catalog.Policies, governing: list[Any], readings: list[Any], running: int,
) -> live.KeyStatus:
    """A key's status from readings already taken: its policies' use and room, its pause, what blocks it."""
    reserved_units = max(state.reserved_units or 0, 0)
    pauses = [t for t in (state.paused_until, policies.pattern_pause(key)) if t is not None and t > now]
    status = live.KeyStatus(
        key=key, now=now, reserved=max(state.reserved, 0), running=running,
        policies=[
            live.PolicyUse(
                p, p.capacity() - p.room(r, now), max(p.room(r, now, reserved_units), 0),
                learnt=any(p is q for q in policies.learnt.get(key, ())), reserved=reserved_units,
            )
            for p, r in zip(governing, readings, strict=True)
        ],
        paused_until=max(pauses) if pauses else None,
        pause_reason=state.pause_reason if state.paused_until in pauses else "pattern paused" if pauses else "",
    )
    rooms = [(p.room(r, now, reserved_units), f"{p.label()} used") for p, r in zip(governing, readings, strict=True)]
    if status.concurrency is not None:
        rooms.append((status.concurrency - status.in_flight, f"concurrency {status.in_flight}/{status.concurrency}"))
    if pauses:
        rooms.append((0, "paused"))
    if rooms:
        status.room, reason = min(rooms, key=lambda pair: pair[0])
        status.blocked_reason = reason if status.room <= 0 else ""
    return status


def _sets_by_key(waiting_sets: list[dict[str, Any]], now: datetime) -> dict[str, list[tuple[str, timedelta]]]:
    """Per key that two or more waiting key sets share: each set's other keys and oldest wait, longest first."""
    by_key: dict[str, list[tuple[str, timedelta]]] = {}
    for row in waiting_sets:
        keys = parse_key_set(row["key_set"])
        wait = max(now - row["oldest"], timedelta(0)) if row["oldest"] is not None else timedelta(0)
        for key in keys:
            by_key.setdefault(key, []).append((", ".join(k for k in keys if k != key) or "(this key alone)", wait))
    return {key: sorted(found, key=lambda pair: -pair[1]) for key, found in by_key.items()}


# --- sorting -----------------------------------------------------------------------------------

SORTS: dict[str, Callable[[KeyRow], Any]] = {
    "key": lambda r: r.key,
    "use": lambda r: -1.0 if r.use is None else r.use,
    "waiting": lambda r: r.status.waiting,
    "oldest": lambda r: r.status.oldest_wait or timedelta(-1),
    "errors": lambda r: (r.errors + r.failed, r.failed),
    "paused": lambda r: r.status.paused_until.timestamp() if r.status.paused_until else -1.0,
    "drain": lambda r: r.status.drain_time if r.status.drain_time is not None else timedelta(-1),
}
DEFAULT_SORT = "-errors"


def default_order(row: KeyRow) -> tuple[Any, ...]:
    """Errors first, then blocked or paused keys, then the longest wait, the largest backlog, the key."""
    return (-(row.errors + row.failed), not row.status.blocked, -(row.status.oldest_wait or timedelta(0)).total_seconds(),
            -row.status.waiting, row.key)


def sort_rows(rows: list[KeyRow], sort: str) -> list[KeyRow]:
    """Sort by a column of ``SORTS`` (``-name``: largest first), ties in the default order; ValueError otherwise."""
    name = sort.removeprefix("-")
    if name not in SORTS:
        raise ValueError(f"sort= takes one of {', '.join(SORTS)}, with '-' for largest first")
    ordered = sorted(rows, key=default_order)
    return sorted(ordered, key=SORTS[name], reverse=sort.startswith("-"))
