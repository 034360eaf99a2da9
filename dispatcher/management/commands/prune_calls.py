"""python manage.py prune_calls [--older-than DURATION] [--dry-run] [--batch N]: retention cleanup."""
from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatcher.conf import dispatcher_settings
from dispatcher.durations import format_duration, parse_duration
from dispatcher.models import CallQueue, RateLimit

# Rows one transaction may delete; far past any useful batch, well within SQL's LIMIT.
MAX_BATCH = 1_000_000


class Command(BaseCommand):
    help = "Delete finished calls (and their attempts) older than the retention, in bounded batches."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--older-than", default=None, help="age of finished calls to delete (default DISPATCHER_RETENTION)")
        parser.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")
        parser.add_argument("--batch", type=int, default=None, help="rows per transaction (default DISPATCHER_PRUNE_BATCH)")

    def handle(self, *args: Any, older_than: str | None, dry_run: bool, batch: int | None, **options: Any) -> None:
        try:
            age = parse_duration(older_than) if older_than is not None else dispatcher_settings.RETENTION
        except ValueError as exc:
            raise CommandError(f"--older-than: {exc}") from None
        if age.total_seconds() < 0:
            raise CommandError("--older-than cannot be negative")
        if batch is not None and not 1 <= batch <= MAX_BATCH:
            raise CommandError(f"--batch must be between 1 and {MAX_BATCH}, not {batch}")
        tty = self.stdout.isatty() and sys.stdout.isatty()

        def progress(done: int, total: int) -> None:
            if dry_run:
                return
            if tty:
                width = 30
                filled = width * done // total if total else width
                self.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}", ending="")
                self.stdout.flush()
            else:
                self.stdout.write(f"deleted {done}/{total}")

        # prune() keeps every call that finished within the longest policy period (the limiter's
        # windows read that history): say so rather than report a cutoff that was not used.
        longest = max(RateLimit.objects.values_list("period", flat=True), default=None)
        deleted = CallQueue.objects.prune(age, batch=batch, dry_run=dry_run, progress=progress)
        if tty and not dry_run:
            self.stdout.write("")
        verb = "would delete" if dry_run else "deleted"
        if longest is not None and longest > age:
            self.stdout.write(
                f"{verb} {deleted} finished calls older than {format_duration(longest)}: the cutoff was raised from "
                f"{format_duration(age)} to the longest policy period ({format_duration(longest)}), whose window "
                "still counts the calls that finished within it"
            )
        else:
            self.stdout.write(f"{verb} {deleted} finished calls older than {format_duration(age)}")
