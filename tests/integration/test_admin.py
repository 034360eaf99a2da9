"""The admin through the test client: calls, rate limits, actions, validation, dashboard, permissions."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from dispatcher.clock import db_now
from dispatcher.limits import edit, ledger
from dispatcher.models import Attempt, CallQueue, KeyState, RateLimit
from tests.claims import claim
from tests.starts import log_starts

pytestmark = pytest.mark.django_db

CALLS = "/admin/dispatcher/callqueue/"
LIMITS = "/admin/dispatcher/ratelimit/"
DASHBOARD = "/admin/dispatcher/dashboard/"


def key_page(key: str) -> str:
    """A key's full panel, under the dashboard (dispatcher.urls)."""
    from django.urls import reverse

    return reverse("dispatcher:dashboard-key", args=[key])


def make_user(name: str, *, staff: bool = True, perms: tuple[str, ...] = ()) -> User:
    user = User.objects.create_user(name, password="pw", is_staff=staff)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(content_type__app_label="dispatcher", codename=codename))
    return user


def client_for(user: User | None) -> Client:
    client = Client()
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def operator() -> Client:
    return client_for(make_user("op", perms=("view_callqueue", "change_callqueue", "view_ratelimit", "change_ratelimit", "add_ratelimit")))


@pytest.fixture
def viewer() -> Client:
    return client_for(make_user("viewer", perms=("view_callqueue", "view_ratelimit")))


def run_action(client: Client, url: str, action: str, ids: list[int], **extra) -> object:
    return client.post(url, {"action": action, "_selected_action": [str(i) for i in ids], "index": 0, **extra}, follow=True)


# --- calls list, filters, search -------------------------------------------------------------


def test_call_list_tells_never_tried_from_retrying_from_given_up(operator, make_call):
    make_call()
    make_call(attempts=1, last_error="boom", run_at=db_now() + timedelta(seconds=75))  # reads "in 1 min" for 15 s
    make_call(status="failed", attempts=3, finished_at=db_now())
    page = operator.get(CALLS).content.decode()
    assert "waiting (never tried)" in page
    assert "waiting for retry (1/3 tried)" in page
    assert "failed (gave up after 3 attempts)" in page
    assert "in 1 min" in page  # next try


@pytest.mark.parametrize(("state", "expected"), [("new", "never"), ("retry", "retry"), ("failed", "failed"), ("in_flight", "running")])
def test_call_list_filters_by_state(operator, state, expected, make_call):
    calls = {
        "never": make_call(),
        "retry": make_call(attempts=1),
        "failed": make_call(status="failed", finished_at=db_now()),
        "running": make_call(status="running"),
    }
    shown = list(operator.get(CALLS, {"state": state}).context["cl"].result_list)
    assert shown == [calls[expected]]


def test_call_list_filters_by_method_and_key(operator, make_call):
    greet = make_call("greet", {"name": "ann"}, keys=[])
    other = make_call(keys=["billing"])
    make_call(keys=["api"])
    assert list(operator.get(CALLS, {"method": "greet"}).context["cl"].result_list) == [greet]
    assert list(operator.get(CALLS, {"key": "billing"}).context["cl"].result_list) == [other]
    # A key filter matches whole keys, not prefixes of them.
    assert list(operator.get(CALLS, {"key": "bill"}).context["cl"].result_list) == []


def test_call_search_by_id_and_params(operator, make_call):
    ann = make_call("greet", {"name": "annabel"}, keys=[])
    bob = make_call("greet", {"name": "bob"}, keys=[])
    assert list(operator.get(CALLS, {"q": "annabel"}).context["cl"].result_list) == [ann]
    assert list(operator.get(CALLS, {"q": str(bob.id)}).context["cl"].result_list) == [bob]


# --- call detail ----------------------------------------------------------------------------------


def detail(client: Client, call: CallQueue) -> str:
    response = client.get(f"{CALLS}{call.id}/change/")
    assert response.status_code == 200
    return response.content.decode()


def test_detail_shows_redacted_params_result_error_traceback_and_attempts(operator, make_call):
    call = make_call(params={"url": "x", "api_key": "SECRET-123", "headers": {"Authorization": "Bearer abc"}},
                status="failed", attempts=2, last_error="RuntimeError: boom", last_traceback="Traceback ...\nRuntimeError: boom",
                result={"token": "T0K3N", "ok": False}, finished_at=db_now())
    now = db_now()
    Attempt.objects.create(call=call, number=1, started_at=now - timedelta(seconds=5), finished_at=now - timedelta(seconds=4),
                           outcome="error", error="RuntimeError: first", worker="w1@host")
    Attempt.objects.create(call=call, number=2, started_at=now - timedelta(seconds=2), finished_at=now,
                           outcome="error", error="RuntimeError: boom", worker="w2@host")
    page = detail(operator, call)
    assert "SECRET-123" not in page and "Bearer abc" not in page and "T0K3N" not in page
    assert "********" in page and "&quot;ok&quot;: false" in page
    assert "Traceback ...\nRuntimeError: boom" in page
    assert "RuntimeError: first" in page and "w1@host" in page and "w2@host" in page
    assert 'name="_save"' not in page  # read-only: no save button


