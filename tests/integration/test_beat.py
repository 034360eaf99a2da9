"""Beat's schedules: seeded once by name, then beat's own rows, which an operator's edit keeps."""
from __future__ import annotations

import pytest
from celery.signals import beat_init
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from dispatcher.beat import DISPENSE, PRUNE, RESCUE, seed_schedules

pytestmark = pytest.mark.django_db


def test_migrate_seeds_the_three_schedules():
    tasks = {t.name: t for t in PeriodicTask.objects.filter(name__in=[DISPENSE, RESCUE, PRUNE])}
    assert set(tasks) == {DISPENSE, RESCUE, PRUNE}
    assert (tasks[DISPENSE].interval.every, tasks[DISPENSE].interval.period) == (5, IntervalSchedule.SECONDS)
    assert tasks[RESCUE].interval.every == 30
    assert (tasks[PRUNE].crontab.minute, tasks[PRUNE].crontab.hour) == ("0", "3")


def test_an_operators_edit_survives_beat_starting_again():
    every_minute, _ = IntervalSchedule.objects.get_or_create(every=60, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.filter(name=DISPENSE).update(interval=every_minute)
    PeriodicTask.objects.filter(name=RESCUE).update(enabled=False)

    beat_init.send(sender=None)

    assert PeriodicTask.objects.get(name=DISPENSE).interval.every == 60
    assert PeriodicTask.objects.get(name=RESCUE).enabled is False


def test_a_deleted_schedule_is_seeded_again_and_the_others_are_left_alone():
    PeriodicTask.objects.filter(name=PRUNE).delete()
    assert seed_schedules() == [PRUNE]
    assert seed_schedules() == []
