"""python manage.py dispense [--loop]: claim due calls under the rate limits and publish them."""
from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from dispatcher.dispenser import Dispenser


class Command(BaseCommand):
    help = "Run one dispense pass, or with --loop a long-running dispenser until SIGTERM/SIGINT."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--loop", action="store_true", help="keep dispensing until SIGTERM or SIGINT")
        parser.add_argument("--batch", type=int, default=None, help="most calls moved per pass")
        parser.add_argument("--max-passes", type=int, default=None, help="with --loop: stop after this many passes")

    def handle(self, *args: Any, loop: bool, batch: int | None, max_passes: int | None, **options: Any) -> None:
        if batch is not None and batch < 1:
            raise CommandError("--batch must be at least 1")
        if max_passes is not None and max_passes < 1:
            raise CommandError("--max-passes must be at least 1")
        dispenser = Dispenser(batch=batch)
        if not loop:
            report = dispenser.run_once()
            self.stdout.write(
                f"moved={report.moved} published={report.published} put_back={report.put_back} key_sets={report.key_sets}"
            )
            return
        stop = threading.Event()

        def request_stop(signum: int, frame: Any) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        self.stdout.write("dispenser running; SIGTERM or Ctrl-C stops it")
        self.stdout.flush()
        passes = dispenser.loop(stop, max_passes=max_passes)
        self.stdout.write(f"dispenser stopped after {passes} passes")
