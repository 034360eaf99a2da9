"""Live status per key and "why is this call waiting, and until when": one read-only view.

The admin, the ``dispatcher_status`` command, the dashboard, the metrics and the API all read
from here. Nothing here takes a lock or writes: it asks the limiter's own ``check_key`` the
question a dispenser would ask (``for_start=False``), on rows read without ``FOR UPDATE``, so
the answer is what a dispenser would decide at this instant, give or take a concurrent claim.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Min, OuterRef, Q, Subquery, Sum
from django.db.models.functions import TruncMinute

from dispatcher.clock import db_now
from dispatcher.durations import format_duration
from dispatcher.keys import is_pattern, parse_key_set
from dispatcher.limits import catalog, gate
from dispatcher.limits.shapes import Policy as PolicyShape
from dispatcher.models import Attempt, CallQueue, KeyState, RateLimit, StartLog


@dataclass(frozen=True)
class PolicyUse:
    """One policy of a key and how much of it is used now (a window's units, a bucket's spent tokens)."""

    policy: PolicyShape
    used: int
    # Units that may start now, calls already dispatched counted.
    room: int = 0
    # Announced by the API (dispatcher.learning), not configured.
    learnt: bool = False
    # Units of calls dispatched but not started: promised, so they count against the policy.
    reserved: int = 0

    @property
    def utilisation(self) -> float:
        return self.used / self.policy.capacity()

    @property
    def per_minute(self) -> float:
        """The policy's sustained rate in units per minute."""
        return self.policy.per_minute

    def label(self) -> str:
        text = self.policy.label()
        return f"{text} (learnt from the API)" if self.learnt else text

    @property
    def committed(self) -> int:
        """Units counted against the policy now: started in the window (or spent tokens) plus reserved."""
        return self.used + self.reserved

    def usage_text(self) -> str:
        """Say how much of the policy is taken, in its own terms: "7/10 in the last 1m", "3/5 tokens spent"."""
        if self.policy.shape == "bucket":
            text = f"{self.committed}/{self.policy.capacity()} tokens spent"
        else:
            text = f"{self.committed}/{self.policy.limit} in the last {format_duration(self.policy.period)}"
        return f"{text} ({self.reserved} dispatched, not started)" if self.reserved else text


