"""Edits of rate policies and pauses: set, delete, pause, resume, weigh, seed from settings.

The door for policies: the ``ratelimit`` command, the admin and ``DISPATCHER_RATE_LIMITS`` edit
through these functions (``from dispatcher.limits import edit``; ``edit.set_policy("mailgun",
100, timedelta(minutes=1))``). Each runs in its own transaction on ``using`` (the router's
database for the limiter's tables by default), locks the key as a start does and wakes the
dispensers.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from dispatcher import tables
from dispatcher.clock import db_now, from_us, to_us
from dispatcher.conf import dispatcher_settings
from dispatcher.durations import parse_positive_duration
from dispatcher.keys import is_pattern, validate_policy_key
from dispatcher.limits import ledger, locks
from dispatcher.limits.shapes import TokenBucket
from dispatcher.limits.shapes import validate as validate_shape

if TYPE_CHECKING:
    from dispatcher.tables import RateLimit


def set_policy(
    key: str, limit: int, period: timedelta, concurrency: int | None = None, *,
    burst: int | None = None, replacing: int | None = None, using: str | None = None,
) -> RateLimit:
    """Create or update the policy of ``key`` for ``period``: a window, or a bucket with ``burst``.

    ``replacing``: the id of the policy this edits (the admin's change form); a new key or
    period makes a new policy, so that one is deleted (with its wake-up) in the same transaction.
    """
    validate_policy_key(key)
    validate_shape(limit, period, burst, concurrency)
    db = locks.alias(using)
    policies = tables.RateLimit.objects.using(db)
    with transaction.atomic(using=db):
        if replacing is not None:
            moved = policies.filter(pk=replacing).exclude(key=key, period=period).values_list("key", "period").first()
            if moved is not None:
                delete_policies(*moved, using=db)
        if not is_pattern(key):
            # Serialise with starts of the key, which read the policies under this lock.
            locks.lock_keys([key], using=db)
        old = policies.filter(key=key, period=period).first()
        policy, _ = policies.update_or_create(
            key=key, period=period, defaults={"limit": limit, "concurrency": concurrency, "burst": burst}
        )
        carry_buckets(old, policy, db_now(db), using=db)
        locks.wake_dispensers(using=db)
    return policy


def delete_policies(key: str, period: timedelta | None = None, *, using: str | None = None) -> int:
    """Delete the policies of ``key`` (only the one of ``period`` if given); return how many.

    Locked and woken as ``set_policy`` is: a start of the key reads the policies under its
    lock, and a dispenser waiting on the deleted policy is woken to send what it held back.
    """
    db = locks.alias(using)
    with transaction.atomic(using=db):
        if not is_pattern(key):
            locks.lock_keys([key], using=db)
        policies = tables.RateLimit.objects.using(db).filter(key=key)
        if period is not None:
            policies = policies.filter(period=period)
        deleted, _ = policies.delete()
        if deleted:
            locks.wake_dispensers(using=db)
    return deleted


def carry_buckets(old: RateLimit | None, new: RateLimit, now: datetime, *, using: str) -> None:
    """Carry the units a key's bucket still owes into the edited policy (a new shape starts afresh)."""
    buckets = tables.KeyBucket.objects.using(using).filter(period=new.period)
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
        tables.KeyBucket.objects.using(using).filter(id=bucket.id).update(tat_us=to_us(tat))


def pause_key(key: str, duration: timedelta, reason: str = "paused by operator", *, using: str | None = None) -> datetime:
    """Pause a key (or every key a pattern matches) for a duration from now."""
    validate_policy_key(key)
    if duration <= timedelta(0):
        raise ValueError("a pause must last longer than zero")
    db = locks.alias(using)
    with transaction.atomic(using=db):
        until = db_now(db) + duration
        ledger.pause([key], until, reason, using=db)
    return until


def resume_key(key: str, *, using: str | None = None) -> int:
    """Lift the pause of a key (or pattern); return how many pauses were lifted."""
    db = locks.alias(using)
    with_pause = tables.KeyState.objects.using(db).filter(key=key, paused_until__isnull=False)
    lifted = with_pause.update(paused_until=None, pause_reason="")
    locks.wake_dispensers(using=db)
    return lifted


# A weight is a share among competitors: a thousand to one is as uneven as an operator means.
MAX_WEIGHT = 1000


def set_weight(key: str, weight: int | None, *, using: str | None = None) -> None:
    """Give the key sets that carry ``key`` (or a key a pattern matches) ``weight`` shares of a key
    they share with others (None: the default, 1)."""
    validate_policy_key(key)
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT):
        raise ValueError(f"a weight must be a whole number between 1 and {MAX_WEIGHT}, not {weight!r}")
    db = locks.alias(using)
    states = tables.KeyState.objects.using(db)
    with transaction.atomic(using=db):
        states.bulk_create([tables.KeyState(key=key)], ignore_conflicts=True)
        states.filter(key=key).update(weight=weight)
        locks.wake_dispensers(using=db)


def seed_from_settings(*, using: str | None = None) -> int:
    """Upsert the policies listed in DISPATCHER_RATE_LIMITS; return how many."""
    count = 0
    for entry in dispatcher_settings.RATE_LIMITS:
        try:
            set_policy(
                entry["key"], int(entry["limit"]), parse_positive_duration(entry["period"]),
                int(entry["concurrency"]) if entry.get("concurrency") else None,
                burst=int(entry["burst"]) if entry.get("burst") is not None else None, using=using,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"DISPATCHER_RATE_LIMITS entry {entry!r}: {exc}") from exc
        count += 1
    return count
