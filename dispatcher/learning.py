"""Adapt keys to what an API says about its limits: pause while nothing remains, learn tighter limits.

Which keys: the key a handler names, else the keys of the call being run (the worker sets them
in ``current_keys`` around the handler). A learnt limit is one more window policy on the key
(see ``limiter.Policies.load``): it can only hold calls back, never let more through than the
configured policies. Pauses are cut to ``DISPATCHER_MAX_PAUSE``, learnt windows to that and to
an hour, and a learnt limit lasts ``DISPATCHER_LEARNT_LIMIT_TTL`` after
the API last said it.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta

from django.db import transaction

from dispatcher import limiter, tables
from dispatcher.clock import db_now
from dispatcher.conf import dispatcher_settings
from dispatcher.ratelimit_headers import Signal, signal

log = logging.getLogger("dispatcher")

# A learnt window is this much (and at least MARGIN_MIN) longer than the API's.
MARGIN = 0.05
MARGIN_MIN = timedelta(milliseconds=50)

# (key, limit, period) -> when this process last stored it: an API repeating the same limit on
# every answer costs a write per REFRESH, not per call. Bounded; cleared when full.
_stored: dict[tuple[str, int, timedelta], float] = {}
REFRESH = 30.0
MAX_REMEMBERED = 10_000

current_keys: ContextVar[tuple[str, ...]] = ContextVar("dispatcher_current_keys", default=())


@contextmanager
def running_call(keys: Sequence[str]) -> Iterator[None]:
    """Name the keys of the call a handler is running, for the signals it reports."""
    token = current_keys.set(tuple(keys))
    try:
        yield
    finally:
        current_keys.reset(token)


def cap_pause(seconds: float | None) -> float | None:
    """Return a pause cut to DISPATCHER_MAX_PAUSE (``None`` stays ``None``)."""
    if seconds is None or seconds != seconds:
        return None
    return min(max(seconds, 0.0), dispatcher_settings.MAX_PAUSE.total_seconds())


def apply(found: Signal, keys: Sequence[str] | None = None) -> None:
    """Pause and teach the keys what the API said; a failure here never fails the call."""
    keys = tuple(keys) if keys else current_keys.get()
    if found.empty or not keys:
        return
    try:
        _apply(found, keys)
    except Exception:  # the call's own outcome matters more than the lesson
        log.exception("learn_failed keys=%s signal=%r", ",".join(keys), found.text)


def _apply(found: Signal, keys: tuple[str, ...]) -> None:
    # The window log keeps at least an hour of starts (limiter.prune_starts): no learnt window
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
    spent = _spent_by_running(found, keys)
    if not wait and not windows and not spent:
        return
    with transaction.atomic():
        now = db_now()
        if wait:
            limiter.pause(keys, now + timedelta(seconds=wait), reason=f"API said: {found.text}"[:200])
        elif spent:
            # r remain and at least r other calls of the key are already running (they will
            # arrive): nothing more may start before the reset.
            until = now + timedelta(seconds=cap_pause(found.reset) or 0)
            limiter.pause(spent, until, reason=f"API said: {found.text}; the rest is in flight"[:200])
        expires = now + dispatcher_settings.LEARNT_LIMIT_TTL
        if windows:
            tables.LearntLimit.objects.filter(key__in=keys, expires_at__lte=now).delete()
        for limit, period in windows:
            for key in keys:
                _learn(tables.LearntLimit, key, limit, period, expires, found, now)
        limiter.wake_dispensers()
    if len(_stored) > MAX_REMEMBERED:
        _stored.clear()
    for limit, period in windows:
        for key in keys:
            _stored[(key, limit, period)] = fresh
    log.info("learnt keys=%s signal=%r", ",".join(keys), found.text)


def _spent_by_running(found: Signal, keys: tuple[str, ...]) -> list[str]:
    """Return the keys whose other running calls already use up what the API says remains."""
    if not found.remaining or not found.reset or found.wait() is not None:
        return []
    # The call being answered is one of the running ones, and the API counted it already.
    return [key for key, n in limiter.running_by_key(keys).items() if n - 1 >= found.remaining]


def _learn(model, key: str, limit: int, period: timedelta, expires, found: Signal, now) -> None:
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
