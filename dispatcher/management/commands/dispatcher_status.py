"""python manage.py dispatcher_status [--json] [--watch SECONDS] [--key KEY]: the per-key table."""
from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dispatcher import status as live
from dispatcher.durations import parse_positive_duration

MAX_WATCH_ROUNDS = 100_000


class Command(BaseCommand):
    help = "Show per key: limits, used in the window, in flight, waiting, oldest wait, paused until, next free slot."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", action="store_true", dest="as_json", help="print JSON for scripts")
        parser.add_argument("--watch", nargs="?", const="2s", default=None, metavar="INTERVAL",
                            help="refresh every INTERVAL (default 2s) until interrupted")
        parser.add_argument("--key", action="append", dest="keys", default=None, help="only this key (repeatable)")

    def handle(self, *args: Any, as_json: bool, watch: str | None, keys: list[str] | None, **options: Any) -> None:
        if watch is None:
            self.stdout.write(self.render(keys, as_json))
            return
        try:
            interval = parse_positive_duration(watch).total_seconds()
        except ValueError as exc:
            raise CommandError(f"--watch: {exc}") from None
        try:
            for _ in range(MAX_WATCH_ROUNDS):
                text = self.render(keys, as_json)
                if not as_json and self.stdout.isatty():
                    self.stdout.write("\033[H\033[2J", ending="")
                self.stdout.write(text)
                self.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            pass

    def render(self, keys: list[str] | None, as_json: bool) -> str:
        statuses = live.key_statuses(keys)
        if as_json:
            now = statuses[0].now.isoformat() if statuses else None
            return json.dumps({"now": now, "keys": [s.as_dict() for s in statuses]}, indent=2)
        if not statuses:
            return "no key has a policy, waiting calls or recent starts"
        header = ("KEY", "POLICY", "USED", "IN FLIGHT", "WAITING", "OLDEST WAIT", "PAUSED UNTIL", "NEXT FREE SLOT", "DRAIN")
        rows = [header]
        for s in statuses:
            policies = ", ".join(p.label() for p in s.policies) or "no limit"
            used = ", ".join(f"{p.used}/{p.capacity}" for p in s.policies) or "-"
            flight = f"{s.in_flight}/{s.concurrency}" if s.concurrency else str(s.in_flight)
            paused = live.humanize(s.paused_until, s.now) if s.paused_until else "-"
            if s.blocked:
                free = live.humanize(s.next_free_at, s.now) if s.next_free_at else "when one finishes"
            else:
                free = "now"
            rows.append((s.key, policies, used, flight, str(s.waiting), live.humanize_duration(s.oldest_wait),
                         paused, free, live.humanize_duration(s.drain_time)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)
