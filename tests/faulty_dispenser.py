"""``python -m tests.faulty_dispenser``: a ``dispense --loop`` that dies between its claim's commit
and its publish, as a dispenser killed there would (exit code 70, no message sent)."""
from __future__ import annotations

import logging
import os
import sys

import django
from django.core.management import call_command

CRASHED = 70


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from dispatcher.dispenser import Dispenser

    def die_before_publishing(self: Dispenser, calls: list, report: object) -> None:
        logging.getLogger("dispatcher").error("fault_injected point=after_claim pid=%s", os.getpid())
        sys.stdout.flush()
        os._exit(CRASHED)

    Dispenser._publish = die_before_publishing  # type: ignore[method-assign]
    call_command("dispense", "--loop")


if __name__ == "__main__":
    main()
