"""dispatcher.urls under "dispatcher/" routes the dashboard, the metrics and the API; no link the app renders is a 404."""
from __future__ import annotations

import re
from collections import deque
from datetime import timedelta
from html import unescape
from urllib.parse import urldefrag, urlsplit

import pytest
from django.conf import settings
from django.contrib import admin
from django.contrib.auth.models import User
from django.contrib.staticfiles import finders
from django.test import Client
from django.urls import reverse

from dispatcher.models import RateLimit

pytestmark = pytest.mark.django_db

HREF = re.compile(r'href="([^"]*)"')
# Enough for the index, the dashboard, the dispatcher's lists and their first pages; bounded.
MAX_PAGES = 120


@pytest.fixture
def staff() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("root", password="pw"))
    return client


def test_dispatcher_urls_route_the_dashboard_the_metrics_and_the_api():
    assert reverse("dispatcher:dashboard") == "/dispatcher/dashboard/"
    assert reverse("dispatcher:metrics") == "/dispatcher/metrics"
    assert reverse("dispatcher:enqueue") == "/dispatcher/calls/"
    assert reverse("dispatcher:call-status", args=[7]) == "/dispatcher/calls/7/"


def test_the_dashboard_sends_a_visitor_to_the_admin_login(client):
    response = client.get("/dispatcher/dashboard/")
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/?next=/dispatcher/dashboard/")


def test_staff_see_the_dashboard_and_the_metrics_under_dispatcher(staff):
    assert "Dispatcher dashboard" in staff.get("/dispatcher/dashboard/").content.decode()
    metrics = staff.get("/dispatcher/metrics")
    assert metrics.status_code == 200 and b"dispatcher_" in metrics.content


def test_the_old_paths_answer_still(staff):
    for old in ("/admin/dispatcher/dashboard/", "/metrics"):
        assert staff.get(old).status_code == 200, old
    # The API's old path: a request without a token is refused as on the new one, not a 404.
    assert Client().get("/api/calls/1/").status_code == Client().get("/dispatcher/calls/1/").status_code == 401


def test_view_site_leads_to_the_dashboard_on_a_site_without_a_root_page(staff):
    page = staff.get("/admin/").content.decode()
    assert '<a href="/dispatcher/dashboard/">View site</a>' in page
    assert str(admin.site.site_url) == "/dispatcher/dashboard/"


def _links(html: str) -> list[str]:
    """Return the page's links to this site (paths, fragments dropped)."""
    found = []
    for raw in HREF.findall(html):
        url = urldefrag(unescape(raw)).url
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or not url:
            continue  # another site, or only a fragment
        found.append(url)
    return found


def test_no_link_of_the_index_the_dashboard_and_the_dispatcher_pages_is_a_404(staff, make_call):
    make_call()
    make_call(status="failed", attempts=3, last_error="boom")
    RateLimit.objects.create(key="api", limit=5, period=timedelta(seconds=1))
    start = ["/admin/", "/dispatcher/dashboard/"]
    seen: set[str] = set(start)
    todo = deque((url, "start") for url in start)
    broken: list[tuple[str, str, int]] = []
    pages = 0
    while todo and pages < MAX_PAGES:
        url, source = todo.popleft()
        response = staff.get(url)
        pages += 1
        if response.status_code == 404:
            broken.append((url, source, 404))
            continue
        path = urlsplit(url).path
        # Follow further only from the dispatcher's own pages (the admin index links them all).
        if response.status_code != 200 or not (path == "/admin/" or path.startswith(("/admin/dispatcher/", "/dispatcher/"))):
            continue
        for link in _links(response.content.decode()):
            target = link if link.startswith("/") else urlsplit(url).path + link
            if target.startswith("/admin/logout/") or target in seen:
                continue
            if target.startswith(settings.STATIC_URL):
                # Served by WhiteNoise from collectstatic's copy: the file must exist to be collected.
                if finders.find(urlsplit(target).path.removeprefix(settings.STATIC_URL)) is None:
                    broken.append((target, url, 404))
                seen.add(target)
                continue
            seen.add(target)
            todo.append((target, url))
    assert not broken, f"links that answer 404 (url, on page, status): {broken}"
    assert pages > 10  # the crawl reached the dispatcher's pages, not only the two it began on
