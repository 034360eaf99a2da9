"""In a real browser, DEBUG off on gunicorn: the failures view groups failed calls and retries a group
only after its confirmation page; cancelling calls from the list asks first."""
from __future__ import annotations

import os
from datetime import timedelta

import pytest

from dispatcher.clock import db_now
from dispatcher.models import CallQueue
from tests.browser.test_browser import CHROMIUM, browser_page, production_env, server  # noqa: F401 - fixtures

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (make browser-deps)"),
]

HTTP_503 = "dispatcher.handlers.RetryableHTTPError: HTTP 503: upstream down"
REFUSED = "dispatcher.handlers.RetryableHTTPError: http: billing.example.com: connection refused"


def store(keys: list[str], **fields) -> CallQueue:
    call = CallQueue.objects.send("noop", {}, keys=keys)
    CallQueue.objects.filter(id=call.id).update(**fields)
    return call


def statuses(error: str) -> list[str]:
    return sorted(CallQueue.objects.filter(last_error=error).values_list("status", flat=True))


def test_the_failures_view_groups_and_retries_a_group_after_confirmation(browser_page, server, artifacts_dir):  # noqa: F811
    now = db_now()
    for _ in range(3):
        store(["api"], status="failed", attempts=3, last_error=HTTP_503, finished_at=now)
    for _ in range(2):
        store(["billing"], attempts=1, last_error=REFUSED, started_at=now, run_at=now + timedelta(hours=1))
    page = browser_page
    page.goto(f"{server}/admin/")
    page.click("#dispatcher-failures-link a")
    page.wait_for_selector("#failure-groups")
    rows = page.locator("tr.failure-group")
    assert rows.count() == 2
    first = rows.nth(0)  # the largest group first
    assert first.locator(".error-class").inner_text() == "HTTP 5xx" and first.locator(".group-count").inner_text() == "3"
    assert rows.nth(1).locator(".error-class").inner_text() == "connection refused"
    assert rows.nth(1).locator("a.group-cancel").count() == 1 and first.locator("a.group-cancel").count() == 0
    page.screenshot(path=str(artifacts_dir / "failures.png"), full_page=True)

    first.locator("a.group-retry").click()
    page.wait_for_selector("#confirm-group")
    assert page.locator("h1").inner_text() == "Retry 3 calls?"
    assert "one more attempt" in page.locator("#group-effect").inner_text()
    assert statuses(HTTP_503) == ["failed"] * 3  # the page asked; nothing changed yet
    page.screenshot(path=str(artifacts_dir / "failures-confirm.png"), full_page=True)
    page.click("#confirm-group")
    page.wait_for_selector("ul.messagelist")
    assert "3 calls are due now." in page.locator("ul.messagelist").inner_text()
    assert statuses(HTTP_503) == ["pending"] * 3
    assert statuses(REFUSED) == ["pending"] * 2
    # The retried group now waits for its first new try: it is listed as waiting for a retry.
    assert page.locator("tr.failure-group").count() == 2


def test_cancel_from_the_calls_list_asks_first(browser_page, server, artifacts_dir):  # noqa: F811
    keep, cancel = store(["api"]), store(["api"])
    page = browser_page
    page.goto(f"{server}/admin/dispatcher/callqueue/?state=waiting")
    page.wait_for_selector("#result_list")
    assert page.locator("#result_list .field-next_try").first.evaluate("e => getComputedStyle(e).whiteSpace") == "nowrap"
    page.check(f"input[name=_selected_action][value='{cancel.id}']")
    page.select_option("select[name=action]", "cancel")
    page.click("button[name=index]")
    page.wait_for_selector("#confirm-cancel")
    assert page.locator("h1").inner_text() == "Cancel calls?"
    assert "1 waiting call will be cancelled" in page.locator("#cancel-effect").inner_text()
    assert CallQueue.objects.get(id=cancel.id).status == "pending"  # asked, not done
    page.screenshot(path=str(artifacts_dir / "cancel-confirm.png"), full_page=True)
    page.click("#confirm-cancel")
    page.wait_for_selector("ul.messagelist")
    assert "1 call cancelled." in page.locator("ul.messagelist").inner_text()
    assert CallQueue.objects.get(id=cancel.id).status == "cancelled"
    assert CallQueue.objects.get(id=keep.id).status == "pending"

    # The call's own page asks too.
    page.goto(f"{server}/admin/dispatcher/callqueue/{keep.id}/change/")
    page.click("#call-cancel")
    page.wait_for_selector("#confirm-cancel")
    assert page.locator("h1").inner_text() == f"Cancel call {keep.id}?"
    assert CallQueue.objects.get(id=keep.id).status == "pending"
    page.click("#confirm-cancel")
    page.wait_for_selector("ul.messagelist")
    assert CallQueue.objects.get(id=keep.id).status == "cancelled"
