"""The app as people install it: the wheel's contents, and a new site that follows the README."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

from support.fakeapi import max_in_window
from support.processes import ROOT, Processes, wait_until

README_SECTION = "## Into an existing project"


def readme_blocks() -> list[tuple[str, str]]:
    """Return the (language, text) of every fenced block of the README's existing-project section."""
    text = (ROOT / "README.md").read_text()
    section = text.split(README_SECTION, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def block(first_line: str) -> str:
    """Return the python block of the section that starts with this comment line."""
    found = [body for lang, body in readme_blocks() if lang == "python" and body.startswith(first_line)]
    assert found, f"the README section has no block starting {first_line!r}"
    return found[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from the repository as pip would for `pip install <repository>`."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(ROOT)],
        check=True, timeout=300,
    )
    (built,) = out.glob("*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_ships_the_app_and_nothing_of_the_repository(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/", 1)[0] for name in names}
    assert top == {"dispatcher", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for shipped in (
        "dispatcher/py.typed",
        "dispatcher/backends.py",
        "dispatcher/migrations/0001_initial.py",
        "dispatcher/management/commands/dispense.py",
        "dispatcher/templates/admin/dispatcher/dashboard.html",
        "dispatcher/templates/admin/dispatcher/dashboard_key.html",
        "dispatcher/static/dispatcher/dashboard.css",
    ):
        assert shipped in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "requires-dist: django<6.2,>=5.2" in metadata.lower()
    assert "Classifier: Framework :: Django :: 5.2" in metadata
    assert "Classifier: Framework :: Django :: 6.1" in metadata
    assert "Requires-Python: >=3.11" in metadata


# Run in the new site's shell: what a visitor and a staff member get from the routed pages.
SITE_PAGES = """
import json
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment

setup_test_environment()  # the test client's host
visitor, staff = Client(), Client()
staff.force_login(User.objects.create_superuser("ops", password="not-a-secret"))
dashboard = staff.get("/dispatcher/dashboard/")
key_page = staff.get("/dispatcher/dashboard/key/partner:7/")
metrics = staff.get("/dispatcher/metrics")
to_login = visitor.get("/dispatcher/dashboard/")
print(json.dumps({
    "visitor": [to_login.status_code, to_login.get("Location")],
    "dashboard": [dashboard.status_code, "Dispatcher dashboard" in dashboard.content.decode()],
    "key_page": [key_page.status_code, 'data-key="partner:7"' in key_page.content.decode()],
    "metrics": [metrics.status_code, "dispatcher_" in metrics.content.decode()],
    "view_site": '<a href="/dispatcher/dashboard/">View site</a>' in staff.get("/admin/").content.decode(),
}))
"""


def _site_env(venv: Path, broker_url: str) -> dict[str, str]:
    """The environment of a user's shell: the site's virtualenv first, nothing of this repository."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DISPATCHER_", "DJANGO_", "CELERY_"))}
    env.pop("DATABASE_URL", None)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", CELERY_BROKER_URL=broker_url, PYTHONUNBUFFERED="1")
    return env


@pytest.mark.slow
@pytest.mark.embedded
def test_a_startproject_site_follows_the_readme_to_paced_calls_and_tasks(wheel, tmp_path, fake_api, redis_url):
    venv, home = tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = _site_env(venv, redis_url)

    def run(*args: str, cwd: Path, timeout: float = 120) -> str:
        done = subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(args)}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    # Outside the repository: pip resolves the wheel's dependency ranges, as for any user, without
    # the tasks extra: a site that uses no Tasks needs no backport.
    run("pip", "install", "--quiet", f"{wheel}[redis]", cwd=home, timeout=600)
    run("django-admin", "startproject", "mysite", cwd=home)
    site = home / "mysite"

    def readme(text: str) -> str:
        """The README's example, aimed at the fake API on 127.0.0.1."""
        # The host alone today; with its port where an allow-list entry names one.
        allowed = f'["127.0.0.1", "127.0.0.1:{fake_api.url.rsplit(":", 1)[1]}"]'
        return text.replace("https://api.example.com", fake_api.url).replace('["api.example.com"]', allowed)

    settings = site / "mysite" / "settings.py"
    settings.write_text(settings.read_text() + "\n" + readme(block("# mysite/settings.py (add at the end)\nimport os")))
    for name in ("celery.py", "__init__.py"):
        (site / "mysite" / name).write_text(readme(block(f"# mysite/{name}")))
    django6 = run("python", "-c", "import django; print(django.VERSION[0])", cwd=site).strip() != "5"
    if not django6:
        assert "No module named 'django_tasks'" in subprocess.run(
            ["python", "-c", "import django_tasks"], cwd=site, env=env, capture_output=True, text=True, timeout=60,
        ).stderr
    # The app loads, checks and migrates without Django Tasks (and, on 5.2, without the backport).
    run("python", "manage.py", "check", cwd=site)
    assert "Applying dispatcher.0001_initial... OK" in run("python", "manage.py", "migrate", cwd=site, timeout=300)

    # The README's URLs: the dashboard and the metrics through dispatcher.urls, no 404 on the way.
    (site / "mysite" / "urls.py").write_text(block("# mysite/urls.py"))
    pages = json.loads(run("python", "manage.py", "shell", "-c", SITE_PAGES, cwd=site).strip().splitlines()[-1])
    assert pages["visitor"] == [302, "/admin/login/?next=/dispatcher/dashboard/"]
    assert pages["dashboard"] == [200, True]
    assert pages["key_page"] == [200, True]
    assert pages["metrics"] == [200, True]
    assert pages["view_site"]

    # Then the README's Tasks section: on Django 5.2 the tasks extra and the backport's app.
    if not django6:
        run("pip", "install", "--quiet", f"{wheel}[redis,tasks]", cwd=home, timeout=600)
        settings.write_text(settings.read_text() + '\nINSTALLED_APPS += ["django_tasks"]\n')
    (site / "mysite" / "tasks.py").write_text(readme(block("# mysite/tasks.py")))
    tasks_settings = [b for lang, b in readme_blocks() if lang == "python" and "TASKS = {" in b]
    settings.write_text(settings.read_text() + "\n" + tasks_settings[0])
    assert "project" not in run("python", "-c", "import dispatcher, sys; print(sorted(sys.modules))", cwd=home)

    commands = [line.split() for lang, body in readme_blocks() if lang == "sh" for line in body.splitlines()]
    for command in commands:
        if command[:2] == ["python", "manage.py"] and "--loop" not in command:
            run(*command, cwd=site)
    long_running = [c for c in commands if c[:1] == ["celery"] or "--loop" in c]
    assert [c[:3] for c in long_running] == [["celery", "-A", "mysite"], ["python", "manage.py", "dispense"]]

    procs = Processes(env, tmp_path)  # exactly the user's shell, not this test run's environment
    try:
        for command in long_running:
            procs.start(command[0], *command, cwd=site)
        shell = block("# python manage.py shell\nfrom dispatcher.models")
        enqueue = block("# python manage.py shell\nfrom mysite.tasks")
        program = (
            readme(shell)
            + "\n"
            + "\n".join(readme(enqueue).replace('"acme"', f'"acme-{n}"') + "\nids.append(result.id)" for n in range(4))
        )
        out = run("python", "manage.py", "shell", "-c", "ids = []\n" + program + "\nprint('ids', call.id, *ids)", cwd=site)
        # The last line: Django's shell may first say which models it imported.
        _, call_id, *task_ids = out.strip().splitlines()[-1].split()

        read = (
            "import json\nfrom dispatcher.models import CallQueue, StartLog\n"
            + readme(block("# python manage.py shell (later")).replace("print(done.status, done.return_value)", "")
            .replace("done = fetch_account.get_result(result_id)", "")
            + f"\nresults = [fetch_account.get_result(i) for i in {task_ids!r}]"
            + f"\ncall = CallQueue.objects.get(pk={call_id})"
            + "\nstarts = [t.timestamp() for t in StartLog.objects.filter(key='partner').values_list('started_at', flat=True)]"
            + "\nprint(json.dumps({'call': call.status, 'tasks': [r.status for r in results],"
            + " 'values': [r.return_value if r.is_finished else None for r in results], 'starts': starts}))"
        )

        def state() -> dict:
            return json.loads(run("python", "manage.py", "shell", "-c", read, cwd=site).strip().splitlines()[-1])

        finished = wait_until(lambda: (s := state())["call"] == "done" and s["tasks"] == ["SUCCESSFUL"] * 4, 90, 1.0)
        assert finished, f"{state()}\n{procs.logs()}"
        final = state()
    finally:
        procs.stop_all()

    assert [v["account_id"] for v in final["values"]] == [f"acme-{n}" for n in range(4)]
    # One request each at the API, and the starts under "partner" kept 2 per second.
    assert Counter(a.path for a in fake_api.arrivals) == {
        "/v1/ping": 1, **{f"/v1/accounts/acme-{n}": 1 for n in range(4)}
    }
    assert len(final["starts"]) == 5 and max_in_window(final["starts"], 1.0) <= 2
