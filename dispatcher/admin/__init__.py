"""The app's admin, by what it administers: calls (``calls``), rate and learnt limits (``policies``);
what the pages share is in ``common``. Importing the package registers them (Django's autodiscovery)."""
from django.contrib import admin

from dispatcher.admin import calls, policies

__all__ = ["calls", "policies"]

# The site's index says whether dispensers and workers run and links the dashboard, unless the
# project chose an index template of its own.
if admin.site.index_template is None:
    admin.site.index_template = "admin/dispatcher/index.html"
