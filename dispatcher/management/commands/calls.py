"""python manage.py calls list|retry|cancel: find failed or waiting calls, retry or cancel them by id."""
from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatcher.clock import db_now
from dispatcher.durations import format_moment
from dispatcher.models import CallQueue

# --status takes a state's value or its label, as the admin shows it ("waiting" for "pending").
STATUSES = {**{label.lower(): value for value, label in CallQueue.Status.choices}, **{v: v for v in CallQueue.Status.values}}
MAX_LIMIT = 10_000


def _call_id(text: str) -> int:
    try:
        value = int(text.lstrip("#"))
    except ValueError:
        raise CommandError(f"a call id is a whole number, not {text!r}") from None
    if value < 1:
        raise CommandError(f"a call id is at least 1, not {value}")
    return value


class Command(BaseCommand):
    help = "List calls (e.g. the failed ones), retry them now, or cancel waiting ones."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True, title="actions")
        list_ = sub.add_parser("list", help="list calls, newest first")
        list_.add_argument("--status", choices=list(STATUSES), default=None, help="only calls in this state")
        list_.add_argument("--key", default=None, help="only calls that carry this key")
        list_.add_argument("--method", default=None, help="only calls of this method")
        list_.add_argument("--limit", default="50", help=f"most calls listed (1 to {MAX_LIMIT}, default 50)")
        list_.add_argument("--json", action="store_true", dest="as_json", help="print JSON")
        retry = sub.add_parser("retry", help="make waiting calls due now; give failed calls one more attempt")
        retry.add_argument("ids", nargs="+", metavar="ID")
        cancel = sub.add_parser("cancel", help="cancel waiting calls")
        cancel.add_argument("ids", nargs="+", metavar="ID")

    def handle(self, *args: Any, action: str, **options: Any) -> None:
        getattr(self, f"do_{action}")(**options)

    def do_list(self, status: str | None, key: str | None, method: str | None, limit: str, as_json: bool,
                **_: Any) -> None:
        try:
            count = int(limit)
        except ValueError:
            raise CommandError(f"--limit must be a whole number, not {limit!r}") from None
        if not 1 <= count <= MAX_LIMIT:
            raise CommandError(f"--limit must be between 1 and {MAX_LIMIT}, not {count}")
        calls = CallQueue.objects.order_by("-id")
        if status:
            calls = calls.filter(status=STATUSES[status])
        if key:
            # key_set is the sorted keys as JSON text: the quoted key matches one element exactly.
            calls = calls.carrying(key)
        if method:
            calls = calls.filter(method=method)
        rows = list(calls[:count])
        if as_json:
            self.stdout.write(json.dumps([
                {"id": c.id, "method": c.method, "status": c.status, "keys": c.keys, "attempts": c.attempts,
                 "max_attempts": c.max_attempts, "deferrals": c.deferrals, "created_at": c.created_at.isoformat(),
                 "finished_at": c.finished_at.isoformat() if c.finished_at else None, "last_error": c.last_error}
                for c in rows
            ], indent=2))
            return
        if not rows:
            self.stdout.write("no calls match")
            return
        now = db_now()
        for c in rows:
            error = (c.last_error.strip().splitlines() or [""])[0][:100]
            when = format_moment(c.finished_at or c.created_at, now)
            self.stdout.write(
                f"#{c.id}  {c.get_status_display().lower():<10} {c.method:<20} {','.join(c.keys) or '-':<24} "
                f"attempts {c.attempts}/{c.max_attempts}  {'finished' if c.finished_at else 'created'} {when}"
                + (f"  error: {error}" if error else "")
            )
        if len(rows) == count:
            self.stdout.write(f"(first {count}; --limit shows more)")

    def _existing(self, ids: list[str]) -> list[int]:
        wanted = [_call_id(text) for text in ids]
        found = set(CallQueue.objects.filter(id__in=wanted).values_list("id", flat=True))
        missing = [i for i in wanted if i not in found]
        if missing:
            raise CommandError(f"no call with id {', '.join(f'#{i}' for i in missing)}; nothing was changed")
        return wanted

    def do_retry(self, ids: list[str], **_: Any) -> None:
        wanted = self._existing(ids)
        done = CallQueue.objects.retry_now(wanted)
        self.stdout.write(f"{done} of {len(wanted)} calls are due now" + (
            "" if done == len(wanted) else " (the others were in flight, done or cancelled and were left alone)"))

    def do_cancel(self, ids: list[str], **_: Any) -> None:
        wanted = self._existing(ids)
        done = CallQueue.objects.cancel(wanted)
        self.stdout.write(f"cancelled {done} of {len(wanted)} calls" + (
            "" if done == len(wanted) else " (the others were not waiting and were left alone)"))
