"""Settings for the tests: the project's, plus a test app whose handlers the tests call."""
from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Test-client tests render the admin without running collectstatic first; the manifest storage
# of production would refuse to name files it has not hashed. The browser test serves the
# project's own settings (tests/test_browser.py), manifest and WhiteNoise included.
STORAGES = {**STORAGES, "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"}}  # noqa: F405
