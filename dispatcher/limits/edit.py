"""Edits of rate policies and pauses: set, delete, pause, resume, seed from settings."""
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
    from dispatcher.managers import RateLimitManager
    from dispatcher.models import RateLimit


def set_policy(
    manager: RateLimitManager, key: str, limit: int, period: timedelta, concurrency: int | None,
    burst: int | None, replacing: int | None,
) -> RateLimit:
    """Create or update the policy of ``key`` for ``period``: a window, or a bucket with ``burst``.

    ``replacing``: the id of the policy this edits (the admin's change form); a new key or
    period makes a new policy, so that one is deleted (with its wake-up) in the same transaction.
    """
    validate_policy_key(key)
    validate_shape(limit, period, burst, concurrency)
    with transaction.atomic(using=manager.db):
        if replacing is not None:
            moved = manager.filter(pk=replacing).exclude(key=key, period=period).values_list("key", "period").first()
            if moved is not None:
                delete_policies(manager, *moved)
        if not is_pattern(key):
            # Serialise with starts of the key, which read the policies under this lock.
            locks.lock_keys([key], using=manager.db)
        old = manager.filter(key=key, period=period).first()
        policy, _ = manager.update_or_create(
            key=key, period=period, defaults={"limit": limit, "concurrency": concurrency, "burst": burst}
        )
        carry_buckets(manager, old, policy, db_now(manager.db))
        locks.wake_dispensers(using=manager.db)
    return policy


def delete_policies(manager: RateLimitManager, key: str, period: timedelta | None = None) -> int:
    """Delete the policies of ``key`` (only the one of ``period`` if given); return how many.

    Locked and woken as ``set_policy`` is: a start of the key reads the policies under its
    lock, and a dispenser waiting on the deleted policy is woken to send what it held back.
    """
    with transaction.atomic(using=manager.db):
        if not is_pattern(key):
            locks.lock_keys([key], using=manager.db)
        policies = manager.filter(key=key)
        if period is not None:
            policies = policies.filter(period=period)
        deleted, _ = policies.delete()
        if deleted:
            locks.wake_dispensers(using=manager.db)
    return deleted


def carry_buckets(manager: RateLimitManager, old: RateLimit | None, new: RateLimit, now: datetime) -> None:
    """Carry the units a key's bucket still owes into the edited policy (a new shape starts afresh)."""
    buckets = tables.KeyBucket.objects.using(manager.db).filter(period=new.period)
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
        tables.KeyBucket.objects.using(manager.db).filter(id=bucket.id).update(tat_us=to_us(tat))


def pause_key(manager: RateLimitManager, key: str, duration: timedelta, reason: str = "paused by operator") -> datetime:
    """Pause a key (or every key a pattern matches) for a duration from now."""
    validate_policy_key(key)
    if duration <= timedelta(0):
        raise ValueError("a pause must last longer than zero")
    with transaction.atomic(using=manager.db):
        until = db_now(manager.db) + duration
        ledger.pause([key], until, reason, using=manager.db)
    return until


def resume_key(manager: RateLimitManager, key: str) -> int:
    """Lift the pause of a key (or pattern); return how many pauses were lifted."""
    with_pause = tables.KeyState.objects.using(manager.db).filter(key=key, paused_until__isnull=False)
    lifted = with_pause.update(paused_until=None, pause_reason="")
    locks.wake_dispensers(using=manager.db)
    return lifted


# A weight is a share among competitors: a thousand to one is as uneven as an operator means.
MAX_WEIGHT = 1000


def set_weight(manager: RateLimitManager, key: str, weight: int | None) -> None:
    """Give the key sets that carry ``key`` (or a key a pattern matches) ``weight`` shares of a key
    they share with others (None: the default, 1)."""
    validate_policy_key(key)
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= MAX_WEIGHT):
        raise ValueError(f"a weight must be a whole number between 1 and {MAX_WEIGHT}, not {weight!r}")
    states = tables.KeyState.objects.using(manager.db)
    with transaction.atomic(using=manager.db):
        states.bulk_create([tables.KeyState(key=key)], ignore_conflicts=True)
        states.filter(key=key).update(weight=weight)
        locks.wake_dispensers(using=manager.db)


def seed_from_settings(manager: RateLimitManager) -> int:
    """Upsert the policies listed in DISPATCHER_RATE_LIMITS; return how many."""
    count = 0
    for entry in dispatcher_settings.RATE_LIMITS:
        try:
            set_policy(
                manager, entry["key"], int(entry["limit"]), parse_positive_duration(entry["period"]),
                int(entry["concurrency"]) if entry.get("concurrency") else None,
                int(entry["burst"]) if entry.get("burst") is not None else None, None,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ImproperlyConfigured(f"DISPATCHER_RATE_LIMITS entry {entry!r}: {exc}") from exc
        count += 1
    return count
