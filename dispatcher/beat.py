"""Beat schedules for dispense, rescue and prune, created from settings (not clicks)."""
from __future__ import annotations

import logging
from typing import Any

from celery.signals import beat_init

from dispatcher.conf import dispatcher_settings as ds
from dispatcher.models import RateLimit

log = logging.getLogger("dispatcher")

DISPENSE, RESCUE, PRUNE = "dispatcher.dispense", "dispatcher.rescue", "dispatcher.prune"


def sync_schedules() -> list[str]:
    """Upsert the periodic tasks by name from DISPATCHER_* settings; return their names."""
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    def every(seconds: float) -> IntervalSchedule:
        schedule, _ = IntervalSchedule.objects.get_or_create(
            every=max(1, round(seconds)), period=IntervalSchedule.SECONDS
        )
        return schedule

    minute, hour, day_of_month, month_of_year, day_of_week = ds.PRUNE_CRONTAB.split()
    crontab, _ = CrontabSchedule.objects.get_or_create(
        minute=minute, hour=hour, day_of_month=day_of_month, month_of_year=month_of_year, day_of_week=day_of_week,
        timezone="UTC",
    )
    wanted: dict[str, dict[str, Any]] = {
        DISPENSE: {"interval": every(ds.DISPENSE_INTERVAL.total_seconds()), "crontab": None},
        RESCUE: {"interval": every(ds.RESCUE_INTERVAL.total_seconds()), "crontab": None},
        PRUNE: {"interval": None, "crontab": crontab},
    }
    for name, schedule in wanted.items():
        PeriodicTask.objects.update_or_create(
            name=name, defaults={"task": name, "enabled": True, **schedule}
        )
    return list(wanted)


def on_post_migrate(sender: Any = None, **kwargs: Any) -> None:
    """Seed policies and schedules once the tables exist."""
    RateLimit.objects.seed_from_settings()
    sync_schedules()


def connect_beat_signals() -> None:
    def on_beat_init(sender: Any = None, **kwargs: Any) -> None:
        names = sync_schedules()
        log.info("beat_schedules_synced names=%s", ",".join(names))

    beat_init.connect(on_beat_init, weak=False)
