"""Adapt keys to what an API says about its limits: pause while nothing remains, learn tighter limits.

Which keys: the key a handler names, else the keys of the call being run (the worker sets them
in its ``dispatcher.running.Run`` around the handler). A learnt limit is one more window policy on the key
(see ``catalog.Policies.load``): it can only hold calls back, never let more through than the
configured policies. Pauses are cut to ``DISPATCHER_MAX_PAUSE``, learnt windows to that and to
an hour, and a learnt limit lasts ``DISPATCHER_LEARNT_LIMIT_TTL`` after
the API last said it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import Count, Exists, Max, Min, OuterRef, Q, Sum
from django.db.models.expressions import RawSQL

from dispatcher import tables
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.limits import gate, ledger, locks
from dispatcher.ratelimit_headers import Signal, signal
from dispatcher.running import here
from dispatcher.states import AttemptOutcome, CallStatus
from dispatcher.store import call_sql

if TYPE_CHECKING:
    from dispatcher.models import LearntLimit

log = logging.getLogger("dispatcher")

# A learnt window is this much (and at least MARGIN_MIN) longer than the API's.
MARGIN = 0.05
MARGIN_MIN = timedelta(milliseconds=50)

# (key, limit, period) -> when this process last stored it: an API repeating the same limit on
# every answer costs a write per REFRESH, not per call. Bounded; cleared when full.
_stored: dict[tuple[str, int, timedelta], float] = {}
REFRESH = 30.0
MAX_REMEMBERED = 10_000

# Learnt limits inferred from Retry-After kept per key (the most recent ones).
MAX_INFERRED = 4
# What one API's answers may leave per key, whatever they say (SPEC invariant 9): at most this
# many learnt rows (the most recently observed are kept; a policy shows up to 4 windows, plus a
# budget and the Retry-After lessons) ...
MAX_LEARNT_PER_KEY = 8
# ... and at most this many *new* lessons (a window not already learnt) per key and minute in one
# process: an API announcing a fresh window on every answer costs a write a few times a minute,
# not one per answer. A repeated lesson is not new and only refreshes (see REFRESH).
NEW_LESSONS_PER_MINUTE = 12
_new_lessons: dict[str, tuple[int, set[tuple[int, float | None]]]] = {}
_throttled: dict[tuple[str, ...], int] = {}


def cap_pause(seconds: float | None) -> float | None:
    """Return a pause cut to DISPATCHER_MAX_PAUSE (``None`` stays ``None``)."""
    if seconds is None or seconds != seconds:
        return None
    return min(max(seconds, 0.0), dispatcher_settings.MAX_PAUSE.total_seconds())


def apply(found: Signal, keys: Sequence[str] | None = None) -> None:
    """Pause and teach the keys what the API said; a failure here never fails the call."""
    keys = tuple(keys) if keys else here().keys
    if found.empty or not keys:
        return
    try:
        _apply(found, keys)
    except Exception:  # the call's own outcome matters more than the lesson
        log.exception("learn_failed keys=%s signal=%r", ",".join(keys), found.text)


def _apply(found: Signal, keys: tuple[str, ...]) -> None:
    # The window log keeps at least an hour of starts (ledger.prune_starts): no learnt window
    # may be longer, or it would count fewer starts than it should.
    longest = min(dispatcher_settings.MAX_PAUSE, timedelta(hours=1))
    wait = cap_pause(found.wait())
    # A margin absorbs the spread between our recorded starts and their arrival at the API.
    # X-RateLimit-* name no window, only the time left in it: whole seconds, so that a reset
    # that ticks down from answer to answer does not make a new window each time.
    seconds = [w.seconds if found.source == "ietf" else float(math.ceil(w.seconds)) for w in found.windows[:4]]
    windows = [
        (max(w.limit, 1), min(timedelta(seconds=s * (1 + MARGIN)) + MARGIN_MIN, longest))
        for w, s in zip(found.windows[:4], seconds, strict=True)
    ]
    fresh = time.monotonic()
    windows = [(limit, period) for limit, period in windows
               if any(fresh - _stored.get((key, limit, period), -REFRESH) >= REFRESH for key in keys)]
    windows = _admitted_lessons(keys, windows, named=found.source == "ietf", now=fresh)
    budgets = _budgets(found, keys) if wait is None else {}
    spent = [key for key, allowed in budgets.items() if allowed <= 0]
    if not wait and not windows and not budgets:
        return
    with transaction.atomic():
        now = db_now()
        if wait:
            ledger.pause(keys, now + timedelta(seconds=wait), reason=f"API said: {found.text}"[:200])
        elif spent:
            # r remain and at least r other calls of the key are already running (they will
            # arrive): nothing more may start before the reset.
            until = now + timedelta(seconds=cap_pause(found.reset) or 0)
            ledger.pause(spent, until, reason=f"API said: {found.text}; the rest is in flight"[:200])
        expires = now + dispatcher_settings.LEARNT_LIMIT_TTL
        if windows or budgets:
            tables.LearntLimit.objects.filter(key__in=keys, expires_at__lte=now).delete()
        for key, allowed in budgets.items():
            if allowed > 0:
                _budget(tables.LearntLimit, key, allowed, timedelta(seconds=found.reset or 0), longest, found, now)
        for limit, period in windows:
            for key in keys:
                _learn(tables.LearntLimit, key, limit, period, expires, found, now)
        if windows or budgets:
            for key in keys:
                bound_rows(key)
        locks.wake_dispensers()
    if len(_stored) > MAX_REMEMBERED:
        _stored.clear()
    for limit, period in windows:
        for key in keys:
            _stored[(key, limit, period)] = fresh
    log.info("learnt keys=%s signal=%r", ",".join(keys), found.text)


def _admitted_lessons(
    keys: tuple[str, ...], windows: list[tuple[int, timedelta]], *, named: bool, now: float,
) -> list[tuple[int, timedelta]]:
    """Return the windows this process may store now: each key takes NEW_LESSONS_PER_MINUTE new ones a minute.

    A lesson is new for a key when its (limit, period) was not learnt in the current minute
    (X-RateLimit-* name no window: their lessons differ by limit only, as ``_learn`` keeps one
    row per limit). A window any key cannot take is dropped for every key of the call.
    """
    if not windows:
        return windows
    minute = int(now // 60)
    if len(_new_lessons) > MAX_REMEMBERED:
        _new_lessons.clear()
    kept = []
    for limit, period in windows:
        lesson = (limit, period.total_seconds() if named else None)
        taken = []
        for key in keys:
            seen_minute, seen = _new_lessons.get(key, (minute, set()))
            if seen_minute != minute:
                seen = set()
            if lesson not in seen and len(seen) >= NEW_LESSONS_PER_MINUTE:
                break
            taken.append((key, seen))
        else:
            for key, seen in taken:
                seen.add(lesson)
                _new_lessons[key] = (minute, seen)
            kept.append((limit, period))
    if len(kept) < len(windows) and _throttled.get(keys) != minute:
        # Once per key set and minute: the log must not grow with the answers either.
        if len(_throttled) > MAX_REMEMBERED:
            _throttled.clear()
        _throttled[keys] = minute
        log.warning("learn_throttled keys=%s dropped=%d (more new lessons this minute are dropped)",
                    ",".join(keys), len(windows) - len(kept))
    return kept


def bound_rows(key: str) -> int:
    """Keep a key's MAX_LEARNT_PER_KEY most recently observed learnt rows; return how many were deleted."""
    model = tables.LearntLimit
    stale = list(
        model.objects.filter(key=key).order_by("-observed_at", "-id").values_list("pk", flat=True)[MAX_LEARNT_PER_KEY:]
    )
    if not stale:
        return 0
    return model.objects.filter(pk__in=stale).delete()[0]


