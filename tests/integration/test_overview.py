"""The dashboard's overview (issue 27 item 1): totals, the last hour, failures, processes, one row
per key sorted errors first, each linking to the key's page; bounded queries whatever the keys."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from dispatcher.clock import db_now
from dispatcher.limits import edit
from dispatcher.limits.guard import LateStart, late_text
from dispatcher.models import Attempt, CallQueue, KeyState
from tests import console_scenario as scenario

pytestmark = pytest.mark.django_db

OVERVIEW = "/dispatcher/dashboard/"


def _row(page: str, key: str) -> str:
    """The overview's row of one key, as HTML."""
    match = re.search(r'<tr class="key-row[^"]*" data-key="' + re.escape(key) + r'">(.*?)</tr>', page, re.S)
    assert match, f"no row for {key}"
    return match.group(0)


def test_the_overview_shows_the_3am_scenario_worst_first(admin_client):
    scenario.seed(healthy=10)
    response = admin_client.get(OVERVIEW)
    page = response.content.decode()
    keys = [row["key"] for row in response.context["rows"]]
    # Errors first, then the blocked (paused) key, then the longest wait: the shared key and its starved tenant.
    assert keys[:2] == [scenario.FAILING, scenario.PAUSED]
    assert set(keys[2:4]) == {scenario.SHARED, scenario.STARVED}
    # Totals per state in the CallStatus vocabulary; the six failed calls of the failing key.
    assert re.search(r'<tr data-state="failed"><th><a href="/admin/dispatcher/callqueue/\?state=failed">Failed</a></th><td>6</td>', page)
    assert re.search(r'<tr data-state="pending"><th>Waiting</th><td>23</td>', page)
    # Failures of the last hour: six attempts in error, six calls gave up.
    assert 'data-errors="6" data-gave-up="6"' in page and "6 error" in page
    failing = _row(page, scenario.FAILING)
    assert '<td class="errors" title="latest: RuntimeError: boom">6, 6 gave up</td>' in failing
    paused = _row(page, scenario.PAUSED)
    assert "is-paused" in paused and "(partner maintenance)" in paused and '<td class="waiting">4</td>' in paused
    shared = _row(page, scenario.SHARED)
    assert "3 key sets" in shared and "starved: mail:t1 (40 min)" in shared
    # The oldest wait is the starved tenant's; the dead worker is named with when it went silent.
    assert re.search(r'id="overview-oldest">.*?<p class="big">40 min</p>', page, re.S)
    assert f"{scenario.DEAD_WORKER} silent since 10 min ago" in page
    assert "no worker has reported since" in page


def test_the_activity_chart_counts_attempts_per_minute_by_outcome(admin_client, make_call):
    now = db_now()
    three = now.replace(second=30, microsecond=0) - timedelta(minutes=3)
    for outcome in ("done", "done", "error", "failed", "rate_limited", "missed", "missed", "running"):
        Attempt.objects.create(call=make_call(), number=1, started_at=three, finished_at=three, outcome=outcome)
    old = make_call()
    Attempt.objects.create(call=old, number=1, started_at=now - timedelta(hours=2), finished_at=now - timedelta(hours=2), outcome="error")
    page = admin_client.get(OVERVIEW).content.decode()
    assert re.search(r'<rect class="seg-done" [^>]*data-n="2">', page)
    assert re.search(r'<rect class="seg-error" [^>]*data-n="2">', page)  # error and failed; not the old one
    assert re.search(r'<rect class="seg-429" [^>]*data-n="1">', page)
    # A held request that was not sent is neither an error nor a 429.
    assert re.search(r'<rect class="seg-missed" [^>]*data-n="2">', page)
    assert "2 done" in page and "2 error" in page and "1 429" in page and "2 missed their send moment" in page


def _queries(admin_client) -> int:
    admin_client.get(OVERVIEW)  # sessions, content types and templates loaded once
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get(OVERVIEW).status_code == 200
    return len(queries)


def test_the_overview_reads_a_fixed_number_of_queries_whatever_the_number_of_keys(admin_client):
    edit.set_policy("tenant:*", 10, timedelta(minutes=1))
    edit.set_policy("tenant:*", 100, timedelta(hours=1))

    def add(first: int, last: int) -> None:
        calls = CallQueue.objects.send_many([{"method": "noop", "keys": [f"tenant:{i:03d}", "shared"]} for i in range(first, last)])
        now = db_now()
        for call in calls[::3]:
            Attempt.objects.create(call=call, number=1, started_at=now, finished_at=now, outcome="error", error="boom")
        edit.pause_key(f"tenant:{first:03d}", timedelta(minutes=5))

    add(0, 5)
    few = _queries(admin_client)
    add(5, 70)
    many = _queries(admin_client)
    assert admin_client.get(OVERVIEW).context["matching"] == 71
    print(f"\noverview queries: {few} with 5 keys, {many} with 71 keys")
    assert many == few <= 25, (few, many)


