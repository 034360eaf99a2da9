import logging

from django.apps import AppConfig, apps
from django.db.backends.signals import connection_created
from django.db.models.signals import post_migrate
from django.urls import NoReverseMatch, Resolver404, resolve, reverse
from django.utils.functional import lazy


def view_site_url() -> str:
    """Return where the admin's "View site" leads: the site's root if it routes one, else the dashboard.

    A site made with startproject routes nothing at "/", so Django's default link is a 404; with
    neither, the link is left out (Django shows none for an empty ``site_url``).
    """
    try:
        resolve("/")
        return "/"
    except Resolver404:
        pass
    try:
        return reverse("dispatcher:dashboard")
    except NoReverseMatch:
        return ""


class DispatcherConfig(AppConfig):
    name = "dispatcher"
    verbose_name = "Dispatcher"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from dispatcher import checks  # noqa: F401 - registers system checks
        from dispatcher.beat import connect_beat_signals, on_post_migrate
        from dispatcher.liveness import connect_worker_signals
        from dispatcher.redact import RedactingFilter
        from dispatcher.store import functions
        from dispatcher.storedtimes import install as read_stored_times_within_bounds

        # Import every installed app's ``handlers`` module, as the admin does with ``admin``.
        autodiscover_modules("handlers")
        post_migrate.connect(on_post_migrate, sender=self)
        post_migrate.connect(functions.on_post_migrate, sender=self)
        connect_beat_signals()
        # Rows stored with a timestamp Python cannot read are read as a bound, not an error.
        connection_created.connect(read_stored_times_within_bounds, dispatch_uid="dispatcher.storedtimes")
        # Log lines and tracebacks (the dispatcher's own, Celery's for a task that raised, a 500's) are redacted.
        for name in ("dispatcher", "celery.app.trace", "django.request"):
            logger = logging.getLogger(name)
            if not any(isinstance(f, RedactingFilter) for f in logger.filters):
                logger.addFilter(RedactingFilter())
        connect_worker_signals()
        if apps.is_installed("django.contrib.admin"):
            from django.contrib import admin

            # Only Django's default: a site that chose its own "View site" keeps it. Read per page
            # (lazily), when the URLconf is loaded.
            if admin.site.site_url == "/":
                admin.site.site_url = lazy(view_site_url, str)()
        from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown

        from dispatcher.httpclient import close_client, warm_client
        from dispatcher.worker import warm_worker

        # The http handler's pooled client is built when a worker (or prefork child) starts, so
        # that a first call's request does not trail its recorded start by the client's set-up;
        # its connections end with the worker.
        worker_init.connect(warm_client, weak=False)
        worker_process_init.connect(warm_client, weak=False)
        # A worker's first start runs its statements warm too (a new process's first took 10-16 ms more).
        worker_init.connect(warm_worker, weak=False, dispatch_uid="dispatcher.worker.warm_worker")
        worker_process_shutdown.connect(close_client, weak=False)
        worker_shutdown.connect(close_client, weak=False)