@dataclass
class KeyStatus:
    """Everything an operator asks about one key, read at one instant."""

    key: str
    now: datetime
    policies: list[PolicyUse] = field(default_factory=list)
    reserved: int = 0
    running: int = 0
    waiting: int = 0
    due: int = 0
    oldest_waiting_since: datetime | None = None
    paused_until: datetime | None = None
    pause_reason: str = ""
    room: int = gate.UNLIMITED
    blocked_reason: str = ""
    next_free_at: datetime | None = None
    # Another key of its waiting calls that holds them past this key's own free slot.
    held_by: str = ""
    # How many key sets with waiting calls carry the key (two or more share it: fair turns).
    competing: int = 0

    @property
    def in_flight(self) -> int:
        return self.reserved + self.running

    @property
    def concurrency(self) -> int | None:
        caps = [p.policy.concurrency for p in self.policies if p.policy.concurrency]
        return min(caps) if caps else None

    @property
    def oldest_wait(self) -> timedelta | None:
        if self.oldest_waiting_since is None:
            return None
        return max(self.now - self.oldest_waiting_since, timedelta(0))

    @property
    def blocked(self) -> bool:
        return self.room <= 0

    @property
    def drain_is_lower_bound(self) -> bool:
        """Whether the drain is only a lower bound: a concurrency cap (how long calls run is not
        known) or another key holds the backlog."""
        return bool(self.waiting) and (self.concurrency is not None or bool(self.held_by))

    def next_free_text(self, say: Callable[[datetime, datetime], str]) -> str:
        """Say when the key's next waiting call can start ("now", a moment, "when a call in flight
        finishes"), with ``say(moment, now)`` for a moment; a moment another key decides names it."""
        if self.next_free_at is None:
            return "when a call in flight finishes"
        if self.next_free_at <= self.now:
            return "now"
        text = say(self.next_free_at, self.now)
        return f"{text} (held by {self.held_by})" if self.held_by else text

    def drain_text(self, say: Callable[[timedelta | None], str]) -> str:
        """Say the drain time, "at least ..." where it is a lower bound, "-" when nothing waits."""
        if not self.waiting:
            return "-"
        text = say(self.drain_time)
        return f"at least {text}" if self.drain_is_lower_bound else text

    @property
    def governed_by(self) -> str:
        """The policy key (exact or pattern) whose policies apply, or '' if none."""
        return self.policies[0].policy.key if self.policies else ""

    @property
    def drain_time(self) -> timedelta | None:
        """Estimate how long the backlog takes to start at the current limits.

        Each policy estimates its own drain (a window: whole windows beyond the room left now;
        a bucket: one interval per unit beyond its tokens), counting a unit per waiting call;
        the slowest policy and any pause decide. Concurrency is left out (how long a call runs
        is not known in advance), so the estimate is a lower bound. None when nothing waits;
        zero when the backlog fits the room there is now.
        """
        if self.waiting == 0:
            return None
        estimate = timedelta(0)
        for use in self.policies:
            estimate = max(estimate, use.policy.drain(use.room, self.waiting))
        if self.paused_until and self.paused_until > self.now:
            estimate += self.paused_until - self.now
        return estimate

    def as_dict(self) -> dict[str, Any]:
        """Return the status as JSON-ready data (times in ISO 8601, durations in seconds)."""
        return {
            "key": self.key,
            "governed_by": self.governed_by or None,
            "policies": [
                {
                    "policy_key": p.policy.key,
                    "shape": p.policy.shape,
                    "limit": p.policy.limit,
                    "period_seconds": p.policy.period.total_seconds(),
                    "burst": getattr(p.policy, "burst", None),
                    "explain": p.policy.explain(),
                    "used": p.used,
                    "capacity": p.policy.capacity(),
                    "utilisation": round(p.utilisation, 4),
                    **({"learnt": True} if p.learnt else {}),  # a limit the API announced
                }
                for p in self.policies
            ],
            "concurrency": self.concurrency,
            "in_flight": self.in_flight,
            "reserved": self.reserved,
            "running": self.running,
            "waiting": self.waiting,
            "due": self.due,
            "oldest_wait_seconds": _seconds(self.oldest_wait),
            "paused_until": _iso(self.paused_until),
            "pause_reason": self.pause_reason,
            "room": None if self.room >= gate.UNLIMITED else max(self.room, 0),
            "blocked_reason": self.blocked_reason,
            "next_free_at": _iso(self.next_free_at),
            "drain_seconds": _seconds(self.drain_time),
        }


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _seconds(value: timedelta | None) -> float | None:
    return round(value.total_seconds(), 3) if value is not None else None


def _key_state(key: str, states: dict[str, Any]) -> Any:
    return states.get(key) or KeyState(key=key)


def _status_for(key: str, state: Any, now: datetime, policies: catalog.Policies, running: int) -> KeyStatus:
    governing = policies.for_key(key)
    readings = gate.read_policies({key: governing}, {key: state}, now)[key] if governing else []
    pattern_pause = policies.pattern_pause(key)
    pauses = [t for t in (state.paused_until, pattern_pause) if t is not None and t > now]
    verdict = gate.check_key(
        key, state, now, policies, for_start=False, readings=readings, running=running
    )
    reserved_units = max(state.reserved_units or 0, 0)
    status = KeyStatus(
        key=key,
        now=now,
        policies=[
            PolicyUse(
                p, p.capacity() - p.room(r, now), max(p.room(r, now, reserved_units), 0),
                learnt=any(p is q for q in policies.learnt.get(key, ())), reserved=reserved_units,
            )
            for p, r in zip(governing, readings, strict=True)
        ],
        reserved=max(state.reserved, 0),
        running=running,
        paused_until=max(pauses) if pauses else None,
        pause_reason=state.pause_reason if state.paused_until in pauses else "pattern paused" if pauses else "",
        room=verdict.room,
    )
    if verdict.blocked:
        status.blocked_reason = verdict.reason
        status.next_free_at = verdict.until
    else:
        status.next_free_at = now
    return status


