"""The failures view: failed and retrying calls grouped in SQL by keys, state and error class; bulk
retry and cancel of a group behind a confirmation, for staff who may change calls only."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from dispatcher import failures
from dispatcher.clock import db_now
from dispatcher.models import CallQueue
from tests.integration.test_admin import client_for, make_user

pytestmark = pytest.mark.django_db

FAILURES = "/admin/dispatcher/callqueue/failures/"
GROUP = "/admin/dispatcher/callqueue/failures/group/"
HTTP_503 = "dispatcher.handlers.RetryableHTTPError: HTTP 503: upstream down"
HTTP_404 = "dispatcher.exceptions.PermanentError: HTTP 404: no such thing"
REFUSED = "dispatcher.handlers.RetryableHTTPError: http: api.example.com: connection refused"
FLAT = "dispatcher.handlers.RetryableHTTPError: http: no usable answer from api.example.com:8443 within 30s"


@pytest.fixture
def operator() -> Client:
    return client_for(make_user("op", perms=("view_callqueue", "change_callqueue")))


@pytest.fixture
def viewer() -> Client:
    return client_for(make_user("viewer", perms=("view_callqueue",)))


def failed(make_call, error: str, keys: list[str], **fields) -> CallQueue:
    return make_call(keys=keys, status="failed", attempts=3, last_error=error, finished_at=db_now(), **fields)


def retrying(make_call, error: str, keys: list[str]) -> CallQueue:
    return make_call(keys=keys, attempts=1, last_error=error, run_at=db_now() + timedelta(hours=1), started_at=db_now())


@pytest.fixture
def incident(make_call) -> dict[str, list[CallQueue]]:
    """A key answering 503 and 404, another refusing connections, and calls that are no failure."""
    made = {
        "a503": [failed(make_call, HTTP_503, ["a"]) for _ in range(3)],
        "a404": [failed(make_call, HTTP_404, ["a"]) for _ in range(2)],
        "brefused": [retrying(make_call, REFUSED, ["b"]) for _ in range(2)],
        "bflat": [retrying(make_call, FLAT, ["b"])],
        "bvalue": [failed(make_call, "ValueError: boom", ["b"])],
        "blost": [failed(make_call, "lost: no result within DISPATCHER_RUN_TIMEOUT (5m)", ["b"])],
    }
    make_call(keys=["a"])  # never tried
    make_call(keys=["a"], status="done", finished_at=db_now())
    make_call(keys=["a"], status="cancelled", last_error="", finished_at=db_now())
    return made


def test_calls_are_grouped_by_keys_state_and_error_class_largest_first(incident):
    page = failures.groups()
    found = [(g.keys, g.state, g.error_class, g.count) for g in page.groups]
    assert found == [
        (["a"], "failed", "HTTP 5xx", 3),
        (["a"], "failed", "HTTP 4xx", 2),
        (["b"], "retrying", "connection refused", 2),
        (["b"], "failed", "ValueError", 1),
        (["b"], "failed", "lost (no result in time)", 1),
        (["b"], "retrying", failures.NO_KIND, 1),
    ]
    assert page.total == 6
    first = page.groups[0]
    assert first.example == incident["a503"][-1].id and first.example_error.startswith("dispatcher.handlers.RetryableHTTPError: HTTP 503")
    assert first.first_seen <= first.last_seen


def test_the_key_and_state_filters_narrow_the_groups(incident):
    assert {g.error_class for g in failures.groups(key="a").groups} == {"HTTP 5xx", "HTTP 4xx"}
    assert {g.error_class for g in failures.groups(state="retrying").groups} == {"connection refused", failures.NO_KIND}


def test_the_page_lists_each_group_with_its_example_and_actions(operator, incident):
    page = operator.get(FAILURES).content.decode()
    assert page.count('class="failure-group"') == 6
    assert f'/admin/dispatcher/callqueue/{incident["a503"][-1].id}/change/' in page
    assert "HTTP 5xx" in page and "connection refused" in page
    assert page.count("group-retry") == 6 and page.count("group-cancel") == 2  # cancel: waiting calls only


def test_the_list_s_queries_do_not_grow_with_the_groups(operator, make_call):
    for key in ("k1", "k2"):
        failed(make_call, HTTP_503, [key])
    with CaptureQueriesContext(connection) as few:
        operator.get(FAILURES)
    for n in range(40):
        failed(make_call, HTTP_404 if n % 2 else HTTP_503, [f"key{n}"])
    with CaptureQueriesContext(connection) as many:
        assert operator.get(FAILURES).content.decode().count('class="failure-group"') == 42
    # The session, the user and the clock; then the groups with their count, and the examples' errors.
    assert len(few.captured_queries) == len(many.captured_queries) <= 9
    assert sum("GROUP BY" in q["sql"] for q in many.captured_queries) == 1


def test_groups_are_paged(operator, make_call):
    for n in range(failures.PER_PAGE + 3):
        failed(make_call, HTTP_503, [f"key{n:03}"])
    first = operator.get(FAILURES).content.decode()
    assert first.count('class="failure-group"') == failures.PER_PAGE and "53 groups, page 1 of 2" in first
    second = operator.get(FAILURES, {"p": 2}).content.decode()
    assert second.count('class="failure-group"') == 3 and "53 groups, page 2 of 2" in second
    assert failures.groups(page=3).total == 53 and not failures.groups(page=3).groups  # past the end
    assert "No group on page 3: there are 53 groups on 2 pages." in operator.get(FAILURES, {"p": 3}).content.decode()


def group_query(call: CallQueue, state: str, error_class: str, do: str) -> dict[str, str]:
    return {"key_set": call.key_set, "state": state, "class": error_class, "do": do}


def test_a_bulk_retry_says_what_it_will_do_then_does_it_on_post(operator, incident):
    query = group_query(incident["a503"][0], "failed", "HTTP 5xx", "retry")
    page = operator.get(GROUP, query).content.decode()
    assert "Retry 3 calls?" in page and "one more attempt" in page
    assert CallQueue.objects.filter(status="failed", last_error=HTTP_503).count() == 3  # a GET changes nothing
    response = operator.post(GROUP, query, follow=True)
    assert "3 calls are due now." in response.content.decode()
    assert sorted(CallQueue.objects.filter(last_error=HTTP_503).values_list("status", flat=True)) == ["pending"] * 3
    assert CallQueue.objects.filter(last_error=HTTP_404, status="failed").count() == 2  # the other group untouched
    assert all(c.max_attempts == 4 for c in CallQueue.objects.filter(last_error=HTTP_503))


def test_a_bulk_cancel_cancels_the_retrying_group_only(operator, incident):
    query = group_query(incident["brefused"][0], "retrying", "connection refused", "cancel")
    assert "Cancel 2 calls?" in operator.get(GROUP, query).content.decode()
    assert "2 calls cancelled." in operator.post(GROUP, query, follow=True).content.decode()
    assert list(CallQueue.objects.filter(last_error=REFUSED).values_list("status", flat=True)) == ["cancelled"] * 2
    assert CallQueue.objects.get(last_error=FLAT).status == "pending"


def test_a_view_only_user_sees_the_groups_but_can_neither_retry_nor_cancel(viewer, incident):
    page = viewer.get(FAILURES).content.decode()
    assert page.count('class="failure-group"') == 6 and "group-retry" not in page
    query = group_query(incident["a503"][0], "failed", "HTTP 5xx", "retry")
    assert viewer.get(GROUP, query).status_code == 403
    assert viewer.post(GROUP, query).status_code == 403
    assert CallQueue.objects.filter(status="failed", last_error=HTTP_503).count() == 3


def test_a_post_without_the_csrf_token_is_refused(incident):
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("op", perms=("view_callqueue", "change_callqueue")))
    assert client.post(GROUP, group_query(incident["a503"][0], "failed", "HTTP 5xx", "retry")).status_code == 403
    assert CallQueue.objects.filter(status="failed", last_error=HTTP_503).count() == 3


def test_outsiders_are_sent_to_the_login(client):
    assert client.get(FAILURES).status_code == 302


@pytest.mark.parametrize("query", [
    {"p": "x"}, {"p": "0"}, {"p": "9" * 30}, {"p": "²"}, {"state": "done"}, {"key": "a\x00"}, {"bogus": "1"},
    {"key": "a" * 5000}, {"status__regex": "."},
])
def test_a_bad_query_string_is_a_400_not_a_500(operator, query):
    response = operator.get(FAILURES, query)
    assert response.status_code == 400


@pytest.mark.parametrize("change", [
    {"do": "delete"}, {"state": "failed", "do": "cancel"}, {"key_set": ""}, {"class": "x\x00"}, {"extra": "1"}, {"state": "x"},
])
def test_a_bad_group_request_is_a_400_and_changes_nothing(operator, incident, change):
    query = {**group_query(incident["a503"][0], "failed", "HTTP 5xx", "retry"), **change}
    assert operator.get(GROUP, query).status_code == 400
    assert operator.post(GROUP, query).status_code == 400
    assert CallQueue.objects.filter(status="failed", last_error=HTTP_503).count() == 3


def test_a_group_emptied_meanwhile_says_so(operator, make_call):
    call = failed(make_call, HTTP_503, ["a"])
    CallQueue.objects.retry_now([call.id])
    page = operator.get(GROUP, group_query(call, "failed", "HTTP 5xx", "retry")).content.decode()
    assert "No call is left in this group" in page


def test_the_index_and_the_calls_list_link_the_failures(operator):
    assert FAILURES in operator.get("/admin/").content.decode()
    assert FAILURES in operator.get("/admin/dispatcher/callqueue/").content.decode()


def test_an_error_not_written_by_a_worker_is_unclassified_and_a_secret_never_shown(operator, make_call):
    failed(make_call, "a sentence stored by hand: with words", ["a"])
    failed(make_call, "no separator at all", ["a"])
    failed(make_call, "password=hunter2: stored by SQL", ["b"])
    assert {(g.keys[0], g.error_class) for g in failures.groups().groups} == {
        ("a", failures.UNCLASSIFIED), ("b", "password=hunter2"),
    }
    page = operator.get(FAILURES).content.decode()
    assert "hunter2" not in page
    assert page.count("group-retry") == 1  # the redacted class offers no action: its text would ride in the link
