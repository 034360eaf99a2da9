"""A production configuration refuses to start without a real key; a 500 leaves a traceback in the log."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.processes import ROOT
from tests.e2e.test_compose import COMPOSE

SERVER_DATABASE = "postgres://dispatcher@127.0.0.1:5432/dispatcher_prod_check"


def run_manage(tmp_path, *args: str, **env: str | None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "DISPATCHER_VAR_DIR": str(tmp_path)}
    for name in ("DJANGO_SECRET_KEY", "DATABASE_URL"):
        environment.pop(name, None)
    environment.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("key", [
    None, "", "change-me-in-production", "insecure-dev-key-change-me",
    "django-insecure-3x#k9!q@7v$w2m^p8z&r5t*y1u(o0i)e4a+s6d-f", "a" * 64, "abab" * 16,
])
def test_a_database_server_without_a_real_key_refuses_to_start(tmp_path, key):
    run = run_manage(tmp_path, "check", DATABASE_URL=SERVER_DATABASE, DJANGO_SECRET_KEY=key)
    assert run.returncode != 0
    assert "ImproperlyConfigured" in run.stderr and "DJANGO_SECRET_KEY is not set (or is a placeholder" in run.stderr


def test_a_database_server_with_a_key_starts(tmp_path):
    run = run_manage(tmp_path, "check", DATABASE_URL=SERVER_DATABASE, DJANGO_SECRET_KEY="k" * 20 + "Zq8#x1!vB7$")
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("database_url", [None, "sqlite:///{tmp}/db.sqlite3"])
def test_the_embedded_default_needs_no_key(tmp_path, database_url):
    url = database_url.format(tmp=tmp_path) if database_url else None
    run = run_manage(tmp_path, "check", DATABASE_URL=url)
    assert run.returncode == 0, run.stderr


def test_compose_requires_a_secret_key_and_ships_no_placeholder():
    value = COMPOSE["x-environment"]["DJANGO_SECRET_KEY"]
    assert value.startswith("${DJANGO_SECRET_KEY:?"), value
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text().split("DJANGO_SECRET_KEY:", 1)[1].split("\n")[0].split(":?")[0]


SERVER_ERROR = """
import django
django.setup()
from unittest import mock
from django.test import Client

with mock.patch("dispatcher.api.json_text_depth", side_effect=RuntimeError("boom-in-a-view")):
    response = Client(raise_request_exception=False, HTTP_HOST="localhost").post(
        "/api/calls/", "{}", content_type="application/json", HTTP_AUTHORIZATION="Bearer t"
    )
print("status", response.status_code)
"""


def test_a_server_error_with_debug_off_leaves_a_traceback_in_the_log(tmp_path):
    env = {
        **os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "DJANGO_DEBUG": "false",
        "DISPATCHER_VAR_DIR": str(tmp_path), "DISPATCHER_API_TOKENS": "t",
    }
    env.pop("DATABASE_URL", None)
    run = subprocess.run([sys.executable, "-c", SERVER_ERROR], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert "status 500" in run.stdout, run.stdout + run.stderr
    assert "Internal Server Error: /api/calls/" in run.stderr
    assert "Traceback (most recent call last)" in run.stderr and "RuntimeError: boom-in-a-view" in run.stderr