def _budgets(found: Signal, keys: tuple[str, ...]) -> dict[str, int]:
    """Return, per key, how many more calls may start before the reset: r less the others in flight.

    The call being answered is one of the running ones, and the API counted it already; the
    other running calls will arrive and spend what remains. 0 or less: nothing more may start.
    """
    if not found.remaining or not found.reset or found.wait() is not None:
        return {}
    running = gate.running_by_key(keys)
    budgets = {key: found.remaining - max(running.get(key, 0) - 1, 0) for key in keys}
    if found.windows and all(n > 0 for n in budgets.values()):
        # When the API has counted no more calls in its window than the key started in it, the
        # learnt window already caps what starts before the reset (the starts in flight are in
        # our log, not yet in the API's count): no budget is needed, and none is written.
        # Our window: the API's, or the longest learnt for its limit (X-RateLimit's reset is only
        # the time left in the API's window).
        window = found.windows[0]
        now = db_now()
        learnt = dict(
            tables.LearntLimit.objects.filter(key__in=keys, limit=window.limit, expires_at__gt=now).values("key")
            .annotate(p=Max("period")).values_list("key", "p")
        )
        used = window.limit - found.remaining
        for key in list(budgets):
            span = max(timedelta(seconds=window.seconds), learnt.get(key) or timedelta(0))
            if tables.StartLog.objects.filter(key=key, started_at__gt=now - span).count() >= used:
                del budgets[key]
    return budgets


