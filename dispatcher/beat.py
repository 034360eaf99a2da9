"""Beat schedules for dispense, rescue and prune: seeded once by name, then owned by beat's rows.

``migrate`` and beat's start create each periodic task that is missing, with the interval or
crontab below; an existing row is left as an operator made it (edited in the admin, or
disabled), so an edit survives every restart.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery.signals import beat_init

from dispatcher.conf import dispatcher_settings as ds
from dispatcher.limits import edit

log = logging.getLogger("dispatcher")

DISPENSE, RESCUE, PRUNE = "dispatcher.dispense", "dispatcher.rescue", "dispatcher.prune"
# The seeds. A dispense pass every 5 s is the fallback when no `dispense --loop` runs; a rescue
# sweep every 30 s finds a stuck call well within the shortest timeout; prune runs nightly.
DISPENSE_EVERY = timedelta(seconds=5)
RESCUE_EVERY = timedelta(seconds=30)
PRUNE_CRONTAB = "0 3 * * *"


def seed_schedules() -> list[str]:
    """Create the periodic tasks that are missing, by name; return the names created."""
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    def every(seconds: float) -> IntervalSchedule:
        schedule, _ = IntervalSchedule.objects.get_or_create(
            every=max(1, round(seconds)), period=IntervalSchedule.SECONDS
        )
        return schedule

    minute, hour, day_of_month, month_of_year, day_of_week = ds.tuned("PRUNE_CRONTAB", PRUNE_CRONTAB).split()
    crontab, _ = CrontabSchedule.objects.get_or_create(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year, day_of_week=day_of_week,
        timezone="UTC",
    )
    wanted: dict[str, dict[str, Any]] = {
        DISPENSE: {"interval": every(ds.tuned("DISPENSE_INTERVAL", DISPENSE_EVERY).total_seconds()), "crontab": None},
        RESCUE: {"interval": every(ds.tuned("RESCUE_INTERVAL", RESCUE_EVERY).total_seconds()), "crontab": None},
        PRUNE: {"interval": None, "crontab": crontab},
    }
    created = []
    for name, schedule in wanted.items():
        _, new = PeriodicTask.objects.get_or_create(name=name, defaults={"task": name, "enabled": True, **schedule})
        if new:
            created.append(name)
    return created


def on_post_migrate(sender: Any = None, **kwargs: Any) -> None:
    """Seed policies and schedules once the tables exist."""
    edit.seed_from_settings()
    seed_schedules()


def connect_beat_signals() -> None:
    def on_beat_init(sender: Any = None, **kwargs: Any) -> None:
        names = seed_schedules()
        if names:
            log.info("beat_schedules_seeded names=%s", ",".join(names))

    beat_init.connect(on_beat_init, weak=False)
