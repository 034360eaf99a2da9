"""Settings for the tests: the project's, plus a test app whose handlers the tests call."""
import importlib.util
import os
import tempfile

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

# SQLite's test database is a file, as the embedded default is, not Django's shared in-memory
# one: there a connection's write beside another's open transaction is refused at once ("database
# table is locked"), where a file database waits for SQLite's write lock (the settings' timeout).
# The delay writer's own connection (dispatcher.delaywriter) and the tests' threads write beside
# the test's connection. Its name is this process's own; Django creates and removes it.
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": os.path.join(tempfile.gettempdir(), f"dispatcher-tests-{os.getpid()}.sqlite3")
    }

# A second alias on the same database (a test mirror: no database of its own), so a test can
# show that every statement of a manager runs on the alias the manager uses (tests/integration/test_routing.py).
DATABASES = {**DATABASES, "other": {**DATABASES["default"], "TEST": {"MIRROR": "default"}}}  # noqa: F405
