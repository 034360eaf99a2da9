"""A real browser on the admin served as in production: gunicorn, DEBUG off, WhiteNoise, collectstatic."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth.models import User

from dispatcher.limits import edit
from dispatcher.models import CallQueue
from dispatcher.worker import execute
from support.processes import ROOT, database_url, wait_until
from tests.claims import claim

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="chromium is not installed (make browser-deps)"),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def production_env(tmp_path) -> dict[str, str]:
    """The project's own settings with DEBUG off, on the test database, static files collected."""
    from django.db import connection

    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DJANGO_DEBUG": "false",
        "DJANGO_STATIC_ROOT": str(tmp_path / "static"),
        "DISPATCHER_VAR_DIR": str(tmp_path / "var"),
        "DATABASE_URL": database_url(connection.settings_dict),
        "CELERY_BROKER_URL": "memory://",
        "DISPATCHER_HEARTBEAT_TIMEOUT": "3s",
    }
    run = subprocess.run([sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return env


@pytest.fixture
def server(production_env, tmp_path) -> Iterator[str]:
    """Gunicorn on 127.0.0.1, as the docker-compose web service runs it."""
    port = _free_port()
    log = open(tmp_path / "gunicorn.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "project.wsgi:application", "--bind", f"127.0.0.1:{port}", "--workers", "1"],
        cwd=ROOT, env=production_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return urllib.request.urlopen(f"{url}/admin/login/", timeout=2).status == 200
        except OSError:
            return False

    try:
        assert wait_until(up, timeout=30, interval=0.2), (tmp_path / "gunicorn.log").read_text()
        yield url
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=15)


@pytest.fixture
def browser_page(server, monkeypatch, settings) -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api")
    # Django's async-safety check trips on Playwright's event loop in this thread.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    # The server checks the password with the project's hashers, not the tests' fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    User.objects.create_superuser("admin", "admin@example.com", "pw-123456")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{server}/admin/login/")
            page.fill("#id_username", "admin")
            page.fill("#id_password", "pw-123456")
            page.click("input[type=submit]")
            page.wait_for_selector("#user-tools")
            yield page
        finally:
            browser.close()


def _style(page, selector: str, prop: str) -> str:
    return page.eval_on_selector(selector, f"e => getComputedStyle(e).getPropertyValue('{prop}')")


def test_admin_is_styled_with_debug_off(browser_page, server, artifacts_dir):
    page = browser_page
    # The admin's stylesheet colours the header; unstyled HTML leaves it transparent.
    assert _style(page, "#header", "background-color") not in ("", "rgba(0, 0, 0, 0)")
    assert _style(page, "#header", "display") == "flex"
    with urllib.request.urlopen(f"{server}/static/admin/css/base.css", timeout=5) as response:
        assert response.status == 200 and "text/css" in response.headers["Content-Type"]
    page.screenshot(path=str(artifacts_dir / "admin-index.png"), full_page=True)


def test_dashboard_draws_the_chart_with_axes_and_limit(browser_page, server, artifacts_dir):
    edit.set_policy("greeter", 30, timedelta(minutes=1))
    for name in ("a", "b", "c"):
        call = CallQueue.objects.send("greet", {"name": name})
        claimed = claim(call.key_set, 1).calls[0]
        execute(claimed.id, claimed.dispatch_no)
    CallQueue.objects.send("greet", {"name": "waiting"})
    page = browser_page
    page.goto(f"{server}/admin/dispatcher/dashboard/")
    chart = page.locator("section.key-panel[data-key='greeter'] svg.chart")
    chart.wait_for()
    assert chart.get_attribute("data-total") == "3"
    bars = chart.locator("rect.bar")
    assert sum(int(bars.nth(i).get_attribute("data-starts")) for i in range(bars.count())) == 3
    # Stroke colours come from the dashboard's stylesheet: without it the axes and limit vanish.
    panel = "section.key-panel[data-key='greeter'] svg.chart"
    assert _style(page, f"{panel} line.axis", "stroke") == "rgb(153, 153, 153)"
    assert _style(page, f"{panel} line.limit", "stroke") == "rgb(186, 33, 33)"
    page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
    assert (artifacts_dir / "dashboard.png").stat().st_size > 1000


def test_liveness_warning_appears_after_the_dispenser_stops(browser_page, server, production_env, tmp_path, settings, artifacts_dir):
    from dispatcher import liveness

    settings.DISPATCHER_HEARTBEAT_TIMEOUT = production_env["DISPATCHER_HEARTBEAT_TIMEOUT"]
    log = open(tmp_path / "dispenser.log", "wb")
    dispenser = subprocess.Popen([sys.executable, "manage.py", "dispense", "--loop"], cwd=ROOT, env=production_env,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    page = browser_page
    try:
        assert wait_until(lambda: liveness.read().alive("dispenser"), timeout=30), (tmp_path / "dispenser.log").read_text()
        page.goto(f"{server}/admin/")
        assert page.locator("#dispatcher-liveness li[data-kind='dispenser']").inner_text().startswith("1 dispenser running")
    finally:
        os.killpg(dispenser.pid, 15)
        dispenser.wait(timeout=15)
    call = CallQueue.objects.send("greet", {"name": "stranded"})
    page.goto(f"{server}/admin/")
    warning = page.locator("#dispatcher-liveness li[data-kind='dispenser']")
    assert warning.inner_text().startswith("no dispenser has run since")
    assert _style(page, "#dispatcher-liveness li[data-kind='dispenser']", "font-weight") == "700"
    page.screenshot(path=str(artifacts_dir / "liveness-index.png"), full_page=True)
    page.goto(f"{server}/admin/dispatcher/callqueue/{call.id}/change/")
    assert "no dispenser has run since" in page.locator(".why-stalled").inner_text()
    page.screenshot(path=str(artifacts_dir / "liveness-call.png"), full_page=True)


def test_dashboard_draws_each_limit_of_a_multi_window_key(browser_page, server, artifacts_dir):
    from dispatcher.clock import db_now
    from tests.starts import log_starts

    # 100 per hour plus 10 per minute, both kept: 9 starts in each of 10 minutes of the last hour.
    edit.set_policy("crm", 100, timedelta(hours=1))
    edit.set_policy("crm", 10, timedelta(minutes=1))
    now = db_now()
    minutes = [now.replace(second=30, microsecond=0) - timedelta(minutes=k) for k in range(2, 60, 6)]
    log_starts("crm", [m - timedelta(seconds=s) for m in minutes for s in range(9)])
    page = browser_page
    page.goto(f"{server}/admin/dispatcher/dashboard/")
    section = "section.key-panel[data-key='crm']"
    page.locator(f"{section} svg.chart").wait_for()
    # The bars are drawn against the per-minute policy (10/min), not against 100/60 = 1.67/min.
    limit = page.locator(f"{section} svg.chart line.limit")
    assert limit.count() == 1 and "10.0 per minute" in limit.locator("title").text_content()
    bars = page.locator(f"{section} svg.chart rect.bar")
    line_y = float(limit.get_attribute("y1"))
    # Every bar (9 starts) stays under the line (SVG y grows downwards).
    assert all(float(bars.nth(i).get_attribute("y")) > line_y for i in range(bars.count()))
    # The hour window has its own panel: 90 used, under its line at 100.
    hour = page.locator(f"{section} .policy-panel[data-policy='100 per 1h']")
    assert hour.get_attribute("data-shape") == "sliding window"
    assert "90/100 in the last 1h" in hour.locator(".policy-head").inner_text()
    chart = hour.locator("svg.window-chart")
    assert chart.get_attribute("data-peak") == "90"
    points = [float(p.split(",")[1]) for p in chart.locator("polyline.used").get_attribute("points").split()]
    hour_line = float(chart.locator("line.limit").get_attribute("y1"))
    assert min(points) > hour_line  # the highest point of use is under the limit line
    assert _style(page, f"{section} .policy-panel[data-policy='100 per 1h'] svg.window-chart line.limit", "stroke") == "rgb(186, 33, 33)"
    assert _style(page, f"{section} .policy-panel[data-policy='100 per 1h'] svg.window-chart polyline.used", "stroke") == "rgb(68, 126, 155)"
    minute = page.locator(f"{section} .policy-panel[data-policy='10 per 1m']")
    assert "0/10 in the last 1m" in minute.locator(".policy-head").inner_text()
    page.locator(section).screenshot(path=str(artifacts_dir / "dashboard-multi-window.png"))
    assert (artifacts_dir / "dashboard-multi-window.png").stat().st_size > 1000
