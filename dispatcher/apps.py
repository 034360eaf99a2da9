from django.apps import AppConfig
from django.db.models.signals import post_migrate


class DispatcherConfig(AppConfig):
    name = "dispatcher"
    verbose_name = "Dispatcher"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from dispatcher import checks  # noqa: F401 - registers system checks
        from dispatcher.beat import connect_beat_signals, on_post_migrate

        # Import every installed app's ``handlers`` module, as the admin does with ``admin``.
        autodiscover_modules("handlers")
        post_migrate.connect(on_post_migrate, sender=self)
        connect_beat_signals()
        from celery.signals import worker_init, worker_process_init, worker_process_shutdown, worker_shutdown

        from dispatcher.httpclient import close_client, warm_client

        # The http handler's pooled client is built when a worker (or prefork child) starts, so
        # that a first call's request does not trail its recorded start by the client's set-up;
        # its connections end with the worker.
        worker_init.connect(warm_client, weak=False)
        worker_process_init.connect(warm_client, weak=False)
        worker_process_shutdown.connect(close_client, weak=False)
        worker_shutdown.connect(close_client, weak=False)
