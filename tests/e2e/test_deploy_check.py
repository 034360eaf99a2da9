"""The production settings pass Django's deployment checklist."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.processes import ROOT


def test_check_deploy_is_clean_for_production_settings(tmp_path):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DJANGO_DEBUG": "false",
        "DJANGO_SECURE_HTTPS": "true",
        "DJANGO_SECRET_KEY": "x7#Qp!2vLm9@Zr4&Tn8^Wd1*Hs6%Kb3$Yf5(Jc0)Ug-Ae_Ro+Ni=Ml",
        "DJANGO_ALLOWED_HOSTS": "dispatcher.example.com",
        "DISPATCHER_VAR_DIR": str(tmp_path),
    }
    run = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "no issues" in run.stdout


def test_the_insecure_development_key_is_flagged_by_the_checklist(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "DISPATCHER_VAR_DIR": str(tmp_path)}
    env.pop("DJANGO_SECRET_KEY", None)
    run = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert run.returncode != 0 and "SECRET_KEY" in run.stdout + run.stderr


# Since Django 6.0 run_checks(databases=["default"]) hands every database to the model checks, which ask SQLite about
# JSON support: the checks need database access, as `manage.py check` has; the default one only
# (the test settings' "other" alias mirrors it, tests/integration/test_routing.py).
@pytest.mark.django_db
def test_check_warns_when_celery_would_reconnect_for_every_call(settings):
    from django.core.checks import run_checks

    del settings.CELERY_DB_REUSE_MAX
    assert "dispatcher.W001" in [m.id for m in run_checks(databases=["default"])]
    settings.CELERY_DB_REUSE_MAX = 1000
    assert "dispatcher.W001" not in [m.id for m in run_checks(databases=["default"])]


# Since Django 6.0 run_checks(databases=["default"]) hands every database to the model checks, which ask SQLite about
# JSON support: the checks need database access, as `manage.py check` has; the default one only
# (the test settings' "other" alias mirrors it, tests/integration/test_routing.py).
@pytest.mark.django_db
def test_check_refuses_fewer_than_one_call_per_message(settings):
    from django.core.checks import run_checks

    settings.DISPATCHER_CALLS_PER_MESSAGE = 0
    assert "dispatcher.E002" in [m.id for m in run_checks(databases=["default"])]
    settings.DISPATCHER_CALLS_PER_MESSAGE = "many"
    assert "dispatcher.E001" in [m.id for m in run_checks(databases=["default"])]
