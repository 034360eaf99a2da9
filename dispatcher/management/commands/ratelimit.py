"""python manage.py ratelimit set|list|pause|resume|delete: edit rate policies without a deploy."""
from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatcher.clock import db_now
from dispatcher.durations import format_duration, format_moment, parse_positive_duration
from dispatcher.keys import is_pattern, pattern_matches, validate_policy_key
from dispatcher.limits import edit
from dispatcher.limits.shapes import PolicyError
from dispatcher.models import CallQueue, KeyState, RateLimit

# The columns of `ratelimit list`: key, limit per period, shape (window or bucket), burst, concurrency.
LIST_ROW = "{:<40} {:>8} {:<8} {:<6} {:>6} {:>11}"


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise CommandError(f"{name} must be a whole number, not {text!r}") from None
        if not 1 <= value <= 2**31 - 1:
            raise CommandError(f"{name} must be between 1 and {2**31 - 1}, not {value}")
        return value

    return parse


def _duration(name: str) -> Callable[[str], timedelta]:
    def parse(text: str) -> timedelta:
        try:
            return parse_positive_duration(text)
        except ValueError as exc:
            raise CommandError(f"{name}: {exc}") from None

    return parse


def _key(text: str) -> str:
    try:
        return validate_policy_key(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def _known(key: str) -> bool:
    """Whether a key is known: a policy (exact or a matching pattern), limiter state, or a waiting call."""
    patterns = [p for p in RateLimit.objects.values_list("key", flat=True).distinct() if is_pattern(p)]
    return (
        RateLimit.objects.filter(key=key).exists()
        or any(pattern_matches(p, key) for p in patterns)
        or KeyState.objects.filter(key=key).exists()
        or CallQueue.objects.pending().carrying(key).exists()
    )


class Command(BaseCommand):
    help = "Set, list, pause, resume and delete rate-limit policies."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        set_ = sub.add_parser("set", help="create or update the policy of KEY for one period")
        set_.add_argument("key", help="an exact key, or a pattern ending in '*'")
        set_.add_argument("--limit", required=True, help="calls per period (at least 1)")
        set_.add_argument("--per", required=True, help="the period, e.g. 500ms, 2s, 5m, 1h, 1d")
        set_.add_argument(
            "--burst", default=None,
            help="make it a token bucket this deep, refilling at LIMIT per period (1: evenly spaced calls); "
            "without it, a sliding window",
        )
        set_.add_argument("--concurrency", default=None, help="most calls in flight at once")
        list_ = sub.add_parser("list", help="list the policies and pauses")
        list_.add_argument("--json", action="store_true", dest="as_json", help="print JSON")
        pause = sub.add_parser("pause", help="pause KEY (or every key of a pattern)")
        pause.add_argument("key")
        pause.add_argument("--for", dest="duration", required=True, help="how long, e.g. 30s, 5m")
        pause.add_argument("--create", action="store_true",
                           help="pause a key that no policy, pattern or call knows yet (guards against typos)")
        resume = sub.add_parser("resume", help="lift the pause of KEY")
        resume.add_argument("key")
        delete = sub.add_parser("delete", help="delete the policies of KEY")
        delete.add_argument("key")
        delete.add_argument("--per", default=None, help="only the policy with this period")
        weight = sub.add_parser(
            "weight", help="give calls carrying KEY (or a pattern's keys) W shares of a key they share with others"
        )
        weight.add_argument("key")
        weight.add_argument("weight", help="a whole number from 1 to 1000, or 'default' (1)")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        getattr(self, f"do_{action}")(**options)

    def do_set(self, key: str, limit: str, per: str, concurrency: str | None, burst: str | None, **_: Any) -> None:
        key = _key(key)
        limit_value = _positive_int("--limit")(limit)
        period = _duration("--per")(per)
        cap = _positive_int("--concurrency")(concurrency) if concurrency is not None else None
        depth = _positive_int("--burst")(burst) if burst is not None else None
        try:
            policy = edit.set_policy(key, limit_value, period, cap, burst=depth)
        except PolicyError as exc:
            raise CommandError(str(exc)) from None
        in_flight = f"; at most {policy.concurrency} in flight" if policy.concurrency else ""
        self.stdout.write(f"set {policy.key}: {policy.as_policy().explain()}{in_flight}")

    def do_list(self, as_json: bool = False, **_: Any) -> None:
        policies = list(RateLimit.objects.order_by("key", "period"))
        # Only pauses still in force: an expired pause binds nothing.
        in_force = KeyState.objects.filter(paused_until__gt=db_now()).order_by("key")
        pauses = [(s.key, s.paused_until, s.pause_reason) for s in in_force if s.paused_until is not None]
        if as_json:
            self.stdout.write(json.dumps({
                "policies": [
                    {
                        "key": p.key, "shape": p.as_policy().shape, "limit": p.limit,
                        "period_seconds": p.period.total_seconds(), "burst": p.burst, "concurrency": p.concurrency,
                    }
                    for p in policies
                ],
                "pauses": [{"key": key, "paused_until": until.isoformat(), "reason": reason} for key, until, reason in pauses],
            }, indent=2))
            return
        if not policies:
            self.stdout.write("no policies")
        else:
            self.stdout.write(LIST_ROW.format("KEY", "LIMIT", "PER", "SHAPE", "BURST", "CONCURRENCY"))
        for p in policies:
            self.stdout.write(LIST_ROW.format(
                p.key, p.limit, format_duration(p.period), p.as_policy().shape, p.burst or "-", p.concurrency or "-",
            ))
        now = db_now()
        for key, until, reason in pauses:
            why = f" ({reason})" if reason else ""
            self.stdout.write(f"paused {key} until {format_moment(until, now)}{why}")

    def do_pause(self, key: str, duration: str, create: bool = False, **_: Any) -> None:
        key = _key(key)
        length = _duration("--for")(duration)
        if not create and not _known(key):
            raise CommandError(
                f"no policy, pattern, limiter state or waiting call knows the key {key!r}: check its spelling, "
                "or pass --create to pause it anyway"
            )
        until = edit.pause_key(key, length)
        self.stdout.write(f"paused {key} until {format_moment(until, db_now())}")

    def do_resume(self, key: str, **_: Any) -> None:
        lifted = edit.resume_key(_key(key))
        self.stdout.write(f"resumed {key}" if lifted else f"{key} was not paused")

    def do_delete(self, key: str, per: str | None, **_: Any) -> None:
        period = _duration("--per")(per) if per is not None else None
        deleted = edit.delete_policies(_key(key), period)
        if not deleted:
            raise CommandError(f"no policy for {key!r}" + (f" per {per}" if per else ""))
        self.stdout.write(f"deleted {deleted} polic{'y' if deleted == 1 else 'ies'} of {key}")

    def do_weight(self, key: str, weight: str, **_: Any) -> None:
        key = _key(key)
        value = None if weight == "default" else _positive_int("weight")(weight)
        try:
            edit.set_weight(key, value)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"weight of {key}: {value or 1}" + (" (the default)" if value is None else ""))