def test_detail_shows_the_calls_cost(viewer):
    costly = CallQueue.objects.send("noop", {}, keys=["api", "tenant:1"], cost={"api": 5})
    plain = CallQueue.objects.send("noop", {}, keys=["api"])
    assert "api: 5, tenant:1: 1" in viewer.get(f"{CALLS}{costly.id}/change/").content.decode()
    assert "1 unit per key" in viewer.get(f"{CALLS}{plain.id}/change/").content.decode()


@pytest.mark.parametrize("reason", ["run_at", "backoff", "deferred", "paused", "rate", "concurrency"])
def test_detail_says_why_a_call_waits_and_until_when(operator, reason, make_call):
    now = db_now()
    if reason == "run_at":
        call = make_call(run_at=now + timedelta(minutes=10))
        expected = ["scheduled: run_at is 20", "UTC (in 10 min)", "Will start at"]
    elif reason == "backoff":
        call = make_call(attempts=1, run_at=now + timedelta(seconds=40), last_error="boom")
        Attempt.objects.create(call=call, number=1, started_at=now, outcome="error")
        expected = ["retry backoff after attempt 1 of 3", "in 40 s"]
    elif reason == "deferred":
        call = make_call(deferrals=1, run_at=now + timedelta(seconds=40))
        Attempt.objects.create(call=call, number=1, started_at=now, outcome="rate_limited")
        expected = ["deferred by a 429", "in 40 s"]
    elif reason == "paused":
        edit.pause_key("api", timedelta(minutes=5), reason="maintenance")
        call = make_call()
        expected = ["key api is paused (maintenance) until 20", "UTC (in 5 min)"]
    elif reason == "rate":
        edit.set_policy("api", 1, timedelta(minutes=1))
        log_starts("api", [now - timedelta(seconds=30)])
        call = make_call()
        expected = ["key api: 1 per 1m used", "Will start at 20", "UTC (in 30 s)"]
    else:
        edit.set_policy("api", 10, timedelta(seconds=1), concurrency=1)
        make_call(status="running")
        call = make_call()
        expected = ["concurrency 1/1", "until a call in flight finishes"]
    page = detail(operator, call)
    for text in expected:
        assert text in page


def test_calls_cannot_be_edited_added_or_deleted_by_hand(operator, make_call):
    call = make_call()
    response = operator.post(f"{CALLS}{call.id}/change/", {"method": "explode", "status": "done"})
    assert response.status_code == 403
    call.refresh_from_db()
    assert (call.method, call.status) == ("noop", "pending")
    assert operator.get(f"{CALLS}add/").status_code == 403
    assert operator.post(f"{CALLS}{call.id}/delete/", {"post": "yes"}).status_code == 403
    assert CallQueue.objects.filter(id=call.id).exists()


# --- actions ----------------------------------------------------------------------------------------


def test_retry_now_gives_a_failed_call_one_more_attempt_and_leaves_done_calls(operator, make_call):
    failed = make_call(status="failed", attempts=3, finished_at=db_now(), last_error="boom")
    done = make_call(status="done", attempts=1, finished_at=db_now())
    later = make_call(run_at=db_now() + timedelta(hours=1))
    response = run_action(operator, CALLS, "retry_now", [failed.id, done.id, later.id])
    text = response.content.decode()
    assert "2 calls are due now." in text and "1 call was not waiting or failed" in text
    failed.refresh_from_db(), done.refresh_from_db(), later.refresh_from_db()
    assert (failed.status, failed.max_attempts, failed.finished_at) == ("pending", 4, None)
    assert failed.run_at <= db_now()
    assert later.run_at <= db_now()
    assert done.status == "done"


def test_cancel_asks_first_then_cancels_waiting_calls_only(operator, make_call):
    waiting = make_call()
    running = make_call(status="running")
    asked = run_action(operator, CALLS, "cancel", [waiting.id, running.id]).content.decode()
    assert "Cancel calls?" in asked and "1 waiting call will be cancelled" in asked and "1 other is not waiting" in asked
    assert CallQueue.objects.get(id=waiting.id).status == "pending"  # nothing yet
    response = run_action(operator, CALLS, "cancel", [waiting.id, running.id], post="yes")
    text = response.content.decode()
    assert "1 call cancelled." in text and "1 call was not waiting" in text
    waiting.refresh_from_db(), running.refresh_from_db()
    assert (waiting.status, running.status) == ("cancelled", "running")


def test_viewer_without_change_permission_cannot_run_actions(viewer, make_call):
    call = make_call(status="failed", finished_at=db_now())
    page = viewer.get(CALLS).content.decode()
    assert "retry_now" not in page
    run_action(viewer, CALLS, "retry_now", [call.id])
    run_action(viewer, CALLS, "cancel", [call.id], post="yes")
    call.refresh_from_db()
    assert call.status == "failed"


