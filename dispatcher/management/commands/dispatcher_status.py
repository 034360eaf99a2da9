"""python manage.py dispatcher_status [--json] [--watch SECONDS] [--key KEY]: the per-key table."""
from __future__ import annotations

import json
import time
from datetime import UTC, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatcher import liveness
from dispatcher import status as live
from dispatcher.durations import format_duration, humanize, humanize_duration, parse_positive_duration
from dispatcher.keys import parse_key_set
from dispatcher.states import CallStatus as Status

MAX_WATCH_ROUNDS = 100_000


class Command(BaseCommand):
    help = (
        "Show whether dispensers and workers run, call totals, per key limits, used in the window, in flight, "
        "waiting, oldest wait, paused until, next free slot, and recent failures per key."
    )

    def add_arguments(self, parser: CommandParser) -> None:
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
                text = self.render(keys, as_json, watch=watch)
                if not as_json and self.stdout.isatty():
                    self.stdout.write("\033[H\033[2J", ending="")
                self.stdout.write(text)
                self.stdout.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            pass

    def render(self, keys: list[str] | None, as_json: bool, watch: str | None = None) -> str:
        statuses = live.key_statuses(keys)
        state = liveness.read(statuses[0].now if statuses else None)
        totals = live.call_totals()
        failures = [f for f in live.recent_failures(state.now) if keys is None or f.key in keys]
        if as_json:
            return json.dumps({"now": state.now.isoformat(), "liveness": state.as_dict(), "totals": totals,
                               "keys": [s.as_dict() for s in statuses],
                               "recent_failures": [f.as_dict() for f in failures]}, indent=2)
        stamp = f"at {state.now.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC"
        lines = [f"dispatcher status {stamp}" + (f", every {watch} (Ctrl-C stops)" if watch else "")]
        lines += [f"{'WARNING: ' if state.problem(kind) else ''}{state.summary(kind)}"
                  for kind in (liveness.DISPENSER, liveness.WORKER)]
        lines.append(
            f"calls: {totals[Status.PENDING]} waiting, {totals[Status.DISPATCHED] + totals[Status.RUNNING]} in flight "
            f"({totals[Status.DISPATCHED]} dispatched, {totals[Status.RUNNING]} running), {totals[Status.DONE]} done, "
            f"{totals[Status.FAILED]} failed, {totals[Status.CANCELLED]} cancelled"
        )
        failure_lines = ["", "failures in the last hour, by key:"] if failures else []
        for f in failures:
            failure_lines.append(f"  {f.key or '(no key)'}: {f.errors} errors, {f.failed} gave up"
                                 + (f"; latest: {f.latest_error}" if f.latest_error else ""))
        if not statuses:
            return "\n".join([*lines, "", "no key has a policy, waiting calls or recent starts", *failure_lines])
        header = ("KEY", "POLICY", "USED", "IN FLIGHT", "WAITING", "OLDEST WAIT", "PAUSED UNTIL", "NEXT FREE SLOT", "DRAIN")
        rows = [header]
        for s in statuses:
            policies = ", ".join(p.label() for p in s.policies) or "no limit"
            used = ", ".join(f"{p.used}/{p.policy.capacity()}" for p in s.policies) or "-"
            flight = f"{s.in_flight}/{s.concurrency}" if s.concurrency else str(s.in_flight)
            paused = humanize(s.paused_until, s.now) if s.paused_until else "-"
            if s.blocked or s.held_by or s.next_free_at is None:
                free = s.next_free_text(humanize)
            else:
                # A free slot sends nothing while no dispenser runs: say so where the slot is read.
                free = "now, but no dispenser runs" if state.problem(liveness.DISPENSER) else "now"
            rows.append((s.key, policies, used, flight, str(s.waiting), humanize_duration(s.oldest_wait),
                         paused, free, s.drain_text(humanize_duration)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        return "\n".join([*lines, "", *table, *self.share_lines(statuses), *failure_lines])

    def share_lines(self, statuses: list[live.KeyStatus]) -> list[str]:
        """Say, for each key that key sets share, what each got over the key's window and its oldest wait."""
        lines: list[str] = []
        for status in statuses:
            if status.competing < 2:
                continue
            window = max((p.policy.period for p in status.policies), default=timedelta(minutes=1))
            shares = live.shares_of(status.key, status.now, window)
            if not shares:
                continue
            lines += ["", f"shares of {status.key} over the last {format_duration(window)} (least served first):"]
            total = sum(share.units for share in shares) or 1
            for share in shares:
                keys = ", ".join(k for k in parse_key_set(share.key_set) if k != status.key) or "(this key alone)"
                lines.append(
                    f"  {keys}: {share.units} units ({100 * share.units / total:.0f}%), {share.waiting} waiting, "
                    f"oldest wait {humanize_duration(share.oldest_wait)}"
                )
        return lines
