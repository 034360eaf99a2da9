"""docker-compose.yml cannot run here (no Docker engine); check what can be checked."""
from __future__ import annotations

import importlib
import re
import subprocess
import sys

import yaml

from dispatcher.conf import DispatcherSettings
from support.processes import ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_compose_has_the_production_services_with_health_checks():
    assert {"postgres", "redis", "migrate", "web", "worker", "beat", "dispenser"} <= set(SERVICES)
    for name in ("postgres", "redis", "web", "worker"):
        assert "healthcheck" in SERVICES[name], name
    for name in ("web", "worker", "beat", "dispenser"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_every_service_command_names_a_real_module_or_command():
    commands = {name: svc["command"] for name, svc in SERVICES.items() if name not in ("postgres", "redis")}
    for name, command in commands.items():
        if command[0] == "python" and command[1] == "manage.py":
            run = subprocess.run([sys.executable, "manage.py", "help", command[2]], cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, (name, run.stderr)
        elif command[0] == "gunicorn":
            module, attr = command[1].split(":")
            assert callable(getattr(importlib.import_module(module), attr)), name
        elif command[0] == "celery":
            assert command[1:3] == ["-A", "project"] and command[3] in ("worker", "beat"), name
            assert importlib.import_module("project.celery").app.main == "project"
        else:
            raise AssertionError(f"{name}: unknown command {command}")


def test_every_environment_variable_is_read_by_the_settings():
    settings_text = (ROOT / "project" / "settings.py").read_text()
    known = set(re.findall(r"""(?:environ\.get|env_bool|env_list)\(\s*["']([A-Z_]+)["']""", settings_text))
    known |= {f"DISPATCHER_{name}" for name in vars(DispatcherSettings) if name.isupper()}
    for variable in COMPOSE["x-environment"]:
        assert variable in known, f"{variable} is set by docker-compose.yml but read by no setting"


def test_dockerfile_installs_the_pinned_requirements():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --no-cache-dir -r requirements.txt" in dockerfile
    assert "gunicorn" in (ROOT / "requirements.txt").read_text()


def test_the_image_collects_the_static_files_whitenoise_serves():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "manage.py collectstatic --noinput" in dockerfile
    assert "whitenoise==" in (ROOT / "requirements.txt").read_text()
