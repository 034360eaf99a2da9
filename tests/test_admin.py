"""The admin through the test client: calls, rate limits, actions, validation, dashboard, permissions."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client

from dispatcher.clock import db_now
from dispatcher.models import Attempt, CallQueue, KeyState, RateLimit
from tests.starts import log_starts

pytestmark = pytest.mark.django_db

CALLS = "/admin/dispatcher/callqueue/"
LIMITS = "/admin/dispatcher/ratelimit/"
DASHBOARD = "/admin/dispatcher/dashboard/"


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


def send(method: str = "noop", params: dict | None = None, keys: list[str] | None = None, **fields) -> CallQueue:
    call = CallQueue.objects.send(method, params or {}, keys=keys or ["api"])
    if fields:
        CallQueue.objects.filter(id=call.id).update(**fields)
        call.refresh_from_db()
    return call


def run_action(client: Client, url: str, action: str, ids: list[int], **extra) -> object:
    return client.post(url, {"action": action, "_selected_action": [str(i) for i in ids], "index": 0, **extra}, follow=True)


# --- calls list, filters, search -------------------------------------------------------------


def test_call_list_tells_never_tried_from_retrying_from_given_up(operator):
    send()
    send(attempts=1, last_error="boom", run_at=db_now() + timedelta(minutes=1))
    send(status="failed", attempts=3, finished_at=db_now())
    page = operator.get(CALLS).content.decode()
    assert "waiting (never tried)" in page
    assert "waiting for retry (1/3 tried)" in page
    assert "failed (gave up after 3 attempts)" in page
    assert "in 1 min" in page  # next try


@pytest.mark.parametrize(("state", "expected"), [("new", "never"), ("retry", "retry"), ("failed", "failed"), ("in_flight", "running")])
def test_call_list_filters_by_state(operator, state, expected):
    calls = {
        "never": send(),
        "retry": send(attempts=1),
        "failed": send(status="failed", finished_at=db_now()),
        "running": send(status="running"),
    }
    shown = list(operator.get(CALLS, {"state": state}).context["cl"].result_list)
    assert shown == [calls[expected]]


def test_call_list_filters_by_method_and_key(operator):
    greet = send("greet", {"name": "ann"}, keys=[])
    other = send(keys=["billing"])
    send(keys=["api"])
    assert list(operator.get(CALLS, {"method": "greet"}).context["cl"].result_list) == [greet]
    assert list(operator.get(CALLS, {"key": "billing"}).context["cl"].result_list) == [other]
    # A key filter matches whole keys, not prefixes of them.
    assert list(operator.get(CALLS, {"key": "bill"}).context["cl"].result_list) == []


def test_call_search_by_id_and_params(operator):
    ann = send("greet", {"name": "annabel"}, keys=[])
    bob = send("greet", {"name": "bob"}, keys=[])
    assert list(operator.get(CALLS, {"q": "annabel"}).context["cl"].result_list) == [ann]
    assert list(operator.get(CALLS, {"q": str(bob.id)}).context["cl"].result_list) == [bob]


# --- call detail ----------------------------------------------------------------------------------


def detail(client: Client, call: CallQueue) -> str:
    response = client.get(f"{CALLS}{call.id}/change/")
    assert response.status_code == 200
    return response.content.decode()


def test_detail_shows_redacted_params_result_error_traceback_and_attempts(operator):
    call = send(params={"url": "x", "api_key": "SECRET-123", "headers": {"Authorization": "Bearer abc"}},
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
def test_detail_says_why_a_call_waits_and_until_when(operator, reason):
    now = db_now()
    if reason == "run_at":
        call = send(run_at=now + timedelta(minutes=10))
        expected = ["scheduled: run_at is in 10 min", "Waits until"]
    elif reason == "backoff":
        call = send(attempts=1, run_at=now + timedelta(seconds=40), last_error="boom")
        Attempt.objects.create(call=call, number=1, started_at=now, outcome="error")
        expected = ["retry backoff after attempt 1 of 3", "in 40 s"]
    elif reason == "deferred":
        call = send(deferrals=1, run_at=now + timedelta(seconds=40))
        Attempt.objects.create(call=call, number=1, started_at=now, outcome="rate_limited")
        expected = ["deferred by a 429", "in 40 s"]
    elif reason == "paused":
        RateLimit.objects.pause_key("api", timedelta(minutes=5), reason="maintenance")
        call = send()
        expected = ["key api is paused (maintenance) until in 5 min"]
    elif reason == "rate":
        RateLimit.objects.set_policy("api", 1, timedelta(minutes=1))
        log_starts("api", [now - timedelta(seconds=30)])
        call = send()
        expected = ["key api: 1 per 1m used; next slot frees in 30 s"]
    else:
        RateLimit.objects.set_policy("api", 10, timedelta(seconds=1), concurrency=1)
        KeyState.objects.update_or_create(key="api", defaults={"running": 1})
        call = send()
        expected = ["concurrency 1/1", "until a call in flight finishes"]
    page = detail(operator, call)
    for text in expected:
        assert text in page


def test_calls_cannot_be_edited_added_or_deleted_by_hand(operator):
    call = send()
    response = operator.post(f"{CALLS}{call.id}/change/", {"method": "explode", "status": "done"})
    assert response.status_code == 403
    call.refresh_from_db()
    assert (call.method, call.status) == ("noop", "pending")
    assert operator.get(f"{CALLS}add/").status_code == 403
    assert operator.post(f"{CALLS}{call.id}/delete/", {"post": "yes"}).status_code == 403
    assert CallQueue.objects.filter(id=call.id).exists()


# --- actions ----------------------------------------------------------------------------------------


def test_retry_now_gives_a_failed_call_one_more_attempt_and_leaves_done_calls(operator):
    failed = send(status="failed", attempts=3, finished_at=db_now(), last_error="boom")
    done = send(status="done", attempts=1, finished_at=db_now())
    later = send(run_at=db_now() + timedelta(hours=1))
    response = run_action(operator, CALLS, "retry_now", [failed.id, done.id, later.id])
    text = response.content.decode()
    assert "2 calls will be retried now." in text and "1 call was not waiting or failed" in text
    failed.refresh_from_db(), done.refresh_from_db(), later.refresh_from_db()
    assert (failed.status, failed.max_attempts, failed.finished_at) == ("pending", 4, None)
    assert failed.run_at <= db_now()
    assert later.run_at <= db_now()
    assert done.status == "done"


def test_cancel_cancels_waiting_calls_only(operator):
    waiting = send()
    running = send(status="running")
    response = run_action(operator, CALLS, "cancel", [waiting.id, running.id])
    text = response.content.decode()
    assert "1 call cancelled." in text and "1 call was not waiting" in text
    waiting.refresh_from_db(), running.refresh_from_db()
    assert (waiting.status, running.status) == ("cancelled", "running")


def test_viewer_without_change_permission_cannot_run_actions(viewer):
    call = send(status="failed", finished_at=db_now())
    page = viewer.get(CALLS).content.decode()
    assert "retry_now" not in page
    run_action(viewer, CALLS, "retry_now", [call.id])
    run_action(viewer, CALLS, "cancel", [call.id])
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
    assert rows["api"][1:3] == ["2 per 1s, burst 40", "0/40"]


def test_a_second_policy_with_the_same_key_and_period_is_refused(operator):
    RateLimit.objects.set_policy("api", 5, timedelta(minutes=5))
    response = operator.post(f"{LIMITS}add/", policy_form())
    assert response.status_code == 200 and "already exists" in response.content.decode()
    assert RateLimit.objects.get().limit == 5


def test_policy_list_shows_live_usage(operator):
    RateLimit.objects.set_policy("api", 3, timedelta(minutes=1), concurrency=2)
    RateLimit.objects.set_policy("tenant:*", 4, timedelta(minutes=1))
    now = db_now()
    log_starts("api", [now - timedelta(seconds=s) for s in (50, 20, 10)])
    log_starts("tenant:9", [now - timedelta(seconds=5)])
    KeyState.objects.update_or_create(key="api", defaults={"running": 1})
    send(created_at=now - timedelta(minutes=3))
    send(keys=["tenant:9"])
    rows = {cells[0]: cells for cells in _rows(operator.get(LIMITS).content.decode())}
    # key, policy, used, in flight, waiting, oldest wait, paused until, next free slot
    assert rows["api"][1:8] == ["3 per 1m", "3/3", "1/2", "1", "3 min", "-", "in 10 s"]
    assert rows["tenant:*"][2:5] == ["1/4 (busiest: tenant:9)", "0", "1"] and rows["tenant:*"][7] == "now"


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
    policy = RateLimit.objects.set_policy("api", 3, timedelta(minutes=1))
    response = run_action(operator, LIMITS, "pause", [policy.id], duration="5m")
    assert "1 key paused until" in response.content.decode()
    state = KeyState.objects.get(key="api")
    assert timedelta(minutes=4) < state.paused_until - db_now() <= timedelta(minutes=5)
    response = run_action(operator, LIMITS, "resume", [policy.id])
    assert "1 pause lifted." in response.content.decode()
    assert KeyState.objects.get(key="api").paused_until is None


@pytest.mark.parametrize("duration", ["", "soon", "0s"])
def test_pause_with_a_bad_duration_pauses_nothing(operator, duration):
    policy = RateLimit.objects.set_policy("api", 3, timedelta(minutes=1))
    response = run_action(operator, LIMITS, "pause", [policy.id], duration=duration)
    assert "Pause not applied" in response.content.decode()
    assert not KeyState.objects.filter(paused_until__isnull=False).exists()


def test_viewer_cannot_edit_or_pause_policies(viewer):
    policy = RateLimit.objects.set_policy("api", 3, timedelta(minutes=1))
    assert viewer.post(f"{LIMITS}{policy.id}/change/", policy_form(limit="99")).status_code == 403
    run_action(viewer, LIMITS, "pause", [policy.id], duration="5m")
    assert RateLimit.objects.get().limit == 3
    assert not KeyState.objects.filter(paused_until__isnull=False).exists()


# --- dashboard ---------------------------------------------------------------------------------------


def test_dashboard_charts_starts_per_minute_against_the_limit(viewer):
    RateLimit.objects.set_policy("api", 10, timedelta(minutes=1))
    now = db_now()
    # Seven starts inside one minute, two minutes ago (not straddling a minute boundary).
    minute = now.replace(second=0, microsecond=0) - timedelta(minutes=2)
    log_starts("api", [minute + timedelta(seconds=s) for s in range(7)])
    for _ in range(25):
        send()
    page = viewer.get(DASHBOARD).content.decode()
    assert 'data-key="api"' in page and 'data-total="7"' in page
    assert page.count('class="bar"') == 60 and 'data-starts="7"' in page
    assert "limit 10.0/min" in page
    # 25 waiting at 10 per minute with 10 free now: 15 more need 2 more minutes.
    assert '<td class="backlog">25 (25 due)</td>' in page and '<td class="drain">2 min</td>' in page


# --- permissions --------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [CALLS, LIMITS, DASHBOARD])
def test_anonymous_and_non_staff_are_sent_to_the_login_page(url):
    for client in (client_for(None), client_for(make_user("plain", staff=False))):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]


@pytest.mark.parametrize("url", [CALLS, LIMITS, DASHBOARD])
def test_staff_without_permissions_is_refused(url):
    assert client_for(make_user("staff")).get(url).status_code == 403


def test_view_only_staff_can_read_calls_and_limits(viewer):
    call = send()
    RateLimit.objects.set_policy("api", 3, timedelta(minutes=1))
    assert viewer.get(CALLS).status_code == 200
    assert viewer.get(f"{CALLS}{call.id}/change/").status_code == 200
    assert viewer.get(LIMITS).status_code == 200
    assert viewer.get(f"{LIMITS}add/").status_code == 403
