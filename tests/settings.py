"""Settings for the tests: the project's, plus a test app whose handlers the tests call."""
import importlib.util
import os

# The tests run on a PostgreSQL server too, which project.settings treats as production.
os.environ.setdefault("DJANGO_SECRET_KEY", "tests-only-key-not-secret-4f1c9a7e2b8d6035e1a9c7f2")

from project.settings import *  # noqa: E402, F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Django Tasks through dispatcher.backends (django.tasks on Django 6, the django-tasks backport on 5.2).
if importlib.util.find_spec("django.tasks") is None:
    INSTALLED_APPS = [*INSTALLED_APPS, "django_tasks"]
TASKS = {
    "default": {
        "BACKEND": "dispatcher.backends.DispatcherBackend",
        "QUEUES": ["default", "tasks-other"],
        "OPTIONS": {"keys": {"tests.testapp.tasks.fetch_account": ["partner", "partner:{account}"]}},
    }
}
# Test-client tests render the admin without running collectstatic first; the manifest storage
# of production would refuse to name files it has not hashed. The browser test serves the
# project's own settings (tests/browser/test_browser.py), manifest and WhiteNoise included.
STORAGES = {**STORAGES, "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}  # noqa: F405

# A second alias on the same database (a test mirror: no database of its own), so a test can
# show that every statement of a manager runs on the alias the manager uses (tests/integration/test_routing.py).
DATABASES = {**DATABASES, "other": {**DATABASES["default"], "TEST": {"MIRROR": "default"}}}  # noqa: F405
