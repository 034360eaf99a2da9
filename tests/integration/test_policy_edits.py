"""Every edit of a policy (command, admin, settings) goes through RateLimit.objects, which locks
the key and wakes the dispensers: set, change, and delete alike."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.management import call_command
from django.db import connection

from dispatcher.limits import edit
from dispatcher.models import RateLimit
from support.processes import database_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def wake_listener():
    import psycopg

    with psycopg.connect(database_url(connection.settings_dict), autocommit=True) as listener:
        listener.execute("LISTEN dispatcher_wake")
        yield lambda: len(list(listener.notifies(timeout=1.0)))


@pytest.mark.postgres
def test_ratelimit_delete_wakes_the_dispensers_as_set_does(wake_listener):
    call_command("ratelimit", "set", "edits", "--limit", "1", "--per", "1h")
    assert wake_listener() == 1
    call_command("ratelimit", "delete", "edits")
    assert wake_listener() == 1
    assert not RateLimit.objects.filter(key="edits").exists()


@pytest.mark.postgres
def test_changing_a_policys_period_replaces_it_in_one_edit(wake_listener):
    policy = edit.set_policy("edits", 1, timedelta(hours=1))
    wake_listener()
    edit.set_policy("edits", 2, timedelta(minutes=1), replacing=policy.pk)
    # One transaction: the delete's and the set's wake-ups are delivered as one notification.
    assert wake_listener() == 1
    assert list(RateLimit.objects.filter(key="edits").values_list("limit", "period")) == [(2, timedelta(minutes=1))]


def test_deleting_one_period_keeps_the_keys_other_policies():
    edit.set_policy("edits", 1, timedelta(hours=1))
    edit.set_policy("edits", 5, timedelta(minutes=1))
    assert edit.delete_policies("edits", timedelta(hours=1)) == 1
    assert edit.delete_policies("missing") == 0
    assert list(RateLimit.objects.values_list("period", flat=True)) == [timedelta(minutes=1)]
