"""Settings of the benchmark processes: the project's, plus the bench app's handlers and task."""
import os

# The benchmark runs on a PostgreSQL server, which project.settings treats as production.
os.environ.setdefault("DJANGO_SECRET_KEY", "bench-only-key-not-secret-8e2d4b6a1c9f3075d2b8e6a4")

from project.settings import *  # noqa: E402, F403

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]  # noqa: F405
LOGGING = {"version": 1, "disable_existing_loggers": False}