# --- rate limits ------------------------------------------------------------------------------------


def policy_form(**overrides) -> dict:
    return {"key": "api", "limit": "10", "period": "5m", "concurrency": "", **overrides}


def test_a_policy_is_created_with_a_written_period(operator):
    response = operator.post(f"{LIMITS}add/", policy_form(concurrency="2"))
    assert response.status_code == 302
    policy = RateLimit.objects.get()
    assert (policy.key, policy.limit, policy.period, policy.concurrency) == ("api", 10, timedelta(minutes=5), 2)
    page = operator.get(f"{LIMITS}{policy.id}/change/").content.decode()
    assert 'value="5m"' in page


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"limit": "0"}, "greater than or equal to 1"),
        ({"period": "0s"}, "greater than zero"),
        ({"period": "soon"}, "not a duration"),
        ({"period": ""}, "This field is required"),
        ({"concurrency": "0"}, "greater than or equal to 1"),
        ({"burst": "0"}, "greater than or equal to 1"),
        ({"burst": "2", "limit": "20000000", "period": "1s"}, "microsecond"),
        ({"key": "a*b"}, "may only end a pattern"),
        ({"key": ""}, "This field is required"),
    ],
)
def test_bad_policies_are_refused_with_a_message(operator, overrides, message):
    response = operator.post(f"{LIMITS}add/", policy_form(**overrides))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not RateLimit.objects.exists()


def test_a_bucket_is_created_with_its_burst_and_listed_as_one(operator):
    response = operator.post(f"{LIMITS}add/", policy_form(limit="2", period="1s", burst="40"))
    assert response.status_code == 302
    assert RateLimit.objects.get().burst == 40
    rows = {cells[0]: cells for cells in _rows(operator.get(LIMITS).content.decode())}
    assert rows["api"][1] == "bucket 2 per 1s, burst 40: 0/40 tokens spent"


def test_a_second_policy_with_the_same_key_and_period_is_refused(operator):
    edit.set_policy("api", 5, timedelta(minutes=5))
    response = operator.post(f"{LIMITS}add/", policy_form())
    assert response.status_code == 200 and "already exists" in response.content.decode()
    assert RateLimit.objects.get().limit == 5


def test_policy_list_shows_live_usage(operator, make_call):
    edit.set_policy("api", 3, timedelta(minutes=1), concurrency=2)
    edit.set_policy("tenant:*", 4, timedelta(minutes=1))
    now = db_now()
    log_starts("api", [now - timedelta(seconds=s) for s in (50, 20, 10)])
    log_starts("tenant:9", [now - timedelta(seconds=5)])
    make_call(status="running")
    make_call(created_at=now - timedelta(minutes=3))
    make_call(keys=["tenant:9"])
    rows = {cells[0]: cells for cells in _rows(operator.get(LIMITS).content.decode())}
    # key, policies with their use, in flight, waiting, oldest wait, paused until, next free slot
    assert rows["api"][1:7] == ["window 3 per 1m: 3/3 in the last 1m", "1/2", "1", "3 min", "-", "in 10 s"]
    assert rows["tenant:*"][1:4] == ["window 4 per 1m: 1/4 in the last 1m (busiest: tenant:9)", "0", "1"]
    assert rows["tenant:*"][6] == "now, but no dispenser runs"  # no dispenser has ever run here


def test_policy_list_shows_a_key_with_two_policies_once_with_each_policy(operator, make_call):
    edit.set_policy("api", 100, timedelta(hours=1), concurrency=4)
    edit.set_policy("api", 10, timedelta(minutes=1))
    edit.set_policy("smooth", 60, timedelta(minutes=1), burst=5)
    now = db_now()
    log_starts("api", [now - timedelta(minutes=m) for m in (30, 20, 10)] + [now - timedelta(seconds=s) for s in (40, 5)])
    # Two calls dispatched, not started: their units are promised and count as used.
    KeyState.objects.update_or_create(key="api", defaults={"reserved": 2, "reserved_units": 2})
    make_call(status="running")
    for _ in range(3):
        make_call()
    page = operator.get(LIMITS).content.decode()
    rows = _rows(page)
    assert [r[0] for r in rows] == ["api", "smooth"]
    api = rows[0]
    assert api[1] == ("window 10 per 1m: 4/10 in the last 1m (2 dispatched, not started)"
                      "window 100 per 1h: 7/100 in the last 1h (2 dispatched, not started)")
    assert api[2:4] == ["3/4", "3"]
    assert rows[1][1] == "bucket 60 per 1m, burst 5: 0/5 tokens spent"
    assert "dispatched-not-started calls included" in page
    # Each policy links to its own page.
    for policy in RateLimit.objects.filter(key="api"):
        assert f'href="{LIMITS}{policy.id}/change/"' in page
    # Deleting "the selected" would delete one policy of a key: not offered on the list.
    assert 'value="delete_selected"' not in page


