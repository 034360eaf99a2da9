"""Settings of the benchmark processes: the project's, plus the bench app's handlers and task."""
from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "bench"]  # noqa: F405
LOGGING = {"version": 1, "disable_existing_loggers": False}