def _waiting_key_sets(now: datetime) -> list[dict[str, Any]]:
    """Return each key set with waiting calls: how many, how many due, the oldest, the earliest run_at."""
    return list(
        CallQueue.objects.pending()
        .values("key_set")
        .annotate(
            n=Count("id"), due=Count("id", filter=Q(run_at__lte=now)), oldest=Min("created_at"), first=Min("run_at")
        )
        .order_by()
    )


def waiting_by_key(now: datetime, rows: list[dict[str, Any]] | None = None) -> dict[str, tuple[int, int, datetime | None]]:
    """Return per key (waiting, due now, oldest created_at) over waiting calls, by key set."""
    totals: dict[str, tuple[int, int, datetime | None]] = {}
    for row in rows if rows is not None else _waiting_key_sets(now):
        for key in parse_key_set(row["key_set"]):
            n, due, oldest = totals.get(key, (0, 0, None))
            if oldest is None or (row["oldest"] is not None and row["oldest"] < oldest):
                oldest = row["oldest"]
            totals[key] = (n + row["n"], due + row["due"], oldest)
    return totals


def key_statuses(keys: Iterable[str] | None = None, *, now: datetime | None = None) -> list[KeyStatus]:
    """Return the live status of the given keys, or of every key worth showing, sorted by key.

    Worth showing: keys with an exact policy, with waiting or in-flight calls, with a pause,
    or that started a call in the last hour.
    """
    now = now or db_now()
    policies = catalog.Policies.load()
    waiting_sets = _waiting_key_sets(now)
    waiting = waiting_by_key(now, waiting_sets)
    running = gate.running_by_key(keys)
    if keys is None:
        wanted = set(waiting) | set(running)
        wanted.update(k for k in RateLimit.objects.values_list("key", flat=True) if not is_pattern(k))
        wanted.update(
            KeyState.objects.filter(Q(reserved__gt=0) | Q(paused_until__gt=now))
            .exclude(key__endswith="*")
            .values_list("key", flat=True)
        )
        wanted.update(
            StartLog.objects.filter(started_at__gte=now - timedelta(hours=1)).values_list("key", flat=True).distinct()
        )
    else:
        wanted = set(keys)
    states = {s.key: s for s in KeyState.objects.filter(key__in=wanted)}
    result = {}
    for key in sorted(wanted):
        status = _status_for(key, _key_state(key, states), now, policies, running.get(key, 0))
        status.waiting, status.due, status.oldest_waiting_since = waiting.get(key, (0, 0, None))
        result[key] = status
    _hold_by_other_keys(result, waiting_sets, now, policies, states, running)
    return list(result.values())


def _hold_by_other_keys(
    statuses: dict[str, KeyStatus], waiting_sets: list[dict[str, Any]], now: datetime, policies: catalog.Policies,
    states: dict[str, Any], running: dict[str, int],
) -> None:
    """Move each key's next free slot to when one of its waiting calls can really start: a call
    waits for every key it carries (and its run_at), so the slot is the earliest, over the key's
    waiting key sets, of the latest free slot of their keys."""
    # Each waiting key set read once, and found by each of its keys.
    by_key: dict[str, list[tuple[list[str], datetime]]] = {}
    for row in waiting_sets:
        keys = parse_key_set(row["key_set"])
        for key in keys:
            by_key.setdefault(key, []).append((keys, max(row["first"] or now, now)))
    others: dict[str, KeyStatus] = {}
    for status in statuses.values():
        if not status.waiting:
            continue
        status.competing = len(by_key.get(status.key, ()))
        best: tuple[datetime, str] | None = None
        unknown = False
        for keys, first in by_key.get(status.key, ()):
            moment: datetime | None = first
            holder = ""
            for other in keys:
                if other not in statuses and other not in others:
                    others[other] = _status_for(other, _key_state(other, states), now, policies, running.get(other, 0))
                free = (statuses.get(other) or others[other]).next_free_at
                if free is None or moment is None:
                    moment = None
                    continue
                if free > moment:
                    moment, holder = free, (other if other != status.key else "")
            if moment is None:
                unknown = True
            elif best is None or moment < best[0]:
                best = (moment, holder)
        if best is not None:
            status.next_free_at, status.held_by = best
        elif unknown:
            status.next_free_at = None