@pytest.mark.parametrize("key", ["a:b/c", "odd?key#frag", "per%cent & <b>bold</b>", "tenant: 42/", "ключ:é"])
def test_a_key_page_is_reached_from_its_row_whatever_its_characters(admin_client, make_call, key):
    make_call(keys=[key])
    page = admin_client.get(OVERVIEW).content.decode()
    assert "<b>bold</b>" not in page  # escaped
    url = reverse("dispatcher:dashboard-key", args=[key])
    assert f'<a href="{url.replace("&", "&amp;")}"' in page
    key_page = admin_client.get(url)
    assert key_page.status_code == 200 and key_page.context["row"]["status"].key == key
    assert key_page.context["row"]["status"].waiting == 1


def test_a_key_page_refuses_what_is_not_a_key(admin_client):
    assert admin_client.get("/dispatcher/dashboard/key/" + "x" * 300 + "/").status_code == 400


def test_the_columns_sort_both_ways_and_a_bad_sort_is_refused(admin_client, make_call):
    for n, key in ((1, "b"), (3, "a"), (2, "c")):
        for _ in range(n):
            make_call(keys=[key])
    order = {sort: [r["key"] for r in admin_client.get(OVERVIEW, {"sort": sort}).context["rows"]]
             for sort in ("-waiting", "waiting", "key", "-key")}
    assert order == {"-waiting": ["a", "c", "b"], "waiting": ["b", "c", "a"], "key": ["a", "b", "c"], "-key": ["c", "b", "a"]}
    page = admin_client.get(OVERVIEW, {"sort": "-waiting"}).content.decode()
    # The sorted column's header links to the other direction and says which way it sorts.
    assert '<th scope="col" class="col-waiting" aria-sort="descending"><a href="?sort=waiting">' in page
    for bad in ("status", "-", "waiting,key", "__class__"):
        response = admin_client.get(OVERVIEW, {"sort": bad})
        assert response.status_code == 400 and b"sort= takes one of" in response.content


def test_the_overview_reads_the_same_use_and_room_as_a_keys_status(make_call):
    from dispatcher import overview
    from dispatcher import status as live
    from tests.claims import claim
    from tests.starts import log_starts

    edit.set_policy("api", 10, timedelta(minutes=1))
    edit.set_policy("api", 100, timedelta(hours=1))
    edit.set_policy("shop", 60, timedelta(minutes=1), burst=5)
    edit.set_policy("full", 2, timedelta(hours=1))
    edit.set_policy("late", 2, timedelta(seconds=10))
    now = db_now()
    log_starts("api", [now - timedelta(minutes=m) for m in (0.5, 5, 30, 90)])
    log_starts("full", [now - timedelta(minutes=1), now - timedelta(minutes=2)])
    # A start past the window's span whose request arrived 5 s after it (a late start): the
    # window still holds it, and the overview counts it as admission does.
    log_starts("late", [now - timedelta(seconds=12), now - timedelta(seconds=3)])
    KeyState.objects.filter(key="late").update(
        late_starts=late_text([LateStart(now - timedelta(seconds=12), timedelta(seconds=5), 1)])
    )
    shop = [make_call(keys=["shop"]) for _ in range(3)]
    assert len(claim(shop[0].key_set, 2).calls) == 2
    for key in ("api", "full"):
        make_call(keys=[key])
    edit.pause_key("api", timedelta(minutes=3))
    now = db_now()
    rows = {row.key: row.status for row in overview.key_rows(now)}
    assert [p.used for p in rows["late"].policies] == [2]
    for status in live.key_statuses(["api", "shop", "full", "late"], now=now):
        seen = rows[status.key]
        assert [(p.policy, p.used, p.room, p.reserved) for p in seen.policies] == [
            (p.policy, p.used, p.room, p.reserved) for p in status.policies
        ], status.key
        assert (seen.waiting, seen.due, seen.paused_until, seen.blocked, seen.drain_time) == (
            status.waiting, status.due, status.paused_until, status.blocked, status.drain_time
        ), status.key
    assert rows["full"].blocked_reason == "2 per 1h used" and rows["api"].blocked_reason == "paused"
    assert rows["late"].blocked_reason == "2 per 10s used"


def test_the_overview_counts_the_failures_of_the_hour_as_dispatcher_status_does(make_call):
    from dispatcher import overview
    from dispatcher import status as live

    scenario.seed(healthy=3)
    now = db_now()
    shared = make_call(keys=["mail", "crm"], status="failed", finished_at=now)
    Attempt.objects.create(call=shared, number=1, started_at=now, finished_at=now, outcome="lost", error="lost it\nline two")
    Attempt.objects.create(call=make_call(keys=[]), number=1, started_at=now, finished_at=now, outcome="error", error="no key")
    old = make_call(keys=["crm"])
    Attempt.objects.create(call=old, number=1, started_at=now, finished_at=now - timedelta(hours=2), outcome="error")

    def facts(found) -> dict:
        return {f.key: (f.errors, f.failed, f.latest_error) for f in found}

    expected = facts(live.recent_failures(now))
    assert expected["crm"] == (7, 7, "lost it") and expected[""] == (1, 0, "no key")
    assert facts(overview._failures(now).values()) == expected
