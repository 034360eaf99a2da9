"""The app's admin, by what it administers: calls (``calls``), rate and learnt limits (``policies``);
what the pages share is in ``common``. Importing the package registers them (Django's autodiscovery)."""
from dispatcher.admin import calls, policies

__all__ = ["calls", "policies"]