def starts_per_minute(key: str, *, now: datetime | None = None, minutes: int = 60) -> list[tuple[datetime, int]]:
    """Return (minute, units started) for each of the last ``minutes`` minutes of a key, oldest first."""
    now = now or db_now()
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=minutes - 1)
    counts = {
        row["minute"]: row["n"]
        for row in StartLog.objects.filter(key=key, started_at__gte=start)
        .annotate(minute=TruncMinute("started_at"))
        .values("minute")
        .annotate(n=Sum("units"))
        .order_by()
    }
    return [(start + timedelta(minutes=i), counts.get(start + timedelta(minutes=i), 0)) for i in range(minutes)]


def call_totals() -> dict[str, int]:
    """Return how many calls are stored in each status (every status named, zeros included)."""
    counts = dict(CallQueue.objects.values_list("status").annotate(n=Count("id")).order_by())
    return {status: counts.get(status, 0) for status in CallQueue.Status.values}


@dataclass
class KeyFailures:
    """Errors and give-ups of one key's calls over a recent span, with the latest error."""

    key: str
    errors: int = 0
    failed: int = 0
    latest_error: str = ""
    latest_id: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "errors": self.errors, "failed": self.failed, "latest_error": self.latest_error}


def recent_failures(now: datetime, span: timedelta = timedelta(hours=1)) -> list[KeyFailures]:
    """Return per key the attempts that ended in error and the calls that gave up within ``span``, worst first."""
    since = now - span
    found: dict[str, KeyFailures] = {}
    errors = (
        Attempt.objects.filter(finished_at__gte=since, outcome__in=[Attempt.Outcome.ERROR, Attempt.Outcome.FAILED, Attempt.Outcome.LOST])
        .values("call__key_set").annotate(n=Count("id"), last=Max("id")).order_by()
    )
    for row in errors:
        for key in parse_key_set(row["call__key_set"]) or [""]:
            item = found.setdefault(key, KeyFailures(key))
            item.errors += row["n"]
            item.latest_id = max(item.latest_id, row["last"])
    failed = (
        CallQueue.objects.filter(status=CallQueue.Status.FAILED, finished_at__gte=since)
        .values("key_set").annotate(n=Count("id")).order_by()
    )
    for row in failed:
        for key in parse_key_set(row["key_set"]) or [""]:
            found.setdefault(key, KeyFailures(key)).failed += row["n"]
    texts = dict(Attempt.objects.filter(id__in={f.latest_id for f in found.values() if f.latest_id}).values_list("id", "error"))
    for item in found.values():
        item.latest_error = (texts.get(item.latest_id, "").strip().splitlines() or [""])[0][:200]
    return sorted(found.values(), key=lambda f: (-f.failed, -f.errors, f.key))


@dataclass(frozen=True)
class Share:
    """What one key set got of a shared key over its last window, and how long its oldest call waits."""

    key_set: str
    units: int
    waiting: int
    oldest_wait: timedelta | None


def shares_of(key: str, now: datetime, window: timedelta) -> list[Share]:
    """Return, for a key that several key sets with waiting calls share, each one's units started in
    the last ``window`` and its oldest wait, least served first (the turns ``calls.shares`` keeps)."""
    waiting = {
        row["key_set"]: row
        for row in CallQueue.objects.pending().carrying(key).values("key_set")
        .annotate(n=Count("id"), oldest=Min("created_at")).order_by()
    }
    # Summed by key set in one statement: a key's window may hold a great many starts.
    started = (
        StartLog.objects.filter(key=key, started_at__gte=now - window, call_id__isnull=False)
        .annotate(key_set=Subquery(CallQueue.objects.filter(id=OuterRef("call_id")).values("key_set")[:1]))
        .exclude(key_set=None).values("key_set").annotate(units=Sum("units")).order_by()
    )
    units: dict[str, int] = {row["key_set"]: row["units"] for row in started}
    if len(set(waiting) | set(units)) < 2:
        return []
    return sorted(
        (
            Share(
                key_set, units.get(key_set, 0), waiting[key_set]["n"] if key_set in waiting else 0,
                now - waiting[key_set]["oldest"] if key_set in waiting else None,
            )
            for key_set in set(waiting) | set(units)
        ),
        key=lambda share: (share.units, share.key_set),
    )
