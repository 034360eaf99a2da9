"""A real browser logs into the admin and finds the dashboard's chart drawn with data."""
from __future__ import annotations

import os
import shutil
from datetime import timedelta

import pytest
from django.contrib.auth.models import User

from dispatcher.limiter import Policies
from dispatcher.models import CallQueue, RateLimit
from dispatcher.worker import execute

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (make browser-deps)"),
]


def test_admin_dashboard_draws_the_chart_with_data(live_server, artifacts_dir):
    sync_api = pytest.importorskip("playwright.sync_api")
    User.objects.create_superuser("admin", "admin@example.com", "pw-123456")
    RateLimit.objects.set_policy("greeter", 30, timedelta(minutes=1))
    for name in ("a", "b", "c"):
        call = CallQueue.objects.send("greet", {"name": name})
        claimed = CallQueue.objects.claim(call.key_set, 1, Policies.load()).calls[0]
        execute(claimed.id, claimed.dispatch_no)
    CallQueue.objects.send("greet", {"name": "waiting"})

    # Django's async-safety check trips on Playwright's event loop in this thread.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{live_server.url}/admin/login/?next=/admin/dispatcher/dashboard/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "pw-123456")
            page.click("input[type=submit]")
            page.wait_for_selector("section.key-panel[data-key='greeter'] svg.chart")
            chart = page.locator("section.key-panel[data-key='greeter'] svg.chart")
            assert chart.get_attribute("data-total") == "3"
            bars = chart.locator("rect.bar")
            drawn = [int(bars.nth(i).get_attribute("data-starts")) for i in range(bars.count())]
            assert sum(drawn) == 3
            assert chart.locator("line.limit").count() == 1
            page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
        finally:
            browser.close()
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    assert (artifacts_dir / "dashboard.png").stat().st_size > 1000