def _budget(
    model: type[LearntLimit], key: str, allowed: int, until: timedelta, longest: timedelta, found: Signal, now: datetime
) -> None:
    """Cap the key's starts before the reset at ``allowed``: one budget row per key, the latest answer's.

    A learnt window expiring at the reset T, reaching back to the earliest start of the key's
    running calls (s), admitting ``allowed`` more starts than the log holds since s: at any t
    before T the window (t - (T - s), t] holds every start since s, so at most ``allowed`` new
    ones fit (older starts still in it only make it tighter).
    """
    if until <= timedelta(0):
        return
    source = f"{found.source or 'handler'}:remaining"[:40]
    model.objects.filter(key=key, source=source).delete()
    running = RawSQL(call_sql.running_calls("id"), [CallStatus.RUNNING])
    first = (
        tables.StartLog.objects.filter(key=key, call_id__in=running, started_at__lte=now)
        .order_by("started_at").values_list("started_at", flat=True).first()
    ) or now
    # In units, as the window counts them (a call of cost c takes c of the ``allowed``).
    since = tables.StartLog.objects.filter(key=key, started_at__gte=first, started_at__lte=now).aggregate(
        units=Sum("units"))["units"] or 0
    period = until + (now - first)
    if period > longest:
        return  # not representable by a window the start log keeps; the learnt window paces
    # (key, period) is unique: a budget never replaces a learnt window of the very same period.
    for _ in range(100):
        if not model.objects.filter(key=key, period=period).exists():
            break
        period += timedelta(microseconds=1)
    else:
        return
    model.objects.create(
        key=key, limit=allowed + since, period=period, expires_at=now + until, source=source,
        signal=f"{found.text}; {allowed} may start before the reset"[:200], observed_at=now,
    )


def _learn(
    model: type[LearntLimit], key: str, limit: int, period: timedelta, expires: datetime, found: Signal, now: datetime
) -> None:
    """Store a window the API announced; an unnamed window grows to the longest reset seen."""
    if found.source != "ietf":
        # X-RateLimit-* name no window: the reset is the time left in it. Keep one row per
        # key and limit, whose period is the longest reset seen while it lasted.
        row = model.objects.filter(key=key, limit=limit, expires_at__gt=now).order_by("-period").first()
        if row is not None:
            if period > row.period:
                model.objects.filter(key=key, period=period).exclude(pk=row.pk).delete()
                row.period = period
            row.expires_at, row.signal, row.observed_at = expires, found.text[:200], now
            row.save(update_fields=["period", "expires_at", "signal", "observed_at"])
            return
    model.objects.update_or_create(
        key=key, period=period,
        defaults={"limit": limit, "expires_at": expires, "source": found.source[:40], "signal": found.text[:200], "observed_at": now},
    )


def infer_from_retry_after(retry_after: float | None, text: str = "", keys: Sequence[str] | None = None) -> None:
    """Learn a limit from a 429 that says nothing but ``Retry-After``.

    The API admitted the key's calls that started since its last refusal and refused this one
    until the reset: it allows (at most) that many calls from the first of them to the reset.
    That becomes a learnt window (source ``retry-after``), with the same margin, bounds and
    expiry as an announced one, so an API that never states its limit costs 429s in its first
    window only, not one per window. A failure here never fails the call.
    """
    keys = tuple(keys) if keys else here().keys
    started = here().started_at
    wait = cap_pause(retry_after)
    if not keys or started is None or not wait:
        return
    try:
        _infer(keys, started, wait, text)
    except Exception:  # the call's own outcome matters more than the lesson
        log.exception("learn_failed keys=%s retry_after=%r", ",".join(keys), retry_after)