def test_policy_list_says_who_paused_a_key(operator):

    edit.set_policy("api", 3, timedelta(minutes=1))
    edit.set_policy("crm", 3, timedelta(minutes=1))
    edit.pause_key("api", timedelta(minutes=5))
    ledger.pause(["crm"], db_now() + timedelta(minutes=2), reason="429 from call #7")
    rows = {cells[0]: cells for cells in _rows(operator.get(LIMITS).content.decode())}
    assert rows["api"][5].endswith("(in 5 min), by operator")
    assert rows["crm"][5].endswith("(in 2 min), by 429 from the API (429 from call #7)")
    assert rows["crm"][6] == "in 2 min"


def test_policy_list_next_free_slot_is_plain_now_when_a_dispenser_runs(operator):
    from dispatcher import liveness

    edit.set_policy("api", 3, timedelta(minutes=1))
    liveness.beat(liveness.DISPENSER)
    rows = _rows(operator.get(LIMITS).content.decode())
    assert rows[0][6] == "now"


def _rows(page: str) -> list[list[str]]:
    """Return the text of each cell of each row of the admin's result list (checkbox cell left out)."""
    from html.parser import HTMLParser

    class Table(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell: list[str] | None = None
            self.inside = False

        def handle_starttag(self, tag, attrs) -> None:
            if tag == "tbody":
                self.inside = True
            elif self.inside and tag == "tr":
                self.rows.append([])
            elif self.inside and tag in ("td", "th"):
                self.cell = []

        def handle_endtag(self, tag) -> None:
            if tag == "tbody":
                self.inside = False
            elif self.inside and tag in ("td", "th") and self.cell is not None:
                self.rows[-1].append("".join(self.cell).strip())
                self.cell = None

        def handle_data(self, data) -> None:
            if self.cell is not None:
                self.cell.append(data)

    parser = Table()
    start = page.index('<table id="result_list">')
    parser.feed(page[start:page.index("</table>", start)])
    return [row[1:] for row in parser.rows]


def test_pause_and_resume_actions(operator):
    policy = edit.set_policy("api", 3, timedelta(minutes=1))
    response = run_action(operator, LIMITS, "pause", [policy.id], duration="5m")
    assert "1 key paused until" in response.content.decode()
    state = KeyState.objects.get(key="api")
    assert timedelta(minutes=4) < state.paused_until - db_now() <= timedelta(minutes=5)
    response = run_action(operator, LIMITS, "resume", [policy.id])
    assert "1 pause lifted." in response.content.decode()
    assert KeyState.objects.get(key="api").paused_until is None


@pytest.mark.parametrize("duration", ["", "soon", "0s"])
def test_pause_with_a_bad_duration_pauses_nothing(operator, duration):
    policy = edit.set_policy("api", 3, timedelta(minutes=1))
    response = run_action(operator, LIMITS, "pause", [policy.id], duration=duration)
    assert "Pause not applied" in response.content.decode()
    assert not KeyState.objects.filter(paused_until__isnull=False).exists()


def test_viewer_cannot_edit_or_pause_policies(viewer):
    policy = edit.set_policy("api", 3, timedelta(minutes=1))
    assert viewer.post(f"{LIMITS}{policy.id}/change/", policy_form(limit="99")).status_code == 403
    run_action(viewer, LIMITS, "pause", [policy.id], duration="5m")
    assert RateLimit.objects.get().limit == 3
    assert not KeyState.objects.filter(paused_until__isnull=False).exists()


# --- dashboard ---------------------------------------------------------------------------------------


def test_dashboard_charts_starts_per_minute_against_the_limit(viewer, make_call):
    edit.set_policy("api", 10, timedelta(minutes=1))
    now = db_now()
    # Seven starts inside one minute, two minutes ago (not straddling a minute's edge).
    minute = now.replace(second=30, microsecond=0) - timedelta(minutes=2)
    log_starts("api", [minute - timedelta(seconds=s) for s in range(7)])
    for _ in range(25):
        make_call()
    page = viewer.get(key_page("api")).content.decode()
    assert 'data-key="api"' in page and 'data-total="7"' in page
    assert page.count('class="bar"') == 60 and 'data-starts="7"' in page
    assert "limit 10.0/min" in page
    # 25 waiting at 10 per minute with 10 free now: 15 more need 2 more minutes.
    assert '<td class="backlog">25 (25 due)</td>' in page and '<td class="drain">2 min</td>' in page


def _panels(page: str, key: str) -> dict[str, dict[str, str]]:
    """Return the policy panels of a key's dashboard section: label -> data attributes (and the text)."""
    import re

    section = page[page.index(f'data-key="{key}"'):]
    section = section[:section.index("</section>")]
    found = {}
    for match in re.finditer(r'<div class="policy-panel" ([^>]*)>(.*?)</div>', section, re.S):
        attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', match.group(1)))
        attrs["html"] = match.group(2)
        found[attrs["policy"]] = attrs
    return found


def test_dashboard_draws_each_policy_against_the_use_it_constrains(viewer, make_call):
    from dispatcher.models import LearntLimit

    # 100 per hour plus 10 per minute, kept: 9 starts in each of 10 minutes of the last hour.
    edit.set_policy("api", 100, timedelta(hours=1))
    edit.set_policy("api", 10, timedelta(minutes=1))
    edit.set_policy("shop", 60, timedelta(minutes=1), burst=5)
    now = db_now()
    LearntLimit.objects.create(key="crm", limit=50, period=timedelta(hours=1), expires_at=now + timedelta(hours=1),
                               source="ietf", observed_at=now)
    minutes = [now.replace(second=30, microsecond=0) - timedelta(minutes=k) for k in range(2, 60, 6)]
    log_starts("api", [m - timedelta(seconds=s) for m in minutes for s in range(9)])
    log_starts("crm", [now - timedelta(minutes=5)])

    # Two calls of the bucket dispatched, not started: their tokens are promised.
    shop_calls = [make_call(keys=["shop"]) for _ in range(3)]
    assert len(claim(shop_calls[0].key_set, 2).calls) == 2
    page = viewer.get(key_page("api")).content.decode()
    # The bars (starts per minute) are drawn against the per-minute policy, not 100/60 = 1.67.
    assert "limit 10.0/min" in page and "1.67" not in page
    api = _panels(page, "api")
    assert set(api) == {"10 per 1m", "100 per 1h"}
    minute, hour = api["10 per 1m"], api["100 per 1h"]
    assert minute["shape"] == hour["shape"] == "sliding window"
    assert (minute["used"], minute["limit"]) == ("0", "10")
    # The hour window: 90 used against 100, drawn as used-in-window over the hour under its limit.
    assert (hour["used"], hour["limit"]) == ("90", "100")
    assert 'data-peak="90" data-now="90"' in hour["html"] and "limit 100 per window" in hour["html"]
    assert "90/100 in the last 1h" in hour["html"]
    shop = _panels(viewer.get(key_page("shop")).content.decode(), "shop")["60 per 1m, burst 5"]
    assert shop["shape"] == "token bucket" and "2/5 tokens spent (2 dispatched, not started)" in shop["html"]
    assert (shop["used"], shop["limit"]) == ("2", "5")
    crm = _panels(viewer.get(key_page("crm")).content.decode(), "crm")
    learnt = crm["50 per 1h (learnt from the API)"]
    assert learnt["learnt"] == "1" and "1/50 in the last 1h" in learnt["html"]


# --- permissions --------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [CALLS, LIMITS, DASHBOARD])
def test_anonymous_and_non_staff_are_sent_to_the_login_page(url):
    for client in (client_for(None), client_for(make_user("plain", staff=False))):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.parametrize("url", [CALLS, LIMITS, DASHBOARD])
def test_staff_without_permissions_is_refused(url):
    assert client_for(make_user("staff")).get(url).status_code == 403


def test_view_only_staff_can_read_calls_and_limits(viewer, make_call):
    call = make_call()
    edit.set_policy("api", 3, timedelta(minutes=1))
    assert viewer.get(CALLS).status_code == 200
    assert viewer.get(f"{CALLS}{call.id}/change/").status_code == 200
    assert viewer.get(LIMITS).status_code == 200
    assert viewer.get(f"{LIMITS}add/").status_code == 403


def test_dashboard_splits_bars_into_done_error_429_and_missed(viewer, make_call):
    now = db_now()
    for outcome in ("done", "done", "error", "rate_limited", "missed"):
        call = make_call()
        Attempt.objects.create(call=call, number=1, started_at=now - timedelta(minutes=3), outcome=outcome)
        log_starts("api", [now - timedelta(minutes=3)])
    page = viewer.get(key_page("api")).content.decode()
    assert '<rect class="seg seg-done"' in page and 'data-n="2"' in page
    assert page.count('<rect class="seg seg-error"') == 1 and page.count('<rect class="seg seg-429"') == 1
    assert page.count('<rect class="seg seg-missed"') == 1
    assert "(2 done, 1 error, 1 deferred by 429, 1 missed their send moment)" in page


def test_dashboard_lists_keys_with_errors_first_then_blocked_then_the_longest_wait(viewer, make_call):
    edit.set_policy("full", 1, timedelta(hours=1))
    log_starts("full", [db_now()])
    busy = [make_call(keys=["busy"]).id for _ in range(3)]
    make_call(keys=["quiet"])
    make_call(keys=["full"])
    failing = make_call(keys=["failing"], status="failed", attempts=3, finished_at=db_now())
    Attempt.objects.create(call=failing, number=3, started_at=db_now(), finished_at=db_now(), outcome="failed", error="boom")
    CallQueue.objects.filter(id__in=busy).update(created_at=db_now() - timedelta(minutes=5))
    keys = [row["key"] for row in viewer.get(DASHBOARD).context["rows"]]
    assert keys == ["failing", "full", "busy", "quiet"]


def test_dashboard_filters_and_paginates_keys(viewer, make_call):
    CallQueue.objects.send_many([{"method": "noop", "keys": [f"tenant:{i:03d}"]} for i in range(120)])
    make_call(keys=["other"])
    first = viewer.get(DASHBOARD, {"q": "tenant", "sort": "key"})
    assert len(first.context["rows"]) == 50 and first.context["matching"] == 120
    page = first.content.decode()
    assert "page 1 of 3" in page and 'href="?q=tenant&amp;sort=key&amp;page=2"' in page
    last = viewer.get(DASHBOARD, {"q": "tenant", "sort": "key", "page": 3}).context["rows"]
    assert [r["key"] for r in last] == [f"tenant:{i:03d}" for i in range(100, 120)]
    assert viewer.get(DASHBOARD, {"q": "nothing-like-it"}).content.decode().count("No key matches.") == 1


def test_dashboard_refreshes_itself_unless_told_not_to(viewer):
    assert '<meta http-equiv="refresh" content="30">' in viewer.get(DASHBOARD).content.decode()
    assert 'http-equiv="refresh"' not in viewer.get(DASHBOARD, {"refresh": 0}).content.decode()


@pytest.mark.parametrize("params", [
    {"refresh": "soon"}, {"refresh": "-1"}, {"only": "everything"}, {"sort": "id"}, {"sort": "--errors"},
    {"sort": "key; drop table"}, {"sort": ""},
])
def test_dashboard_refuses_bad_parameters(viewer, params):
    response = viewer.get(DASHBOARD, params)
    assert response.status_code == 400 and response.content


def test_admin_index_links_the_dashboard(viewer):
    assert 'href="/dispatcher/dashboard/"' in viewer.get("/admin/").content.decode()


# --- calls list and page for operators (issue 15) -------------------------------------------------


def test_next_try_shows_when_a_limit_lets_the_call_start(operator, make_call):
    edit.set_policy("api", 1, timedelta(hours=1))
    log_starts("api", [db_now() - timedelta(minutes=1)])
    make_call()
    row = operator.get(CALLS).content.decode()
    assert ">in 59 min, limit of api</span>" in row  # short, on one line; the moment on hover
    assert 'title="not before 20' in row and "UTC (in 59 min) (limit of api)" in row


def test_age_of_a_finished_call_is_created_to_finished(operator, make_call):
    now = db_now()
    make_call(status="done", created_at=now - timedelta(hours=3), finished_at=now - timedelta(hours=3) + timedelta(seconds=42))
    assert "finished after 42 s" in operator.get(CALLS).content.decode()


def test_errors_are_shown_and_searchable(operator, make_call):
    failing = make_call(status="failed", finished_at=db_now(), last_error="HTTPError: 503 from upstream gateway\nmore")
    make_call()
    page = operator.get(CALLS).content.decode()
    assert "HTTPError: 503 from upstream gateway" in page
    assert list(operator.get(CALLS, {"q": "upstream gateway"}).context["cl"].result_list) == [failing]


def test_one_state_filter_covers_every_status(operator, make_call):
    page = operator.get(CALLS).content.decode()
    assert "By state" in page and "By status" not in page
    running, dispatched = make_call(status="running"), make_call(status="dispatched")
    assert list(operator.get(CALLS, {"state": "dispatched"}).context["cl"].result_list) == [dispatched]
    assert list(operator.get(CALLS, {"state": "running"}).context["cl"].result_list) == [running]


def test_key_filter_reaches_any_of_many_keys(operator, make_call):
    KeyState.objects.bulk_create([KeyState(key=f"tenant:{i:03d}") for i in range(300)])
    wanted = make_call(keys=["tenant:299"])
    make_call(keys=["tenant:001"])
    assert list(operator.get(CALLS, {"key": "tenant:299"}).context["cl"].result_list) == [wanted]
    suggested = operator.get(f"{CALLS}keys/", {"term": "tenant:29"}).json()["keys"]
    assert suggested == [f"tenant:{i}" for i in range(290, 300)]
    assert operator.get(f"{CALLS}keys/", {"term": "never-seen"}).json() == {"keys": []}


def test_call_page_buttons_retry_and_cancel_and_leave_history(operator, make_call):
    from django.contrib.admin.models import LogEntry

    failed = make_call(status="failed", attempts=3, finished_at=db_now(), last_error="boom")
    page = operator.get(f"{CALLS}{failed.id}/change/").content.decode()
    assert 'id="call-retry"' in page and 'id="call-cancel"' not in page
    response = operator.post(f"{CALLS}{failed.id}/retry/", follow=True)
    assert "1 call is due now." in response.content.decode()
    failed.refresh_from_db()
    assert failed.status == "pending"
    asked = operator.get(f"{CALLS}{failed.id}/cancel/").content.decode()
    assert f"Cancel call {failed.id}?" in asked and "1 waiting call will be cancelled" in asked
    assert CallQueue.objects.get(id=failed.id).status == "pending"  # asking changes nothing
    operator.post(f"{CALLS}{failed.id}/cancel/")
    failed.refresh_from_db()
    assert failed.status == "cancelled"
    history = list(LogEntry.objects.filter(object_id=str(failed.id)).order_by("id").values_list("user__username", "change_message"))
    assert history == [("op", "Retried now"), ("op", "Cancelled")]
    assert operator.get(f"{CALLS}{failed.id}/retry/").status_code == 405


def test_call_page_buttons_need_the_change_permission(viewer, make_call):
    call = make_call()
    assert 'id="call-cancel"' not in viewer.get(f"{CALLS}{call.id}/change/").content.decode()
    assert viewer.post(f"{CALLS}{call.id}/cancel/").status_code == 403
    assert viewer.get(f"{CALLS}{call.id}/cancel/").status_code == 403
    call.refresh_from_db()
    assert call.status == "pending"


def test_retry_now_on_a_limit_blocked_call_says_when_it_will_run(operator, make_call):
    edit.set_policy("api", 1, timedelta(hours=1))
    log_starts("api", [db_now() - timedelta(minutes=30)])
    call = make_call(run_at=db_now() + timedelta(minutes=5))
    text = run_action(operator, CALLS, "retry_now", [call.id]).content.decode()
    assert "1 call is due now." in text
    assert f"Call #{call.id} still waits: key api: 1 per 1h used" in text and "will start at 20" in text
    assert "UTC (in 30 min)." in text


def test_retry_now_of_a_big_backlog_explains_one_call_and_counts_the_held_ones_in_few_queries(operator):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    edit.set_policy("api", 10, timedelta(hours=1))
    log_starts("api", [db_now() - timedelta(minutes=30)] * 4)
    calls = CallQueue.objects.send_many([{"method": "noop", "keys": ["api"], "run_at": db_now() + timedelta(hours=2)}] * 500)
    with CaptureQueriesContext(connection) as queries:
        text = run_action(operator, CALLS, "retry_now", [c.id for c in calls]).content.decode()
    assert "500 calls are due now." in text
    # 6 of the key's 10 starts an hour are free: the first 6 go, the 7th is the first held.
    assert f"Call #{calls[6].id} still waits: 6 calls ahead of it on key api; will start at 20" in text
    assert "UTC (in 30 min)." in text
    assert "493 more of the calls wait for their keys&#x27; limits too." in text
    # The action, its message and the page after it; explaining each call took 1,713 queries here.
    assert len(queries) <= 50, [q["sql"][:80] for q in queries]


def test_policy_page_pause_and_resume_buttons_leave_history(operator):
    from django.contrib.admin.models import LogEntry

    policy = edit.set_policy("api", 5, timedelta(minutes=1))
    page = operator.get(f"{LIMITS}{policy.id}/change/").content.decode()
    assert 'id="policy-pause"' in page and 'id="policy-resume"' not in page  # nothing to resume
    assert "2 min" not in operator.post(f"{LIMITS}{policy.id}/pause/", {"duration": "soon"}, follow=True).content.decode()
    assert not KeyState.objects.filter(key="api", paused_until__isnull=False).exists()
    text = operator.post(f"{LIMITS}{policy.id}/pause/", {"duration": "2m"}, follow=True).content.decode()
    assert "1 key paused until 20" in text and "UTC (in 2 min)" in text
    assert KeyState.objects.get(key="api").paused_until > db_now()
    paused = operator.get(f"{LIMITS}{policy.id}/change/").content.decode()
    assert 'id="policy-resume"' in paused and 'class="policy-button"' in paused and "csrfmiddlewaretoken" in paused
    operator.post(f"{LIMITS}{policy.id}/resume/")
    assert KeyState.objects.get(key="api").paused_until is None
    messages = list(LogEntry.objects.filter(object_id=str(policy.id)).order_by("id").values_list("change_message", flat=True))
    assert messages == ["Paused for 2m", "Resumed"]


def test_finished_call_page_has_no_why_it_waits_and_one_time_format(operator, make_call):
    call = make_call(status="done", finished_at=db_now())
    page = operator.get(f"{CALLS}{call.id}/change/").content.decode()
    assert "Why it waits" not in page and "not waiting" not in page
    assert page.count(" UTC (") >= 3 and "p.m." not in page and "a.m." not in page


def test_attempt_history_tells_429_deferrals_from_counted_attempts(operator, make_call):
    call = make_call(deferrals=2, attempts=1)
    now = db_now()
    for number, outcome in enumerate(["rate_limited", "rate_limited", "error"], start=1):
        Attempt.objects.create(call=call, number=number, started_at=now, finished_at=now, outcome=outcome)
    page = operator.get(f"{CALLS}{call.id}/change/").content.decode()
    assert "deferral 1 (429, not counted)" in page and "deferral 2 (429, not counted)" in page
    assert "attempt 1 of 3" in page and "1 attempt counted against max_attempts (3), 2 starts deferred by a 429." in page
    assert "1/3 (+2 deferred by 429, not counted)" in page


def test_paused_wording_does_not_repeat_itself(operator, make_call):
    edit.pause_key("api", timedelta(minutes=2))
    page = operator.get(f"{CALLS}{make_call().id}/change/").content.decode()
    assert "key api is paused by operator until 20" in page and "(paused by operator)" not in page
    assert "until in" not in page


def test_editing_a_policy_leaves_history_of_who_changed_what(operator):
    from django.contrib.admin.models import LogEntry

    operator.post(f"{LIMITS}add/", policy_form())
    policy = RateLimit.objects.get()
    operator.post(f"{LIMITS}{policy.id}/change/", policy_form(limit="7"))
    entries = list(LogEntry.objects.filter(object_id=str(policy.id)).order_by("id"))
    assert [(e.user.username, e.is_addition(), e.is_change()) for e in entries] == [("op", True, False), ("op", False, True)]
    assert entries[1].get_change_message() == "Changed limit."


@pytest.mark.parametrize("model", ["callqueue", "ratelimit"])
def test_the_calls_and_rate_limit_lists_link_to_the_dashboard(operator, model):
    page = operator.get(f"/admin/dispatcher/{model}/").content.decode()
    assert 'href="/dispatcher/dashboard/">Dashboard</a>' in page


# --- the console for 3 a.m. (issue 27): titles, filters, short columns, live use ---------------------


def test_pages_are_titled_calls_call_n_and_rate_limits(operator, make_call):
    call = make_call()
    policy = edit.set_policy("api", 5, timedelta(minutes=1))
    assert "<h1>Calls</h1>" in operator.get(CALLS).content.decode()
    assert f"<h1>Call {call.id}</h1>" in operator.get(f"{CALLS}{call.id}/change/").content.decode()
    assert "<h1>Rate limits</h1>" in operator.get(LIMITS).content.decode()
    assert "<h1>Rate limit of api</h1>" in operator.get(f"{LIMITS}{policy.id}/change/").content.decode()
    for page in (CALLS, f"{CALLS}{call.id}/change/", LIMITS):
        text = operator.get(page).content.decode()
        assert "Select call to change" not in text and "Change call" not in text and "Select rate limit" not in text


def test_one_filter_shows_every_waiting_call(operator, make_call):
    never, retry, deferred = make_call(), make_call(attempts=1, last_error="x"), make_call(deferrals=1)
    done = make_call(status="done", finished_at=db_now())
    page = operator.get(CALLS, {"state": "waiting"}).content.decode()
    assert "Waiting (all)" in page
    for call in (never, retry, deferred):
        assert f"{CALLS}{call.id}/change/" in page
    assert f"{CALLS}{done.id}/change/" not in page


def test_one_attempt_reads_singular(operator, make_call):
    make_call(status="failed", attempts=1, max_attempts=1, finished_at=db_now())
    make_call(deferrals=1)
    page = operator.get(CALLS).content.decode()
    assert "failed (gave up after 1 attempt)" in page and "1 attempts" not in page
    assert "waiting after 429 (1 deferral)" in page


def test_an_http_call_shows_its_host_and_path_without_the_query(operator, make_call):
    make_call("http", {"method": "GET", "url": "http://127.0.0.1:9/v1/items?api_key=s3cr3t-value"})
    make_call("http", {"method": "GET", "url": "http://127.0.0.1:9/" + "x" * 200})
    page = operator.get(CALLS).content.decode()
    assert "127.0.0.1:9/v1/items" in page and "s3cr3t-value" not in page
    assert "127.0.0.1:9/" + "x" * 48 + "…" in page  # cut at 60 characters


def test_the_list_says_paused_for_a_key_an_operator_paused(operator, make_call):
    edit.set_policy("reports", 5, timedelta(minutes=1))
    edit.pause_key("reports", timedelta(minutes=10))
    make_call(keys=["reports"])
    page = operator.get(CALLS).content.decode()
    assert ", paused</span>" in page and "limit of reports" not in page


def test_the_policy_page_shows_live_use(operator, make_call):
    policy = edit.set_policy("api", 5, timedelta(minutes=1), 2)
    make_call(keys=["api"], status="running", started_at=db_now())
    make_call(keys=["api"])
    page = operator.get(f"{LIMITS}{policy.id}/change/").content.decode()
    live = page.split('id="policy-live"')[1].split("</table>")[0]
    assert "in flight</th><td>1/2</td>" in live and "waiting</th><td>1</td>" in live