def _infer(keys: tuple[str, ...], started: datetime, wait: float, text: str) -> None:
    longest = min(dispatcher_settings.MAX_PAUSE, timedelta(hours=1))
    with transaction.atomic():
        # One lesson at a time per key: the calls refused in flight with this one wait for it,
        # then see it and learn nothing more from the same starts.
        locks.lock_keys(sorted(set(keys)))
        now = db_now()
        reset = now + timedelta(seconds=wait)
        ttl = dispatcher_settings.LEARNT_LIMIT_TTL
        for key in keys:
            since = started - longest
            # The last lesson drawn from a Retry-After: its observed_at is the start of the call
            # whose refusal taught it, its expiry less the TTL when it was drawn.
            last = tables.LearntLimit.objects.filter(key=key, source="retry-after").order_by("-observed_at").first()
            if last is not None and started < last.expires_at - ttl:
                # Refused in flight, started before that lesson was drawn: nothing new to learn.
                # Started before the call that taught it too, it was counted as admitted there.
                if started < last.observed_at and last.limit > 1 and started >= last.observed_at - last.period:
                    tables.LearntLimit.objects.filter(pk=last.pk).update(limit=last.limit - 1)
                    log.info("learnt_from_retry_after keys=%s limit=%s (one counted was refused)", key, last.limit - 1)
                continue
            if last is not None and last.expires_at - ttl > since:
                since = last.expires_at - ttl
            admitted, first = _admitted_since_refused(key, since, started)
            if not admitted or first is None or reset <= first:
                continue
            span = (reset - first).total_seconds()
            period = min(timedelta(seconds=span * (1 + MARGIN)) + MARGIN_MIN, longest)
            tables.LearntLimit.objects.filter(key=key, expires_at__lte=now).delete()
            tables.LearntLimit.objects.update_or_create(
                key=key, period=period,
                defaults={
                    "limit": admitted, "expires_at": now + dispatcher_settings.LEARNT_LIMIT_TTL,
                    "source": "retry-after", "observed_at": started,
                    "signal": f"{text or f'Retry-After {wait:g}s'}; {admitted} admitted in {span:.3g}s"[:200],
                },
            )
            stale = tables.LearntLimit.objects.filter(key=key, source="retry-after").order_by("-observed_at")[MAX_INFERRED:]
            tables.LearntLimit.objects.filter(pk__in=list(stale.values_list("pk", flat=True))).delete()
            bound_rows(key)
            log.info("learnt_from_retry_after keys=%s limit=%s period=%s", key, admitted, period)


def _admitted_since_refused(key: str, since: datetime, started: datetime) -> tuple[int, datetime | None]:
    """Return how many of the key's calls started in [since, started) the API admitted since it
    last refused one of them (their starts in the log's order after the last refused start),
    and when the first of them started. Two aggregate statements: a busy key's hour of starts
    is counted by the database, not loaded (100,000 of them, loaded with their attempts, held
    the key's lock for 1.5 s)."""
    logged = tables.StartLog.objects.filter(key=key, started_at__gte=since, started_at__lt=started, call_id__isnull=False)
    refusal = tables.Attempt.objects.filter(
        call_id=OuterRef("call_id"), started_at=OuterRef("started_at"), outcome=AttemptOutcome.RATE_LIMITED
    )
    last = logged.filter(Exists(refusal)).order_by("-started_at", "-cum", "-id").values_list("started_at", "cum", "id").first()
    if last is not None:
        at, cum, pk = last
        logged = logged.filter(Q(started_at__gt=at) | Q(started_at=at, cum__gt=cum) | Q(started_at=at, cum=cum, id__gt=pk))
    found = logged.aggregate(admitted=Count("id"), first=Min("started_at"))
    return found["admitted"], found["first"]


def report_rate_limit(
    *, limit: int | None = None, window: float | None = None, remaining: int | None = None,
    reset: float | None = None, retry_after: float | None = None, key: str | None = None,
) -> None:
    """Tell the dispatcher what an API said about its limits, from inside a handler.

    For APIs with headers of their own (``X-Used: 40/100``): ``limit`` per ``window``
    seconds, ``remaining`` until ``reset`` seconds from now. ``key`` defaults to the call's keys.
    """
    apply(
        signal(limit=limit, window=window, remaining=remaining, reset=reset, retry_after=retry_after),
        [key] if key else None,
    )
